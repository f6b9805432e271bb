"""Programmatic dependent launch (PDL, compute capability 9.0 and up), off unless the engine turns
it on (EngineConfig.enable_pdl).

A decode step at batch 1 is a chain of small kernels, and each one's first microseconds (the launch,
then its first loads' latency before its memory stream is full) are spent while the GPU's memory
idles. A kernel launched with PDL (Triton's `launch_pdl`) may start while the kernel before it
still runs, once that kernel's programs have all triggered (`griddepcontrol.launch_dependents`) or
ended; it must wait (`griddepcontrol.wait`: until that kernel has finished and its writes are
visible) before it touches anything an earlier kernel writes or reads. A kernel that triggers
before its own wait (the GEMVs here) lets the next one start while it has not yet waited: so a
PDL-launched kernel reads nothing but immutable data (weights) before its wait, and writes nothing.

Here the decode GEMVs (kernels/gemv.py, gemv_int4.py) launch so: each program asks L2 for its
first two weight tiles (`prefetch.global.L2`; weights are read-only, so this may run early) and
then waits, so that a GEMV's weight stream starts in the tail of the norm, attention or silu_mul
before it; those trigger their dependents as they start. Transitively safe: a kernel that waits has
seen the end of the one before it, which waited for its own predecessor or was launched in order.

Contract: with PDL false (the default, the CPU, the interpreter, GPUs before sm_90) each helper
compiles to nothing and `launch_options` is empty: the kernels are exactly those without PDL.
Inside a CUDA graph the launches become programmatic edges (CUDA 12.3+).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_enabled = False


def enable(on: bool) -> None:
    """Turn PDL on or off for this process's launches (the worker, at start-up, before any capture)."""
    global _enabled
    _enabled = bool(on)


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def active(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL (their PDL constexpr)."""
    if not _enabled or _INTERPRET or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """The launch keyword a kernel that waits (`wait`) is launched with."""
    return {"launch_pdl": True} if active(device) else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """Until the kernel before has finished and its writes are visible (nothing without PDL)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel, if launched with PDL, start its programs (nothing without PDL)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def gemv_prologue(w_ptr, rows, rows_ok, row_len, lo, hi, LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    """A PDL-launched GEMV's start (nothing without PDL): L2 asked for LINES 128-byte lines (LINE
    weight elements each) of each of its `rows` (int64) from element `lo` of the row, those before
    `hi` (weights are read-only: safe before the wait; lanes out of range ask for w_ptr's line), then
    its dependents let start and the wait for the kernel before."""
    if PDL:
        cols = lo + tl.arange(0, LINES) * LINE
        ok = rows_ok[:, None] & (cols < hi)[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l",
                                  [tl.where(ok, w_ptr + rows[:, None] * row_len + cols[None, :], w_ptr)],
                                  dtype=tl.int32, is_pure=False, pack=1)
        launch_dependents(PDL)
        wait(PDL)


__all__ = ["active", "enable", "gemv_prologue", "launch_dependents", "launch_options", "wait"]
