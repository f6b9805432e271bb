"""The Llama family (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`)
over a flat batch of tokens and a paged KV cache.

One architecture with per-checkpoint switches: rotary positions (RoPE, with the `rope_type`s these
checkpoints use: default, `linear`, `llama3`, `yarn`; inverse frequencies from transformers' own
functions, so scaling matches it exactly), RMSNorm before attention and MLP, a gated SiLU MLP,
grouped-query (or multi-query) attention, biases on Q/K/V (Qwen2, or `attention_bias`), RMSNorm on
each head of Q and K (Qwen3), tied or untied LM head. Q/K/V and gate/up are merged into one GEMM
each at load. Activations are `[num_tokens, hidden]`; where each token's K/V go and what it attends
to is in the `AttentionMetadata` (models/attention/base.py).

On CUDA a decode step at small batch is bound by kernel launches, so there each residual add shares a
kernel with the next RMSNorm (kernels/rms_norm.py) and the MLP's SiLU-and-multiply is one launch
(kernels/silu_mul.py); elsewhere the same arithmetic runs as torch ops (the kernels' references: silu
bit-identical, RMSNorm within 2 ulp of torch's summation order). The rotation of Q and K is handed
to the attention backend (models/attention/base.py `Rope`), which does it in the launch that writes
K/V on the Triton backend (kernels/rope.py) and as torch ops on the others (bit-identical).

Under tensor parallelism (models/parallel/) a rank holds its share of the heads and of the MLP:
Q/K/V and gate/up column-parallel (each rank's slice of each part, still one GEMM), o_proj and
down_proj row-parallel (an all-reduce each), the token table and the LM head split by vocabulary.
`spec` is the rank's shard (its heads); the layers are built from the whole model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.rms_norm import rmsnorm
from models.attention import AttentionBackend, AttentionMetadata, Rope, make_backend
from models.linear import Linear
from models.parallel.group import shard_spec
from models.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, load_shard,
                                    parallel_logits, qkv_parts, split_parts)
from models.quant import add_rmsnorm_for, merge_parts, silu_mul_for, takes_16_bit
from models.spec import ModelSpec

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # what these families' checkpoints use


class RMSNorm(nn.Module):
    """As transformers computes it: the mean square in fp32, the weight applied after rounding back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return rmsnorm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; flashpage serves {', '.join(ROPE_TYPES)}")
    return {**params, "rope_type": rope_type}


