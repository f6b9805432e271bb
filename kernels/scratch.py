"""Device buffers that kernels keep between launches (split partials, arrival counters).

A buffer is looked up by key and grows when a launch needs more; an outgrown one is kept alive,
never freed, because a captured CUDA graph may still point at it. No launch allocates, so the
launches can be captured.
"""

from __future__ import annotations

import torch

_BUFFERS: dict = {}
_RETIRED: list = []


def scratch(key, n: int, dtype: torch.dtype, device: torch.device, min_size: int = 1 << 14,
            zeroed: bool = False) -> torch.Tensor:
    """A buffer of at least n elements under `key` (allocated zeroed if `zeroed`; what launches
    leave in it is theirs to keep consistent)."""
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        alloc = torch.zeros if zeroed else torch.empty
        buf = _BUFFERS[key] = alloc(max(n, min_size), device=device, dtype=dtype)
    return buf


def has_scratch(key) -> bool:
    """Whether a buffer exists under `key` (a launch being captured must not be the one to make it)."""
    return key in _BUFFERS


def scratch_size(key) -> int:
    """Elements of the buffer under `key` (0 if none)."""
    buf = _BUFFERS.get(key)
    return 0 if buf is None else buf.numel()
