"""models/linear.py: the default path is nn.Linear's; the invariant one is kernels/invariant_matmul.py
(with the GELU epilogue GPT-2's MLP uses), and a family built with deterministic=True uses it in
every projection and the LM head (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.invariant_matmul import invariant_linear
from models.linear import Linear, head_matmul


def test_default_is_nn_linear():
    layer = Linear(12, 5)
    x = torch.randn(3, 12)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with pytest.raises(AssertionError):
        layer(x, gelu=True)  # the fused GELU is the invariant path's only


def test_invariant_path():
    layer = Linear(40, 24, invariant=True).half()
    x = torch.randn(5, 40).half()
    assert torch.equal(layer(x), invariant_linear(x, layer.weight, layer.bias))
    assert torch.equal(layer(x, gelu=True), invariant_linear(x, layer.weight, layer.bias, gelu=True))
    w = torch.randn(64, 40).half()
    assert torch.equal(head_matmul(x, w, True), invariant_linear(x, w))
    assert torch.equal(head_matmul(x, w, False), x @ w.t())


def test_gemv16_takes_one_16_bit_row_unless_turned_off(monkeypatch):
    # by default on a GPU (read when the layer is built; =1: under the interpreter too): one 16-bit
    # row through kernels/gemv.py's gemv16, anything else (more rows, fp32, a quant method's layer)
    # as before; FLASHPAGE_GEMV16=0, never; unset, a CPU tensor takes torch's matmul
    import kernels.gemv
    import models.linear as linear

    calls = []
    real = kernels.gemv.gemv16
    monkeypatch.setattr(linear, "gemv16", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setenv(linear.GEMV16_ENV, "1")
    layer = Linear(300, 33).to(torch.bfloat16)
    x = torch.randn(4, 300).to(torch.bfloat16)
    one = layer(x[:1])
    ref = x[:1].double() @ layer.weight.double().t() + layer.bias.double()
    torch.testing.assert_close(one.double(), ref, atol=1e-2, rtol=8e-3)
    assert calls == [(1, 300)]
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)) and len(calls) == 1  # 4 rows: cuBLAS's
    wide = Linear(300, 33)
    wide(torch.randn(1, 300))  # fp32: cuBLAS's
    assert len(calls) == 1
    assert layer(x[None, :2]).shape == (1, 2, 33) and len(calls) == 1  # a leading 1 of a 3-d input is no row
    for off in ("0", "false", "Off "):
        monkeypatch.setenv(linear.GEMV16_ENV, off)
        Linear(300, 33).to(torch.bfloat16)(x[:1])
        assert len(calls) == 1, off  # turned off: cuBLAS's
    monkeypatch.delenv(linear.GEMV16_ENV)
    unset = Linear(300, 33).to(torch.bfloat16)
    unset(x[:1])
    assert len(calls) == 1 and unset.gemv16 != "0"  # on, but a CPU tensor takes torch's matmul


def test_families_use_it(tiny_ckpt):
    """Every Linear of a deterministic model is invariant, and it has no other nn.Linear."""
    from models import load_model

    model = load_model(tiny_ckpt, torch.float16, "cpu", "triton", deterministic=True)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, Linear) and m.invariant for m in linears)
    assert model.deterministic and model.attention.deterministic
    plain = load_model(tiny_ckpt, torch.float16, "cpu", "triton")
    assert not any(m.invariant for m in plain.modules() if isinstance(m, Linear))
