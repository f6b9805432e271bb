"""The EAGLE-3 head in plain PyTorch, over one contiguous sequence recomputed from scratch: the
reference that models/eagle3.py (paged, batched, graph-captured) is tested against, and the module
whose `state_dict()` is the published checkpoint layout (`fc.*`, `midlayer.*`, `norm.*`, `lm_head.*`,
`d2t`, `t2d`, optionally `embed_tokens.*`; models/eagle3.py describes it), so random heads for tests
and benchmarks and the embedded model's trained head are written from it (`head_config`, `save_head`;
benchmarks/shared/checkpoint.py `make_random_eagle3`, tools/embedded/train_eagle3.py).

Arithmetic as the EAGLE repository's and vLLM's heads do it: x = concat(input_layernorm(embedding),
hidden_norm(state)); r = state (or hidden_norm(state) with `norm_before_residual`) + attention(x);
out = r + mlp(post_attention_layernorm(r)); logits = lm_head(norm(out)). RoPE from transformers'
own rotary embedding of the head's config; causal attention over every position, K/V heads repeated
for grouped queries.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # the norm the target's reference uses


class _Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.heads, self.kv, self.d = heads, kv, getattr(config, "head_dim", None) or h // heads
        self.q_proj = nn.Linear(2 * h, heads * self.d, bias=False)
        self.k_proj = nn.Linear(2 * h, kv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * h, kv * self.d, bias=False)
        self.o_proj = nn.Linear(heads * self.d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, self.d).transpose(0, 1)
        k = self.k_proj(x).view(t, self.kv, self.d).transpose(0, 1)
        v = self.v_proj(x).view(t, self.kv, self.d).transpose(0, 1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = (a.repeat_interleave(self.heads // self.kv, dim=0) for a in (k, v))
        scores = (q.float() @ k.float().transpose(1, 2)) * self.d**-0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v.float()).to(x.dtype)
        return self.o_proj(out.transpose(0, 1).reshape(t, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class _Mlp(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Midlayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm, self.hidden_norm = LlamaRMSNorm(h, eps), LlamaRMSNorm(h, eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps)
        self.mlp = _Mlp(config)


class Eagle3Reference(nn.Module):
    """An EAGLE-3 head (`config`: its config.json as a LlamaConfig, `draft_vocab_size` and
    `target_hidden_size` read where present); `embed`: the target's token table, unless the head
    has its own (`own_embedding`)."""

    def __init__(self, config: LlamaConfig, own_embedding: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or h
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.config = config
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.midlayer = _Midlayer(config)
        self.norm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embedding else None
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary = LlamaRotaryEmbedding(config)

    def step(self, embeds: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """embeds, states [t, hidden] at positions 0..t-1 -> the layer's outputs before `norm`."""
        m = self.midlayer
        pos = torch.arange(embeds.shape[0], device=embeds.device)[None]
        cos, sin = (c[0, None] for c in self.rotary(states[None], pos))
        h = m.hidden_norm(states)
        residual = h if getattr(self.config, "norm_before_residual", False) else states
        x = residual + m.self_attn(torch.cat([m.input_layernorm(embeds), h], dim=-1), cos, sin)
        return x + m.mlp(m.post_attention_layernorm(x))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[n, draft vocabulary] logits of `step` outputs."""
        return self.lm_head(self.norm(out))

    def propose(self, tokens: list[int], aux: torch.Tensor, k: int, embed: nn.Module | None = None) -> list[int]:
        """k greedy proposals (target ids) after `tokens`: position p pairs the fused target state
        at p (aux[p]: the three layers' states concatenated, for p < len(tokens) - 1) with token
        p + 1; each further step appends the last proposal with the last output state."""
        embed = self.embed_tokens if self.embed_tokens is not None else embed
        n = len(tokens)
        states = self.fc(aux[: n - 1])
        ids = list(tokens[1:])
        out = []
        for _ in range(k):
            o = self.step(embed(torch.tensor(ids, device=aux.device)), states)
            d = int(self.logits(o[-1:]).argmax(-1))
            out.append(d + int(self.d2t[d]))
            ids.append(out[-1])
            states = torch.cat([states, o[-1:]])
        return out

    def set_draft_vocabulary(self, ids: torch.Tensor) -> None:
        """The target ids the draft vocabulary holds (its size of them, sorted into d2t and t2d)."""
        ids = ids.sort().values.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True


def head_config(target, draft_vocab: int, layer_ids: list[int] | None = None, **fields) -> dict:
    """config.json of a head of one layer of `target`'s shape (its transformers config; a GPT-2
    target's head is Llama-shaped all the same, with RoPE of its own): `draft_vocab` tokens,
    `eagle_config.eagle_aux_hidden_state_layer_ids` when `layer_ids` is given (else the default
    layers), `target_hidden_size` where `fields` give the head another width."""
    t, heads = target, target.num_attention_heads
    d = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=t.hidden_size,
             intermediate_size=getattr(t, "intermediate_size", None) or getattr(t, "n_inner", None) or 4 * t.hidden_size,
             num_attention_heads=heads, num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
             head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads, num_hidden_layers=1, hidden_act="silu",
             rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6), vocab_size=t.vocab_size, draft_vocab_size=draft_vocab,
             max_position_embeddings=min(t.max_position_embeddings, 2048), tie_word_embeddings=False,
             rope_parameters=dict(getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e4}))
    if layer_ids is not None:
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    d.update(fields)
    if d["hidden_size"] != t.hidden_size:
        d["target_hidden_size"] = t.hidden_size
    return d


def save_head(head: Eagle3Reference, config: dict, path: str | Path, dtype: torch.dtype) -> Path:
    """`head` in the published layout at `path`: config.json (`config`, with `dtype`) and
    model.safetensors (its state dict: floating tensors in `dtype`, d2t int64, t2d bool)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config, "dtype": str(dtype).removeprefix("torch.")}, indent=2) + "\n")
    return path
