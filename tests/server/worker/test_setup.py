"""Worker start-up decisions that need no device: --dtype auto, and the sliding-window refusal."""

import json

import torch

from server.worker.setup import auto_dtype


def _config(tmp_path, **fields):
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
