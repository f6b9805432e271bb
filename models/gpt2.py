"""GPT-2 (the `GPT2LMHeadModel` architecture) over a flat batch of tokens and a paged KV cache.

Learned absolute positions, pre-LayerNorm blocks, the MLP's activation from the config (GELU-tanh
for GPT-2), LM head tied to the token embedding. Activations are `[num_tokens, hidden]`: the batch
is packed, with no padding and no per-sequence dimension; where each token's K/V go and what it
attends to is in the `AttentionMetadata`.

Under tensor parallelism (models/parallel/) a rank holds its share of the heads (c_attn
column-parallel, each of Q, K and V split; the attention's c_proj row-parallel) and of the MLP
(c_fc column-, c_proj row-parallel), and its rows of the token table, which is also the LM head.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config

from kernels.fused_norm import add_layernorm, embed_layernorm
from models.attention import AttentionBackend, AttentionMetadata, make_backend
from models.parallel.group import shard_spec, tensor_parallel
from models.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, load_shard,
                                    parallel_logits, split_parts)
from models.spec import ModelSpec


class GPT2Attention(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int, backend: AttentionBackend, invariant: bool = False) -> None:
        super().__init__()
        self.num_heads = tensor_parallel().split(config.n_head, "attention heads")  # this rank's
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = ColumnParallelLinear(config.n_embd, 3 * config.n_embd, split_parts([config.n_embd] * 3, "width"),
                                           invariant=invariant)
        self.c_proj = RowParallelLinear(config.n_embd, config.n_embd, invariant=invariant, what="attention heads")
        self.scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1
        self.attn = backend

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.c_attn(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.c_proj(out.reshape(n, -1))


_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _activation(name: str):
    # transformers' "gelu_new" is GELU-tanh spelled out in eight elementwise ops, i.e. eight kernel
    # launches per layer per step; torch's fused tanh-approximate GELU computes the same function.
    if name in _GELU_TANH:
        return partial(F.gelu, approximate="tanh")
    # Imported only here: transformers.activations imports its hub-kernel and weight-conversion
    # modules (~1.3 s of CPU), which every engine process paid at start-up for GPT-2's GELU-tanh.
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config, invariant: bool = False) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = ColumnParallelLinear(config.n_embd, inner, split_parts([inner], "MLP width"), invariant=invariant)
        self.c_proj = RowParallelLinear(inner, config.n_embd, invariant=invariant, what="MLP width")
        self.act = _activation(config.activation_function)
        self.gelu_tanh = config.activation_function in _GELU_TANH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu_tanh and self.c_fc.invariant:  # the GEMM's own GELU epilogue
            return self.c_proj(self.c_fc(x, gelu=True))
        if self.gelu_tanh and x.is_cuda and x.dim() == 2 and self.c_fc.quant is None:
            # One kernel instead of two: cuBLASLt's GELU epilogue is the same tanh approximation
            # (computed in fp32 before rounding); a decode step at small batch is launch-bound.
            h = torch._addmm_activation(self.c_fc.bias, x, self.c_fc.weight.t(), use_gelu=True)
        else:
            h = self.act(self.c_fc(x))
        return self.c_proj(h)


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int, backend: AttentionBackend, invariant: bool = False) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx, backend, invariant)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config, invariant)

    def forward(self, x: torch.Tensor, h: torch.Tensor, kv_cache, meta: AttentionMetadata, next_norm: nn.LayerNorm,
                fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; h = ln_1(x). Returns the new residual stream and next_norm of it
        (the next block's ln_1, or the final ln_f), so each residual add shares a kernel with a norm."""
        x, h = _add_norm(x, self.attn(h, kv_cache, meta), self.ln_2, fused)
        return _add_norm(x, self.mlp(h), next_norm, fused)


def _add_norm(x: torch.Tensor, y: torch.Tensor, norm: nn.LayerNorm, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if fused:
        return add_layernorm(x, y, norm.weight, norm.bias, norm.eps)
    x = x + y
    return x, norm(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: GPT2Config, attention: str = "sdpa", deterministic: bool = False) -> None:
        super().__init__()
        if config.add_cross_attention:
            raise ValueError("GPT-2 checkpoints with cross-attention are not supported")
        self.config = config
        self.spec = shard_spec(ModelSpec.from_hf_config(config))  # this rank's heads
        self.attention = make_backend(attention, self.spec.head_dim, self.spec.num_heads // self.spec.num_kv_heads,
                                      deterministic)
        self.deterministic = deterministic
        # The table has rows up to a multiple of 64 (zeros past the vocabulary): the tied LM head's
        # GEMM then has an aligned N, which on an H100 is 2.7x faster at batch 256 than N = 50257.
        self.vocab_size = config.vocab_size
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i, self.attention, deterministic) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        # EAGLE-3 (models/eagle3.py): the residual stream entering these blocks (0: the embeddings),
        # handed to aux_sink(states, meta) after the last block; () = off, nothing computed
        self.aux_layers: tuple[int, ...] = ()
        self.aux_sink = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        sampled_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden] (after ln_f).

        Placeholder ids (-1 - r: sampled_ids[r]) are resolved by the embedding (models/base.py). On CUDA the embedding with the first
        norm, and each residual-add + LayerNorm pair, run as one Triton kernel (kernels/fused_norm.py);
        elsewhere as plain torch ops."""
        fused = input_ids.is_cuda
        ln = self.h[0].ln_1
        if fused and self.wte.tp.size == 1:  # (the kernel looks up the whole table)
            x, h = embed_layernorm(input_ids, positions, self.wte.weight, self.wpe.weight, ln.weight, ln.bias, ln.eps,
                                   sampled_ids)
        else:
            x, h = _add_norm(self.wte(input_ids, sampled_ids), self.wpe(positions), ln, fused)
        norms = [b.ln_1 for b in self.h[1:]] + [self.ln_f]
        aux = []
        for i, (block, kv_cache, norm) in enumerate(zip(self.h, kv_caches, norms)):
            if i in self.aux_layers:
                aux.append(x.clone())  # (on CUDA the block's residual add writes into x)
            x, h = block(x, h, kv_cache, meta, norm, fused)
        if aux:
            self.aux_sink(aux, meta)
        return h

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head in the model dtype, [n, padded vocab]: columns past vocab_size are padding."""
        return parallel_logits(hidden, self.wte.weight, self.deterministic, self.wte.tp)

    # Checkpoint names follow Hugging Face's; GPT-2's Conv1D stores weights as [in, out].
    _CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        own = dict(self.named_parameters())
        seen = set()
        for name, t in tensors.items():
            name = name.removeprefix("transformer.")
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                continue  # causal-mask buffers of old checkpoints; the head is tied to wte
            if name not in own:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            if name.endswith(self._CONV1D) and t.element_size() > 1:  # quantized formats store [out, in]
                t = t.t()
            t = load_shard(self, name, t)  # this rank's part (the token table's rows padded with zeros)
            if own[name].shape != t.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model {tuple(own[name].shape)}")
            with torch.no_grad():
                own[name].copy_(t)
            seen.add(name)
        missing = set(own) - seen
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
