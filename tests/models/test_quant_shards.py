"""Quantized checkpoints under tensor parallelism (models/quant/shards.py), on the CPU:

- each rank's share of every linear, dequantized at load, is the whole model's dequantized weight cut
  by the 16-bit weight's Shard (shard-then-dequantize == dequantize-then-shard), for every format of
  benchmarks/quant/quant_checkpoint.py, on a Llama with biases on its column- and row-parallel
  projections and on GPT-2 (Conv1D weights) in GPTQ with desc_act; --quantization fp8 quantizes each
  rank's 16-bit share;
- a rank's share of a desc_act layer keeps every group's scales, and the GPU's weight-only GEMMs
  (forced, under the interpreter) read it as the CPU dequantizes it;
- the splits that would cut a 128x128 block or a 128-column group are refused naming the layer;
- two gloo ranks give one rank's greedy tokens, and its logits within fp32 rounding (the CPU serves
  the dequantized weights, so only the order of the row-parallel sums differs), in each format family.
"""

from __future__ import annotations

import pytest
import torch

import models.quant as quant
from benchmarks.quant.quant_checkpoint import FORMATS, quantize_checkpoint
from kernels.quant_reference import dequant_fp8
from models import check_quantized_split, load_model
from models.linear import Linear
from models.parallel import TensorParallel, built_as
from models.quant.fp8 import quantize_per_channel
from tests.helpers import QUANT_TP_LLAMA, make_checkpoint, make_llama_checkpoint, prefill_logits, run_ranks

PROMPT = [5, 17, 99, 3, 250, 7, 42, 300, 11, 64, 128, 9, 77]
GPT2 = "gpt2-gptq-desc-act"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A Llama of QUANT_TP_LLAMA's shape in every format, and a GPT-2 (biases on every projection,
    Conv1D weights, heads of 128) in GPTQ with desc_act: {"src": the 16-bit Llama, name: path}."""
    root = tmp_path_factory.mktemp("quantized-tp")
    out = {"src": make_llama_checkpoint(root / "src", "llama", **QUANT_TP_LLAMA)}
    gpt2 = make_checkpoint(root / "gpt2-src", n_embd=256, n_head=2)
    for name, source, fmt in [(fmt, out["src"], fmt) for fmt in FORMATS] + [(GPT2, gpt2, "gptq-desc-act")]:
        out[name] = root / name
        quantize_checkpoint(source, out[name], fmt, dequantized=False)
    return out


@pytest.fixture(scope="module")
def whole(ckpts):
    """The one-rank model of a checkpoint (dequantized at load), loaded once."""
    loaded = {}

    def get(name: str, quantization: str | None = None):
        if (name, quantization) not in loaded:
            loaded[name, quantization] = load_model(ckpts[name], torch.float32, "cpu", "sdpa", quantization=quantization)
        return loaded[name, quantization]
    return get


@pytest.mark.parametrize("case", (*FORMATS, "online-fp8", GPT2))
def test_a_ranks_dequantized_share_is_the_whole_dequantized_weight_cut(ckpts, whole, case):
    """Rank 1 of 2 (its cuts start past 0, and its row-parallel biases are zeros)."""
    name, quantization = ("src", "fp8") if case == "online-fp8" else (case, None)
    with built_as(TensorParallel(1, 2)):
        part = load_model(ckpts[name], torch.float32, "cpu", "sdpa", quantization=quantization)
    ref = whole(name, quantization)
    assert part.quant_scheme == ref.quant_scheme
    linears = [(n, m) for n, m in part.named_modules() if isinstance(m, Linear)]
    assert len(linears) == 8
    for n, linear in linears:
        cut, full = linear.tp_shards["weight"], ref.get_submodule(n)
        assert linear.weight.shape[cut.dim] == full.weight.shape[cut.dim] // 2, n
        if quantization:  # --quantization fp8: the rank's share of the 16-bit weight, quantized per channel
            want = dequant_fp8(*quantize_per_channel(cut.take(whole(name).get_submodule(n).weight)), 1 << 30,
                               torch.float32)
        else:
            want = cut.take(full.weight)
        assert torch.equal(linear.weight, want), f"{case}: {n}"
        if linear.bias is not None:  # column-parallel: the rank's rows; row-parallel: zeros past rank 0
            assert torch.equal(linear.bias, linear.tp_shards["bias"].take(full.bias)), n


def test_a_desc_act_share_keeps_every_groups_scales_for_the_gpu_gemms(ckpts, monkeypatch):
    """Rank 1's down projection (128 of 256 input columns, whose groups lie anywhere in the layer) in
    the GPU's weight-only mode: both groups' scales and zero points, its columns' g_idx, and the GEMMs
    of each row count (GEMV, in-register tiles, dequantized into memory for the 16-bit GEMM) give x
    times the share the CPU dequantizes."""
    with built_as(TensorParallel(1, 2)):
        dense = load_model(ckpts["gptq-desc-act"], torch.float16, "cpu", "sdpa").layers[0].mlp.down_proj
        monkeypatch.setattr(quant, "compute_mode", lambda *a: "weight_only")
        down = load_model(ckpts["gptq-desc-act"], torch.float16, "cpu", "sdpa").layers[0].mlp.down_proj
    assert down.qweight.shape == (256, 128 // 8) and down.scales.shape == down.zeros.shape == (256, 2)
    assert down.g_idx.shape == (128,) and set(down.g_idx.tolist()) == {0, 1}  # both groups in one half
    for rows in (1, 3, 17):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).half()
        want = (x.float() @ dense.weight.float().t()).half()
        torch.testing.assert_close(down.quant.apply(down, x), want, atol=2e-2, rtol=2e-2)


def test_splits_that_cut_a_block_or_a_group_are_refused_naming_the_layer(ckpts):
    """At four ranks each would hold 64 of the MLP's 256 columns: half a 128x128 block of gate/up's FP8
    rows, half a group of down_proj's int4 inputs (vLLM refuses both): refused before any rank
    starts (server/worker/setup.py), and by a rank's own load. Per-channel FP8 splits at any size."""
    block = (r"layers\.0\.mlp\.gate_up_proj \(fp8 \(128x128 blocks\)\): --tensor-parallel-size 4 gives a rank "
             r"output rows 0 to 64 of this projection, which are not whole 128x128 weight blocks")
    group = (r"layers\.0\.mlp\.down_proj \(GPTQ .*\): --tensor-parallel-size 4 gives each rank 64 of its 256 input "
             r"features, which is not a whole number of the weights' 128-column groups")
    for fmt, message in (("fp8-block", block), ("gptq", group)):
        with pytest.raises(ValueError, match=message):
            check_quantized_split(ckpts[fmt], None, 4)
        check_quantized_split(ckpts[fmt], None, 2)  # whole blocks and groups at two
    with built_as(TensorParallel(3, 4)):
        with pytest.raises(ValueError, match=group):
            load_model(ckpts["gptq-desc-act"], torch.float32, "cpu", "sdpa")
        part = load_model(ckpts["fp8-dynamic"], torch.float32, "cpu", "sdpa")
    assert part.layers[0].mlp.down_proj.weight.shape == (256, 64)
    check_quantized_split(ckpts["src"], "fp8", 4)  # quantized at load: the 16-bit weights split at any size


