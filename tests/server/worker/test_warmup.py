"""The runner's start-up steps (server/worker/warmup.py) launch what serving launches: its warm-up prefill steps carry the
attention backend's own arrays (prefill_arrays: the Triton backend's tile map), so the kernel
variants they compile are the ones a real step picks. On the CPU with a recording backend."""

import numpy as np
import torch

from kvcache import CacheSpec
from models import load_model
from server.worker.runner import ModelRunner
from server.worker.warmup import warmup


class Recording:
    """The model's own (eager) backend, plus an array of its own for every prefill step; records
    what each step's metadata was built from."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill_arrays(self, chunk_lens, chunk_prefix, device, cache=None):
        return {"probe": np.array([n * 1000 + p for n, p in zip(chunk_lens, chunk_prefix)])}

    def metadata(self, rows):
        if rows.num_prefill_tokens:
            self.steps.append((list(rows.chunk_lens), list(rows.chunk_prefix), rows.extra["probe"].tolist()))
        return self.inner.metadata(rows)


def test_warmup_prefill_steps_carry_the_backends_arrays(tiny_ckpt):
    model = load_model(tiny_ckpt, torch.float32, "cpu", "eager")
    model.attention = Recording(model.attention)
    spec = model.spec
    cache = CacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, 16, torch.float32)
    runner = ModelRunner(model, cache, torch.device("cpu"), max_num_seqs=4, max_num_batched_tokens=512,
                         max_model_len=spec.max_position_embeddings)
    runner.allocate_cache(40)
    warmup(runner)
    steps = model.attention.steps
    assert steps, "warm-up ran no prefill step"
    assert any(p for _, prefix, _ in steps for p in prefix), "warm-up never prefilled over a cached prefix"
    for lens, prefix, probe in steps:
        assert probe == [n * 1000 + p for n, p in zip(lens, prefix)]
