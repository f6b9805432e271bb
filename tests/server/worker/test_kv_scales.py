"""An fp8 KV cache's scales at start-up (server/worker/kv_scales.py, models/kv_scales.py): the
checkpoint's under every name the quantization tools write, else calibrated (and calibrated to what
the engine then writes), else 1.0 with a warning; e5m2 unscaled. On the CPU, through LLMEngine."""

from __future__ import annotations

import logging

import pytest
import torch

from server.config import EngineConfig
from server.engine import LLMEngine
from server.worker.kv_scales import CALIBRATION_TEXT, K_DIVISOR, V_DIVISOR
from tests.helpers import make_llama_checkpoint, with_tensors

LAYERS, KV_HEADS = 2, 2


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("plain"), "llama", num_hidden_layers=LAYERS,
                                 num_key_value_heads=KV_HEADS)


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", num_blocks=32, kv_cache_dtype="fp8", **kw))


def _scales(engine) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [(kc.scale, vc.scale) for kc, vc in engine.runner.kv_caches]
    return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])


@pytest.mark.parametrize("names", ["compressed-tensors", "modelopt", "kv_scale"])
def test_checkpoint_scales_are_used(plain, tmp_path, names):
    k = torch.tensor([[0.5, 0.25], [0.125, 2.0]])  # per head (compressed-tensors' "attn_head" strategy)
    v = torch.tensor([0.75, 3.0])  # per tensor
    tensors = {}
    for i in range(LAYERS):
        base = f"model.layers.{i}.self_attn"
        if names == "compressed-tensors":
            tensors |= {f"{base}.k_scale": k[i], f"{base}.v_scale": v[i : i + 1]}
        elif names == "modelopt":
            tensors |= {f"{base}.k_proj.k_scale": k[i], f"{base}.v_proj.v_scale": v[i]}
        else:
            tensors |= {f"{base}.kv_scale": v[i], f"{base}.q_scale": torch.tensor(9.0)}  # q_scale: not used
    engine = _engine(with_tensors(plain, tmp_path / "ckpt", tensors))  # the loader must skip them as weights
    got_k, got_v = _scales(engine)
    want_v = v[:, None].expand(LAYERS, KV_HEADS)
    assert torch.equal(got_k, want_v if names == "kv_scale" else k) and torch.equal(got_v, want_v)


