"""The linear layer every family uses, and the LM head's matmul: cuBLAS by default, the
batch-invariant Triton GEMM (kernels/invariant_matmul.py) in the deterministic mode, where a row's
bits must not depend on how many other rows share the step (cuBLAS picks its tiles and split-K
from the batch size)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.invariant_matmul import invariant_linear


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) with a batch-invariant mode."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, invariant: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.invariant = invariant

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """x [n, in] -> [n, out]; gelu: GELU (tanh approximation) applied before rounding, in the
        invariant mode only (the default path fuses it through cuBLASLt's epilogue instead)."""
        if self.invariant:
            return invariant_linear(x, self.weight, self.bias, gelu=gelu)
        assert not gelu
        return F.linear(x, self.weight, self.bias)


def head_matmul(hidden: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor:
    """hidden [n, d] @ weight[V, d].T: the LM head (tied or not)."""
    if invariant:
        return invariant_linear(hidden, weight)
    return hidden @ weight.t()
