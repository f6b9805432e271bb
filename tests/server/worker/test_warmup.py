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

    def __init__(self, inner, copies=False):
        self.inner, self.steps, self.copies, self.caches = inner, [], copies, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def copies_prefixes(self, device):
        return self.copies

    def prefill_arrays(self, chunk_lens, chunk_prefix, device, cache=None):
        self.caches.append((list(chunk_prefix), cache))
        return {"probe": np.array([n * 1000 + p for n, p in zip(chunk_lens, chunk_prefix)])}

    def metadata(self, rows):
        if rows.num_prefill_tokens:
            self.steps.append((list(rows.chunk_lens), list(rows.chunk_prefix), rows.extra["probe"].tolist()))
        return self.inner.metadata(rows)


def _model(ckpt, copies=False):
    """The tiny model with a recording backend, and its cache's spec (blocks of 16)."""
    model = load_model(ckpt, torch.float32, "cpu", "eager")
    model.attention = Recording(model.attention, copies)
    spec = model.spec
    return model, CacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, 16, torch.float32)


def _runner(ckpt, copies=False):
    model, cache = _model(ckpt, copies)
    runner = ModelRunner(model, cache, torch.device("cpu"), max_num_seqs=4, max_num_batched_tokens=512,
                         max_model_len=model.spec.max_position_embeddings)
    runner.allocate_cache(40)
    return runner


def test_warmup_prefill_steps_carry_the_backends_arrays(tiny_ckpt):
    runner = _runner(tiny_ckpt)
    warmup(runner)
    steps = runner.model.attention.steps
    assert steps, "warm-up ran no prefill step"
    assert any(p for _, prefix, _ in steps for p in prefix), "warm-up never prefilled over a cached prefix"
    for lens, prefix, probe in steps:
        assert probe == [n * 1000 + p for n, p in zip(lens, prefix)]


def test_warmup_reads_each_prefix_both_ways_where_the_backend_copies(tiny_ckpt):
    """A backend that copies prefixes out of the cache (the Triton one's gather_plan) is offered the
    copy (the cache's block size and the runner's gather_blocks) and refused it for every prefix step
    of the warm-up, so both kernel paths compile at start-up; a backend that never copies is never
    offered one, and no memory is set aside for it."""
    runner = _runner(tiny_ckpt, copies=True)
    assert runner.gather_blocks == runner.max_blocks
    warmup(runner)
    offered = runner.model.attention.caches
    for prefix in {tuple(p) for p, _ in offered if any(p)}:
        assert {c for p, c in offered if tuple(p) == prefix} == {None, (16, runner.max_blocks)}
    plain = _runner(tiny_ckpt)
    assert plain.gather_blocks == 0
    warmup(plain)
    assert {c for _, c in plain.model.attention.caches} == {None}


def test_the_draft_models_runner_warms_up_reading_prefixes_through_the_page_table(tiny_ckpt):
    """Start-up warms a draft model's runner up with the same function (on a GPU, after the
    target's); it read runner.gather_blocks, which DraftRunner lacked, and every engine start with a
    draft model failed there on the GPU. A draft never offers its backend a copy."""
    from server.worker.spec.draft import DraftRunner

    model, cache = _model(tiny_ckpt, copies=True)
    draft = DraftRunner(model, cache, torch.device("cpu"), 4, 512, model.spec.max_position_embeddings, k=3)
    draft.allocate_cache(40)
    warmup(draft)
    assert draft.gather_blocks == 0
    assert any(any(p) for p, _ in model.attention.caches), "no prefix step ran"
    assert {c for _, c in model.attention.caches} == {None}


def test_an_eagle3_heads_runner_warms_up_too(eagle3_pair):
    """The EAGLE-3 head's runner (a DraftRunner) through the same start-up warm-up, as set up for a
    served engine (start_worker runs it on a GPU only)."""
    import json
    from pathlib import Path

    from server.config import EngineConfig, SpeculativeConfig
    from server.worker.setup import start_worker
    from server.worker.spec.eagle import EagleRunner

    target, head = eagle3_pair
    spec = SpeculativeConfig.parse(json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}))
    worker = start_worker(EngineConfig(model=str(target), device="cpu", speculative_config=spec, num_blocks=40,
                                       max_num_batched_tokens=64), Path(target))
    assert isinstance(worker.draft, EagleRunner) and worker.draft.gather_blocks == 0
    warmup(worker.draft)