def test_scales_missing_for_some_layers_stop_the_start(plain, tmp_path):
    path = with_tensors(plain, tmp_path / "ckpt", {"model.layers.0.self_attn.k_scale": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="not for"):
        _engine(path)


def test_calibrated_scales_map_the_calibration_text_to_the_divisors(plain):
    """Without checkpoint scales the engine calibrates at start-up: prefilling the calibration text
    then stores each head's largest |K| as +-K_DIVISOR and |V| as +-V_DIVISOR (up to fp8 rounding), so
    the calibration measured exactly what the engine writes."""
    from server.sampling_params import SamplingParams

    engine = _engine(plain)
    ids = engine.tokenizer(CALIBRATION_TEXT)["input_ids"][:200]
    engine.add_request("r", ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt's prefill: its K/V are in the cache
    table = engine.seqs["r"].blocks.block_table
    slots = torch.tensor([table[i // 16] * 16 + i % 16 for i in range(len(ids))])
    ks, vs = _scales(engine)
    for layer, (kc, vc) in enumerate(engine.runner.kv_caches):
        for cache, scales, divisor in ((kc, ks, K_DIVISOR), (vc, vs, V_DIVISOR)):
            stored = cache.view(torch.uint8).view(torch.float8_e4m3fn).reshape(-1, KV_HEADS, cache.shape[-1])
            top = stored[slots].float().abs().amax(dim=(0, 2))
            assert ((top >= divisor * 0.94) & (top <= divisor * 1.07)).all(), (layer, top, scales[layer])


def test_without_calibration_the_scales_are_one_with_a_warning(plain, caplog):
    with caplog.at_level(logging.WARNING, logger="flashpage.worker"):
        engine = _engine(plain, calculate_kv_scales=False)
    assert all(bool((s == 1).all()) for s in _scales(engine))
    assert "scales of 1.0" in caplog.text and "--no-calculate-kv-scales" in caplog.text


def test_e5m2_is_stored_unscaled(plain, caplog):
    with caplog.at_level(logging.INFO, logger="flashpage.worker"):
        engine = LLMEngine(EngineConfig(model=str(plain), device="cpu", num_blocks=32, kv_cache_dtype="fp8_e5m2"))
    assert all(bool((s == 1).all()) for s in _scales(engine))
    assert engine.runner.kv_caches[0][0].dtype == torch.float8_e5m2
    assert "unscaled" in caplog.text and "4x the tokens a float32 cache holds" in caplog.text


def _scale_tensors(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """llm-compressor's names: k_scale and v_scale per layer ([heads]: its "attn_head" strategy)."""
    return {f"model.layers.{i}.self_attn.{name}_scale": t[i] for i in range(LAYERS) for name, t in (("k", k), ("v", v))}


def test_per_head_scales_are_sliced_to_each_ranks_kv_heads(plain, tmp_path):
    """Under tensor parallelism a rank reads its own K/V heads' scales: split while there are enough
    heads (2 ranks: one each), shared by the ranks whose query heads use one (4 ranks: two a head).
    The two-rank server's own bring-up: tests/models/test_parallel.py."""
    from models import TensorParallel, checkpoint_kv_scales

    k, v = torch.tensor([[0.02, 0.03], [0.04, 0.025]]), torch.tensor([[0.01, 0.015], [0.02, 0.012]])
    path = with_tensors(plain, tmp_path / "ckpt", _scale_tensors(k, v))
    for size in (2, 4):
        for rank in range(size):
            head = rank * KV_HEADS // size
            got_k, got_v = checkpoint_kv_scales(path, LAYERS, KV_HEADS, TensorParallel(rank, size))
            assert torch.equal(got_k, k[:, head : head + 1]) and torch.equal(got_v, v[:, head : head + 1])


def test_quantized_weights_with_an_fp8_cache(plain, tmp_path):
    """An llm-compressor FP8 checkpoint with an FP8 KV cache (kv_cache_scheme, per-head k_scale and
    v_scale) serves with --kv-cache-dtype fp8 on the checkpoint's scales, and gives the greedy tokens
    of its dequantized weights as a 16-bit checkpoint with the same scales (on the CPU quantized
    linears compute on dequantized weights: the same numbers, so any difference is the cache's);
    --quantization fp8 of a 16-bit checkpoint calibrates its scales through the quantized model."""
    import json

    from benchmarks.quant.quant_checkpoint import quantize_checkpoint
    from server.sampling_params import SamplingParams

    k, v = torch.tensor([[0.02, 0.03], [0.04, 0.025]]), torch.tensor([[0.01, 0.015], [0.02, 0.012]])
    deq = quantize_checkpoint(plain, tmp_path / "q", "fp8-dynamic")
    quantized = with_tensors(tmp_path / "q", tmp_path / "ct", _scale_tensors(k, v))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "attn_head",
                                                        "dynamic": False, "symmetric": True}
    (quantized / "config.json").write_text(json.dumps(config))
    dense = with_tensors(plain, tmp_path / "dense", {**deq, **_scale_tensors(k, v)})
    prompts = [[5, 17, 99, 3, 250, 7, 42, 300, 11, 64, 128, 9, 77, 1, 2, 180, 33] * 2, [400, 12, 8, 250]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for name, path in (("ct", quantized), ("dense", dense)):
        engine = _engine(path)
        assert (engine.quantization is not None) == (name == "ct")
        got_k, got_v = _scales(engine)
        assert torch.equal(got_k, k) and torch.equal(got_v, v), name
        tokens[name] = [o.token_ids for o in engine.generate(prompts, greedy)]
    assert tokens["ct"] == tokens["dense"]
    online = _engine(plain, quantization="fp8")
    assert online.quantization is not None and online.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    got_k, _ = _scales(online)
    assert bool((got_k != 1).all() and got_k.isfinite().all())  # calibrated
    assert [len(o.token_ids) for o in online.generate(prompts, greedy)] == [12, 12]


def test_dummy_weights_calibrate_rather_than_read_the_checkpoints_scales(plain, tmp_path, caplog):
    """--load-format dummy: random weights, so the checkpoint's scales (made for its own weights) are
    not read; the scales are calibrated on the random model."""
    path = with_tensors(plain, tmp_path / "ckpt", _scale_tensors(torch.full((LAYERS, KV_HEADS), 0.5),
                                                                 torch.full((LAYERS, KV_HEADS), 0.5)))
    with caplog.at_level(logging.INFO, logger="flashpage.worker"):
        engine = _engine(path, load_format="dummy")
    got_k, got_v = _scales(engine)
    assert bool((got_k != 0.5).all() and (got_v != 0.5).all())
    assert "calibrated at start-up" in caplog.text
