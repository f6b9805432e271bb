"""Worker start-up decisions that need no device: --dtype auto, and the sliding-window refusal."""

import json
import shutil

import torch

from server.worker.setup import auto_dtype


def _config(tmp_path, **fields):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    return tmp_path


def test_dtype_auto_follows_a_half_precision_checkpoint_on_cuda(tmp_path):
    assert auto_dtype(_config(tmp_path, dtype="bfloat16"), on_cuda=True) == torch.bfloat16
    assert auto_dtype(_config(tmp_path, torch_dtype="float16"), on_cuda=True) == torch.float16  # the older key


def test_dtype_auto_is_float16_on_cuda_for_full_precision_or_unnamed_checkpoints(tmp_path):
    assert auto_dtype(_config(tmp_path, dtype="float32"), on_cuda=True) == torch.float16
    assert auto_dtype(_config(tmp_path), on_cuda=True) == torch.float16


def test_dtype_auto_is_float32_on_the_cpu(tmp_path):
    assert auto_dtype(_config(tmp_path, dtype="bfloat16"), on_cuda=False) == torch.float32


def test_a_kv_budget_that_holds_no_block_stops_the_start_naming_the_flag():
    """Issue 23, case 8: a cache of 0 blocks started a server that refused every request."""
    import pytest

    from kvcache import CacheSpec
    from server.config import EngineConfig
    from server.worker.setup import kv_cache_blocks

    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="--cpu-kv-cache-memory"):
        kv_cache_blocks(EngineConfig(cpu_kv_cache_memory=spec.bytes_per_block), spec, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        kv_cache_blocks(EngineConfig(kv_cache_memory=100), spec, None, torch.device("cpu"))
    assert kv_cache_blocks(EngineConfig(cpu_kv_cache_memory=3 * spec.bytes_per_block), spec, None,
                           torch.device("cpu")) == 2  # one block of the budget pays for the scratch block


def test_tensor_parallelism_refuses_what_it_does_not_combine_with_before_any_rank_starts(tiny_ckpt, tmp_path):
    """Heads that do not divide, a quantization format flashpage does not serve and a quantized layer
    whose 128x128 blocks a rank's share would cut stop the start at once, naming the reason, before
    a rank's process is started (none is: this returns in milliseconds). Quantized weights that
    split pass (each rank cuts its share: tests/models/test_quant_shards.py), and so does speculative
    decoding (its draft runs whole on rank 0: tests/server/worker/parallel/test_speculation.py)."""
    import pytest

    from server.config import EngineConfig, SpeculativeConfig
    from server.worker.setup import check_tensor_parallel, start_worker

    tp = dict(model=str(tiny_ckpt), device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="attention heads"):
        start_worker(EngineConfig(**{**tp, "tensor_parallel_size": 3}), tiny_ckpt)
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}')
    check_tensor_parallel(EngineConfig(**tp, speculative_config=spec), tiny_ckpt)  # no ValueError
    check_tensor_parallel(EngineConfig(**tp, quantization="fp8"), tiny_ckpt)  # no ValueError
    quantized = tmp_path / "quantized"  # a quantized checkpoint, no flag: its config.json says so
    shutil.copytree(tiny_ckpt, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"h\.0\.attn\.c_attn \(fp8 \(128x128 blocks\)\): --tensor-parallel-size 2 "
                                         r"gives a rank output rows 0 to 32"):  # GPT-2's 64-wide parts
        start_worker(EngineConfig(**{**tp, "model": str(quantized)}), quantized)
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        start_worker(EngineConfig(**{**tp, "model": str(quantized)}), quantized)


def test_tensor_parallelism_takes_a_quantization_config_of_kv_cache_scales_alone(tmp_path):
    """A compressed-tensors config whose quantization_config carries only an FP8 KV cache's scheme has
    16-bit weights: tensor parallelism takes it (the scales are cut by rank like the heads)."""
    from server.config import EngineConfig
    from server.worker.setup import check_tensor_parallel

    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                 num_hidden_layers=2, vocab_size=512, max_position_embeddings=128, rms_norm_eps=1e-6)
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    kv_only = _config(tmp_path / "kv", **shape, quantization_config={
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}, "kv_cache_scheme": kv})
    check_tensor_parallel(EngineConfig(tensor_parallel_size=2), kv_only)  # no ValueError
