"""The linear layer every family uses, and the LM head's matmul: cuBLAS by default (a 16-bit row
alone on a GPU: kernels/gemv.py's gemv16, below), the batch-invariant Triton GEMM
(kernels/invariant_matmul.py) in the deterministic mode, where a row's bits must not depend on how
many other rows share the step (cuBLAS picks its tiles and split-K from the batch size), and a
quant method's storage and GEMM for quantized weights (models/quant)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gemv import gemv16
from kernels.invariant_matmul import invariant_linear

# A 16-bit linear reads its weight at one row (batch-1 decode, a draft model's steps) through
# kernels/gemv.py's gemv16 instead of cuBLAS. FLASHPAGE_GEMV16 (read when a layer is built; the
# tensor-parallel ranks inherit it): 0 (false, no, off) keeps cuBLAS; 1 (true, yes, on) takes it
# under the interpreter too; unset, CPU tensors keep torch's matmul (the interpreter's kernels cost
# CPU tests seconds). At one row cuBLAS runs a 4096 x 4096 o_proj in 64-channel tiles (by its
# kernel's name: 64 CTAs on 132 SMs), 20.6 us on an H100, and adds split-K partials in a second
# kernel (64 a step at the 8B shape, 110 us; profile_step,
# benchmarks/results/experiments/profile_step_llama-3.1-8b_tp1_h100.json). On an H200, batch-1
# TPOT at the Llama-3.1-8B shape 4.71 -> 4.45 ms, offline throughput within 1% (11,960 -> 11,853
# tok/s; experiments/gemv16_engine_h200.json); at the Llama-3.2-1B shape 1.13 -> 1.07 ms
# (experiments/gemv16_sweep_llama-3.2-1b_h200.json, the sweep's tiles; config16's: 1.067 ms,
# experiments/gemv16_engine_llama-3.2-1b_h200.json). Not yet measured on an H100. GPT-2's c_fc at
# one row keeps cuBLAS's fused GELU (models/gpt2.py).
GEMV16_ENV = "FLASHPAGE_GEMV16"
_SWITCH = {"0": "0", "false": "0", "no": "0", "off": "0", "1": "1", "true": "1", "yes": "1", "on": "1"}
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_STORAGE_LATER: ContextVar[bool] = ContextVar("storage_later", default=False)


@contextmanager
def storage_later() -> Iterator[None]:
    """Linears built inside allocate no 16-bit weight (it stays on the meta device): a quant method
    gives them their storage (models/quant attach), so a quantized model never holds its 16-bit size."""
    token = _STORAGE_LATER.set(True)
    try:
        yield
    finally:
        _STORAGE_LATER.reset(token)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) with a batch-invariant mode; with a quant
    method (`quant`, models/quant/methods.py) its weight's storage and its forward are the method's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, invariant: bool = False) -> None:
        later = _STORAGE_LATER.get()
        super().__init__(in_features, out_features, bias=bias and not later, device="meta" if later else None)
        if later and bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        self.invariant = invariant
        self.quant = None
        # "0": never; "1": under the interpreter too; "": on a GPU
        self.gemv16 = _SWITCH.get(os.environ.get(GEMV16_ENV, "").strip().lower(), "")

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """x [n, in] (or its FP8 form from the norm before, for a quant method that asked for it) ->
        [n, out]; gelu: GELU (tanh approximation) applied before rounding, in the invariant mode only
        (the default path fuses it through cuBLASLt's epilogue instead)."""
        if self.quant is not None:
            return self.quant.apply(self, x)
        if self.invariant:
            return invariant_linear(x, self.weight, self.bias, gelu=gelu)
        assert not gelu
        if self.gemv16 != "0" and self._one_row_16_bit(x):
            return gemv16(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _one_row_16_bit(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (x.dim() == 2 and x.shape[0] == 1 and (x.is_cuda or (_INTERPRET and self.gemv16 == "1"))
                and x.dtype in (torch.float16, torch.bfloat16)
                and w.dtype == x.dtype and x.stride(-1) == 1 and w.is_contiguous())


def head_matmul(hidden: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor:
    """hidden [n, d] @ weight[V, d].T: the LM head (tied or not)."""
    if invariant:
        return invariant_linear(hidden, weight)
    return hidden @ weight.t()