# a format of each family: FP8 per channel (compressed-tensors), FP8 in 128x128 blocks, GPTQ's int4 with
# act order (every group's scales on each rank; compressed-tensors' W4A16 shares its path), AWQ's
E2E = ("fp8-dynamic", "fp8-block", "gptq-desc-act", "awq")


def _greedy(model, n: int = 8) -> list[int]:
    """PROMPT and n greedy tokens after it (each a prefill of the whole sequence so far)."""
    ids = list(PROMPT)
    for _ in range(n):
        ids.append(int(prefill_logits(model, ids)[-1].argmax()))
    return ids


def _rank(rank: int, size: int, port: int, cases: list, out) -> None:
    """Each case's logits over one rank's greedy sequence, in one prefill (rank 0 reports them)."""
    from torch.distributed import TCPStore

    from models import close_tensor_parallel, init_tensor_parallel

    init_tensor_parallel(rank, size, TCPStore("127.0.0.1", port, size, is_master=rank == 0), torch.device("cpu"))
    try:
        for name, path, ids in cases:
            logits = prefill_logits(load_model(path, torch.float32, "cpu", "sdpa"), ids)
            if rank == 0:
                out.put((name, logits.numpy()))
    finally:
        close_tensor_parallel()


def test_two_ranks_give_one_ranks_greedy_tokens_in_each_format_family(ckpts, whole):
    """One rank's greedy sequence is the two ranks' too when the two ranks' logits over it (one
    prefill: a forward each, the collectives being what costs on two shared cores) choose each of
    its tokens in turn."""
    greedy = {name: _greedy(whole(name)) for name in E2E}
    got = run_ranks(_rank, 2, ([(name, ckpts[name], greedy[name]) for name in E2E],), len(E2E))
    for name in E2E:
        ids = greedy[name]
        assert len(set(ids[len(PROMPT):])) > 2, name  # a sequence, not one token repeated
        logits = torch.from_numpy(got[name][0])
        assert logits[len(PROMPT) - 1 : -1].argmax(-1).tolist() == ids[len(PROMPT):], name
        torch.testing.assert_close(logits, prefill_logits(whole(name), ids), rtol=0, atol=1e-4, msg=name)