class Rotary:
    """cos and sin of every position up to max_position_embeddings ([positions, head_dim] fp32),
    computed once at load; the attention backend looks a step's positions up (graph-safe: a gather)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, device: torch.device) -> None:
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type == "default":
            base = params.get("rope_theta") or config.rope_theta
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float, device=device)
        freqs = pos[:, None] * inv_freq.float().to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos() * scaling, emb.sin() * scaling


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: ModelSpec, backend: AttentionBackend, invariant: bool = False) -> None:
        """spec: the whole model's; this rank's heads are shard_spec(spec)'s."""
        super().__init__()
        local = shard_spec(spec)
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, spec.head_dim
        # attention_bias puts biases on all four projections; Qwen2 always has them on Q/K/V only.
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias or config.model_type == "qwen2"
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim,
                                             qkv_parts(spec), bias=qkv_bias, invariant=invariant)
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=bias, invariant=invariant,
                                        what="attention heads")
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, config.rms_norm_eps)
        self.scale = spec.head_dim**-0.5
        self.attn = backend

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache, meta: AttentionMetadata, reduce: bool = True) -> torch.Tensor:
        """reduce=False: this rank's part of o_proj's output (RowParallelLinear.forward)."""
        qkv = self.qkv_proj(x)  # x may be the FP8 form of the input a quantized qkv_proj asked for
        n, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k, v = q.view(n, self.num_heads, d), k.view(n, self.num_kv_heads, d), v.reshape(n, self.num_kv_heads, d)
        if self.qk_norm:
            if qkv.is_cuda:  # in place, on views of the QKV output
                rmsnorm(q, self.q_norm.weight, self.q_norm.eps, out=q)
                rmsnorm(k, self.k_norm.weight, self.k_norm.eps, out=k)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, rope)
        return self.o_proj(out.reshape(n, -1), reduce=reduce)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, invariant: bool = False) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * inter, split_parts([inter, inter], "MLP width"),
                                                 bias=bias, invariant=invariant)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, invariant=invariant, what="MLP width")
        self.inter = self.down_proj.in_features  # this rank's share
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported for {config.model_type} (silu only)")

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce=False: this rank's part of down_proj's output (RowParallelLinear.forward)."""
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:  # the down projection's FP8 input made in the same launch where it takes one
            return self.down_proj(silu_mul_for(self.down_proj, gate_up), reduce=reduce)
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up, reduce=reduce)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: ModelSpec, backend: AttentionBackend, invariant: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, spec, backend, invariant)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, invariant)

    def norm_consumers(self) -> tuple[tuple[RMSNorm, Linear], ...]:
        """The linears that read an RMSNorm's output, with that norm (models/quant bound_norm_inputs)."""
        return (self.input_layernorm, self.self_attn.qkv_proj), (self.post_attention_layernorm, self.mlp.gate_up_proj)

    def forward(self, x: torch.Tensor, h: torch.Tensor, rope: Rope, kv_cache, meta: AttentionMetadata,
                next_norm: RMSNorm, next_linear: Linear | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; h = input_layernorm(x). Returns the new residual stream and
        next_norm of it (the next layer's input norm, or the final norm), in the form next_linear
        (the next layer's qkv_proj, or None before the LM head) reads."""
        x, h = _add_norm(x, self.self_attn(h, rope, kv_cache, meta, reduce=False), self.self_attn.o_proj,
                         self.post_attention_layernorm, self.mlp.gate_up_proj)
        return _add_norm(x, self.mlp(h, reduce=False), self.mlp.down_proj, next_norm, next_linear)


def _add_norm(x: torch.Tensor, part: torch.Tensor, proj: RowParallelLinear, norm: RMSNorm,
              consumer: Linear | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x + proj's output (`part`: this rank's, not yet summed over the ranks) and its norm, in the form
    `consumer` reads. Under tensor parallelism with the custom all-reduce and a 16-bit consumer, the
    sum, the add and the norm are one launch (RowParallelLinear.reduce_add_rmsnorm)."""
    if takes_16_bit(consumer, x.shape[0]):  # (the custom all-reduce is CUDA's: None elsewhere)
        fused = proj.reduce_add_rmsnorm(part, x, norm.weight, norm.eps)
        if fused is not None:
            return fused
    y = proj.reduce(part)
    if x.is_cuda:  # x + y written into x; the norm quantized to FP8 there if the consumer's weights are
        return add_rmsnorm_for(consumer, x, y, norm.weight, norm.eps)
    x = x + y
    return x, norm(x)


class LlamaForCausalLM(nn.Module):
    """Also Mistral, Qwen2 and Qwen3 (models/registry.py maps their model_types here)."""

    def __init__(self, config: PretrainedConfig, attention: str = "sdpa", deterministic: bool = False) -> None:
        super().__init__()
        self.config = config
        whole = ModelSpec.from_hf_config(config)
        self.spec = shard_spec(whole)  # this rank's heads (all of them without tensor parallelism)
        rope_parameters(config)  # refuse an unsupported rope_type before any weight is read
        self.attention = make_backend(attention, self.spec.head_dim, self.spec.num_heads // self.spec.num_kv_heads,
                                      deterministic)
        self.deterministic = deterministic
        self.vocab_size = config.vocab_size
        # Rows up to a multiple of 64 (zero past the vocabulary): the LM head's GEMM gets an aligned N.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, whole, self.attention, deterministic)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.rotary: Rotary | None = None  # cos/sin tables, shared by every layer; set at load (needs the device)
        if not self.tied:  # the same vocabulary rows as the token table
            self.lm_head_weight = nn.Parameter(torch.empty(self.embed_tokens.rows, config.hidden_size))
            self.tp_shards = {"lm_head_weight": self.embed_tokens.tp_shards["weight"]}
        # EAGLE-3 (models/eagle3.py): the residual stream entering these layers (0: the embedding),
        # handed to aux_sink(states, meta) after the last layer; () = off, nothing computed
        self.aux_layers: tuple[int, ...] = ()
        self.aux_sink = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                sampled_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden] (after the
        last norm). Placeholder ids are resolved by the shared rule (models/base.py)."""
        rope = Rope(positions.long(), self.rotary.cos, self.rotary.sin)  # one per step, shared by the layers
        x = self.embed_tokens(input_ids, sampled_ids)
        h = self.layers[0].input_layernorm(x)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        consumers = [layer.self_attn.qkv_proj for layer in self.layers[1:]] + [None]
        aux = []
        for i, (layer, kv_cache, norm, consumer) in enumerate(zip(self.layers, kv_caches, norms, consumers)):
            if i in self.aux_layers:
                aux.append(x.clone())  # (on CUDA the layer's residual add writes into x)
            x, h = layer(x, h, rope, kv_cache, meta, norm, consumer)
        if aux:
            self.aux_sink(aux, meta)
        return h

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, padded vocab] in the model dtype: columns past vocab_size are padding."""
        weight = self.embed_tokens.weight if self.tied else self.lm_head_weight
        return parallel_logits(hidden, weight, self.deterministic, self.embed_tokens.tp)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hugging Face names in; q/k/v and gate/up concatenated into the merged projections (each
        copied as soon as its parts are in: `tensors` may be read one at a time), then cut to this
        rank's shard (models/parallel)."""
        own = dict(self.named_parameters())
        merged = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        count = {"qkv_proj": 3, "gate_up_proj": 2}
        parts: dict[str, dict[int, torch.Tensor]] = {}
        seen = set()
        for name, t in tensors.items():
            name = name.removeprefix("model.")
            if name == "lm_head.weight":
                if self.tied:
                    continue  # some tied checkpoints store the head too; the embedding is the head
                name = "lm_head_weight"
            elif name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints store RoPE's buffer; ours is computed at load
            module, _, leaf = name.rpartition(".")
            holder, _, proj = module.rpartition(".")
            if proj in merged:
                target, index = merged[proj]
                name = f"{holder}.{target}.{leaf}"
                pieces = parts.setdefault(name, {})
                pieces[index] = t
                if len(pieces) < count[target]:
                    continue
                t = merge_parts(leaf, [pieces[i] for i in sorted(pieces)])
                del parts[name]
            self._copy(own, name, t)
            seen.add(name)
        missing = set(own) - seen
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        device = self.embed_tokens.weight.device
        self.rotary = Rotary(self.config, self.spec.head_dim, device)

    def _copy(self, own: dict, name: str, t: torch.Tensor) -> None:
        if name not in own:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        p = own[name]
        with torch.no_grad():
            t = load_shard(self, name, t)  # this rank's part (the token table's rows padded with zeros)
            if p.shape != t.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model {tuple(p.shape)}")
            p.copy_(t)
