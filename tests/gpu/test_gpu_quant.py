"""Quantized checkpoints on a GPU (skipped without CUDA), every format of
benchmarks/quant/quant_checkpoint.py on a small Llama (bf16, Triton attention):

- the GPU paths (FP8 through torch._scaled_mm and the fused RMSNorm-quantization on FP8 tensor cores,
  the Triton FP8 GEMM for 128x128 blocks, int4 dequantized in registers, and FP8 weight-only, the
  A100's path, forced) give the logits of the model dequantized at load, within the error of FP8
  activations (w8a8) or of bf16 (weight-only);
- the engine with CUDA graphs and asynchronous scheduling gives the greedy tokens it gives eagerly;
- --deterministic serves a quantized checkpoint dequantized at load: the tokens of a 16-bit
  checkpoint holding the same weights;
- the weights keep their quantized bytes on the device."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FORMATS = ("fp8-dynamic", "fp8-static", "fp8-block", "w4a16", "w4a16-asym", "awq", "gptq", "gptq-desc-act")
LLAMA = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2816,
             num_hidden_layers=3, vocab_size=2048, max_position_embeddings=1024, initializer_range=0.02)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from benchmarks.quant.quant_checkpoint import quantize_checkpoint
    from tests.helpers import make_llama_checkpoint

    root = tmp_path_factory.mktemp("gpu-quant")
    src = make_llama_checkpoint(root / "src", "llama", **LLAMA)
    return src, {fmt: (root / fmt, quantize_checkpoint(src, root / fmt, fmt, device="cuda")) for fmt in FORMATS}


def _prefill(model, ids):
    """One prefill through the model on the GPU (Triton attention), fp32 logits."""
    from kvcache import CacheSpec, allocate_kv_cache
    from models import StepRows

    s, n = model.spec, len(ids)
    cache = CacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, 16, torch.bfloat16)
    caches = allocate_kv_cache(cache, -(-n // 16) + 1, "cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    rows = StepRows(torch.arange(n, **i32), n, torch.tensor([0, n], **i32), torch.zeros(1, **i32),
                    torch.arange(-(-n // 16), **i32)[None], [n], [0])
    with torch.no_grad():
        hidden = model.forward(torch.tensor(ids, device="cuda"), torch.arange(n, device="cuda"), caches,
                               model.attention.metadata(rows))
        return model.lm_head(hidden)[:, : model.vocab_size].float()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("forced", [None, "weight_only"])
def test_gpu_paths_match_the_dequantized_model(checkpoints, monkeypatch, fmt, forced):
    import models.quant as quant
    from models import load_model, weights_info

    if forced and not fmt.startswith("fp8"):
        pytest.skip("int4 is weight-only already")
    path, _ = checkpoints[1][fmt]
    ids = torch.randint(0, 2048, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    monkeypatch.setattr(quant, "compute_mode", lambda *a: "dequant")
    dense = load_model(path, torch.bfloat16, "cuda", "triton")
    monkeypatch.undo()
    if forced:
        monkeypatch.setattr(quant, "compute_mode", lambda *a: forced)
    ours = load_model(path, torch.bfloat16, "cuda", "triton")
    linear = ours.layers[0].self_attn.qkv_proj
    assert linear.quant is not None and linear.quant.mode == (forced or ("w8a8" if fmt.startswith("fp8") else
                                                                          "weight_only"))
    if fmt == "fp8-dynamic" and not forced:
        assert linear.scaled_mm  # per-channel scales, bf16: torch._scaled_mm's rowwise mode
    assert weights_info(ours).bytes < 0.7 * weights_info(dense).bytes
    want, got = _prefill(dense, ids), _prefill(ours, ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    w8a8 = fmt.startswith("fp8") and not forced
    assert err < (0.1 if w8a8 else 0.02), err
    # (a random model with transformers' initializer range: its logits are close together, near-ties many)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > (0.75 if w8a8 else 0.97)


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "awq"])
def test_cuda_graphs_give_the_eager_tokens_up_to_near_ties(checkpoints, fmt):
    """The engine with CUDA graphs, asynchronous scheduling and chunked prefill against the same
    engine run eagerly. Graphs pad a step's rows, and the GEMMs' row tiles (and so their sums) can
    change with the row count, so sequences may part where the dequantized reference's two best
    tokens are nearly tied: within FP8 activations' error (w8a8) or bf16's (weight-only) of the
    largest logit. A wrong graph parts them at clear winners."""
    from tests.gpu.test_gpu_parity import _prompts, _run
    from tests.models.test_quant import reference

    src, formats = checkpoints
    path, deq = formats[fmt]
    prompts = _prompts(12, 1, 200) + [[7]]
    eager = _run(path, prompts, attention="triton", dtype="bfloat16", enforce_eager=True, async_scheduling=False)
    graphs = _run(path, prompts, attention="triton", dtype="bfloat16", max_num_batched_tokens=256)
    ref = reference(src, deq).cuda()
    tie = 0.1 if fmt.startswith("fp8") else 0.02
    exact = 0
    for prompt, a, b in zip(prompts, eager, graphs):
        if a == b:
            exact += 1
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + a[:i]], device="cuda")).logits[0, -1]
        gap = (logits[a[i]] - logits[b[i]]).abs().item()
        assert gap < tie * logits.abs().max().item(), f"parted at token {i} where the logits differ by {gap:.3f}"
    assert exact >= len(prompts) // 2, f"{exact} of {len(prompts)} identical"


def test_deterministic_mode_serves_the_dequantized_weights(checkpoints, tmp_path):
    from tests.gpu.test_gpu_parity import _prompts, _run
    from tests.models.test_quant import reference

    src, formats = checkpoints
    path, deq = formats["awq"]
    ref = reference(src, deq).to(torch.bfloat16)
    ref.save_pretrained(tmp_path / "dense")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            (tmp_path / "dense" / name).write_bytes((src / name).read_bytes())
    prompts = _prompts(6, 1, 100)
    kw = dict(attention="triton", dtype="bfloat16", deterministic=True)
    assert _run(path, prompts, **kw) == _run(tmp_path / "dense", prompts, **kw)
