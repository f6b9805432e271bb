"""The EAGLE-3 head in plain PyTorch, over one contiguous sequence recomputed from scratch: the
reference that models/eagle3.py (paged, batched, graph-captured) is tested against, and the module
whose `state_dict()` is the published checkpoint layout (`fc.*`, `midlayer.*`, `norm.*`, `lm_head.*`,
`d2t`, `t2d`, optionally `embed_tokens.*`; models/eagle3.py describes it), so random heads for tests
and benchmarks are written from it (benchmarks/shared/checkpoint.py `make_random_eagle3`).

Arithmetic as the EAGLE repository's and vLLM's heads do it: x = concat(input_layernorm(embedding),
hidden_norm(state)); r = state (or hidden_norm(state) with `norm_before_residual`) + attention(x);
out = r + mlp(post_attention_layernorm(r)); logits = lm_head(norm(out)). RoPE from transformers'
own rotary embedding of the head's config; causal attention over every position, K/V heads repeated
for grouped queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig


class RMSNormRef(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


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
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = (a.repeat_interleave(self.heads // self.kv, dim=0) for a in (k, v))
        scores = (q.float() @ k.float().transpose(1, 2)) * self.d**-0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v.float()).to(x.dtype)
        return self.o_proj(out.transpose(0, 1).reshape(t, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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
        self.input_layernorm, self.hidden_norm = RMSNormRef(h, eps), RMSNormRef(h, eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = RMSNormRef(h, eps)
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
        self.norm = RMSNormRef(h, config.rms_norm_eps)
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
