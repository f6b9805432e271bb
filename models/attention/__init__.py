"""Attention over the paged KV cache: one contract (models/attention/base.py), three backends.

- `triton`: our kernels (models/attention/triton_backend.py).
- `eager`, `sdpa`: plain PyTorch over gathered pages (models/attention/torch_backend.py).
"""

from __future__ import annotations

from models.attention.base import AttentionBackend, AttentionMetadata, Rope, StepRows

BACKENDS = ("triton", "eager", "sdpa")


def make_backend(kind: str, head_dim: int, group: int = 1, deterministic: bool = False) -> AttentionBackend:
    """`group`: query heads per K/V head (1 without grouped-query attention). `deterministic`:
    batch-invariant attention (triton only: the other backends' reductions are torch's)."""
    if kind == "triton":
        from models.attention.triton_backend import TritonAttention  # imports triton: only when asked for

        return TritonAttention(head_dim, group, deterministic)
    if deterministic:
        raise ValueError(f"deterministic mode needs the triton attention backend (its batch-invariant kernels), "
                         f"not {kind!r}: pass --attention triton (off the GPU only under TRITON_INTERPRET=1)")
    if kind in ("eager", "sdpa"):
        from models.attention.torch_backend import TorchAttention

        return TorchAttention(kind)
    raise ValueError(f"unknown attention backend {kind!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "Rope", "StepRows", "make_backend"]
