"""The linear layer every family uses, and the LM head's matmul: cuBLAS by default, the
batch-invariant Triton GEMM (kernels/invariant_matmul.py) in the deterministic mode, where a row's
bits must not depend on how many other rows share the step (cuBLAS picks its tiles and split-K
from the batch size), and a quant method's storage and GEMM for quantized weights (models/quant)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from kernels.invariant_matmul import invariant_linear


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

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """x [n, in] (or its FP8 form from the norm before, for a quant method that asked for it) ->
        [n, out]; gelu: GELU (tanh approximation) applied before rounding, in the invariant mode only
        (the default path fuses it through cuBLASLt's epilogue instead)."""
        if self.quant is not None:
            return self.quant.apply(self, x)
        if self.invariant:
            return invariant_linear(x, self.weight, self.bias, gelu=gelu)
        assert not gelu
        return F.linear(x, self.weight, self.bias)


def head_matmul(hidden: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor:
    """hidden [n, d] @ weight[V, d].T: the LM head (tied or not)."""
    if invariant:
        return invariant_linear(hidden, weight)
    return hidden @ weight.t()
