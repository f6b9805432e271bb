"""GPU-only checks (skipped without CUDA) of what changes a row's logits on the device path: grammar
masks applied after the captured decode graph, behind the device's wait for the host's fill
(kernels/grammar_mask.py), the penalties kernels inside the engine, in a batch beside plain rows."""

import json
import re

import pytest
import torch

from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams, StructuredOutput
from tests.helpers import failing_fill

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REGEX = StructuredOutput("regex", r"[a-z]{3,6}-[0-9]{2}")
CHOICE = StructuredOutput("choice", json.dumps(["red", "green", "blue sky"]))
SCHEMA = StructuredOutput("json", json.dumps({"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 50},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}},
    "required": ["n", "tags"]}))


@pytest.fixture(scope="module")
def gpu():
    """The embedded model on the GPU: CUDA graphs, asynchronous scheduling."""
    return LLMEngine(EngineConfig(device="cuda", num_blocks=512))


def _params(**kw):
    kw.setdefault("max_tokens", 60)
    return SamplingParams(temperature=0, **kw)


def test_constrained_rows_match_their_grammar_beside_plain_rows(gpu):
    prompt = gpu.tokenizer.encode("Value: ")
    specs = [REGEX, CHOICE, SCHEMA, StructuredOutput("json_object")] * 8  # 32 rows: a captured decode batch
    params = [_params(structured=s) for s in specs] + [_params(ignore_eos=True, max_tokens=40)] * 8
    outs = gpu.generate([prompt] * len(params), params)
    for spec, out in zip(specs, outs):
        if spec is REGEX:
            assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", out.text), out.text
        elif spec is CHOICE:
            assert out.text in ("red", "green", "blue sky")
        else:
            doc = json.loads(out.text)
            assert isinstance(doc, dict)
            if spec is SCHEMA:
                assert 0 <= doc["n"] <= 50 and len(doc["tags"]) <= 2
        assert out.finish_reason == "stop"
    assert all(len(o.token_ids) == 40 for o in outs[len(specs):])
    while gpu.has_unfinished():
        gpu.step()
    assert gpu.block_manager.check_all_free()


def test_asynchronous_scheduling_changes_no_constrained_token():
    """The same requests with asynchronous scheduling (the next step is enqueued before the masks
    of this one are filled; the device waits for them) and without: the same tokens. Deterministic mode, so that the two runs' different batch shapes
    (async scheduling runs a finished row one more step) cannot move a near-tie."""
    prompt_text = "def main():\n"
    params = [_params(structured=SCHEMA), _params(structured=REGEX, repetition_penalty=1.3),
              _params(ignore_eos=True, max_tokens=30, frequency_penalty=0.8, presence_penalty=0.4),
              _params(ignore_eos=True, max_tokens=30, repetition_penalty=1.2, logit_bias={11: 5.0}),
              _params(max_tokens=20, min_tokens=15)]
    runs = []
    for async_scheduling in (True, False):
        eng = LLMEngine(EngineConfig(device="cuda", num_blocks=512, deterministic=True,
                                     async_scheduling=async_scheduling))
        prompt = eng.tokenizer.encode(prompt_text)
        runs.append([o.token_ids for o in eng.generate([prompt] * len(params), params)])
        assert eng.block_manager.check_all_free()
        eng.close()
    assert runs[0] == runs[1]
    assert len(runs[0][4]) >= 15  # min_tokens held the end back


def test_argmax_rows_choose_in_the_graph_what_the_sampler_would():
    """Rows whose choice is the argmax kernel's (greedy or seeded sampled, penalties the only
    control) choose inside the decode graph (a prefill chunk's first token beside graphed decodes:
    the same choice after it); the same rows with a zero logit_bias (which changes no logit) take
    the general sampler. 40 rows of mixed prompt lengths under a 64-token step budget, so that
    prompts finish prefilling while others decode; 48 steps each (each step's counts feed the
    next's penalties): the same tokens either way, and the penalties changed the output.
    Deterministic mode, so that the two runs' logits are the same bits."""
    gpu = LLMEngine(EngineConfig(device="cuda", num_blocks=512, deterministic=True, max_num_batched_tokens=64))
    base = gpu.tokenizer.encode("The the the cat sat on the mat and the")
    prompts = [(base * 12)[: 3 + 7 * i] for i in range(40)]
    kinds = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7), dict(presence_penalty=0.9),
             dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3),
             dict(temperature=0.8), dict(temperature=1.2, presence_penalty=0.9),
             dict(temperature=0.5, repetition_penalty=1.2, frequency_penalty=0.4), dict()] * 5
    kinds = [dict(k, seed=i) if k.get("temperature") else k for i, k in enumerate(kinds)]
    fused = [SamplingParams(**{"temperature": 0, "ignore_eos": True, "max_tokens": 48, **k}) for k in kinds]
    general = [SamplingParams(**{"temperature": 0, "ignore_eos": True, "max_tokens": 48, "logit_bias": {5: 0.0}, **k})
               for k in kinds]
    a = [o.token_ids for o in gpu.generate(prompts, fused)]
    b = [o.token_ids for o in gpu.generate(prompts, general)]
    assert a == b
    plain = [o.token_ids for o in gpu.generate(prompts[:8], [_params(ignore_eos=True, max_tokens=48)] * 8)]
    assert all(a[i] != plain[i] for i in range(7))  # penalized or sampled: not the plain argmax's tokens
    assert a[7] == plain[7]
    assert gpu.block_manager.check_all_free()
    gpu.close()


def test_constrained_rows_choose_in_one_kernel_what_the_sampler_would(gpu):
    """Constrained rows whose other controls are at most temperature and penalties take their
    masked choice in one kernel (replayed from a captured graph in steps of decodes only:
    server/worker/choice.py); the same rows with a zero logit_bias (which changes no logit) go
    through the general sampler with the masks applied in place: the same tokens, greedy, seeded
    sampled, penalized, and beside unconstrained sampled rows."""
    prompts = [gpu.tokenizer.encode(t) for t in ("Value: ", "def main():\n", "A person, as JSON: ", "x")] * 8
    specs = [REGEX, CHOICE, SCHEMA, StructuredOutput("json_object")] * 8
    kinds = [dict(), dict(temperature=0.9), dict(temperature=0.7, presence_penalty=0.8), dict(repetition_penalty=1.3)]
    params = [dict(structured=s, **kinds[(i + i // 4) % 4]) for i, s in enumerate(specs)]  # each spec, each kind
    params = [dict(p, seed=i) if p.get("temperature") else p for i, p in enumerate(params)]
    params[-1] = dict(temperature=1.1, seed=99, ignore_eos=True, max_tokens=30)  # unconstrained, sampled

    def run(**extra):
        return [o.token_ids for o in gpu.generate(prompts, [SamplingParams(**{"temperature": 0, "max_tokens": 60,
                                                                               **p, **extra}) for p in params])]
    a, b = run(), run(logit_bias={5: 0.0})
    assert a == b
    while gpu.has_unfinished():  # a step launched before the last request finished is collected
        gpu.step()
    assert gpu.block_manager.check_all_free()


def test_a_fill_that_fails_does_not_hang_the_device(gpu):
    """The grammar process's fill raises: it still raises the flag the device waits on, the step's
    requests end with "error", and the engine serves on."""
    with failing_fill(gpu, at=4):
        outs = gpu.generate([gpu.tokenizer.encode("Value: ")] * 3, [_params(structured=SCHEMA)] * 3)
    assert all(o.finish_reason == "error" and "injected fill failure" in o.error for o in outs)
    while gpu.has_unfinished():
        gpu.step()
    assert gpu.block_manager.check_all_free()
    out = gpu.generate([gpu.tokenizer.encode("Value: ")], [_params(structured=REGEX, max_tokens=12)])[0]
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", out.text)


def test_a_grammar_process_killed_mid_run_fails_its_steps_not_the_device(gpu):
    """The grammar process is killed while constrained rows decode: the device's waits end (the
    engine marks the steps it can no longer fill failed; a fill in flight times out), the requests
    end with "error", and the next structured request starts another process."""
    gpu.add_request("k1", gpu.tokenizer.encode("Value: "), _params(structured=SCHEMA, max_tokens=60))
    for _ in range(4):
        gpu.step()
    first = gpu.grammars
    first.proc.kill()
    first.proc.wait()
    final = {}
    while gpu.has_unfinished():
        for out in gpu.step():
            if out.finished:
                final[out.request_id] = out
    assert final["k1"].finish_reason == "error" and gpu.block_manager.check_all_free()
    out = gpu.generate([gpu.tokenizer.encode("Value: ")], [_params(structured=REGEX, max_tokens=12)])[0]
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", out.text) and gpu.grammars is not first


def test_mask_memory_of_buffers_dropped_unclosed_is_no_longer_registered():
    """Buffers that go without close() (an engine dropped unclosed) unregister the shared mask
    memory from CUDA before they let go of it: registering the same memory again then works
    (cudaHostRegister fails on memory still registered), and close() after that does nothing."""
    import gc
    import os

    from server.engine.grammar_process import mask_memory
    from server.worker.grammar_rows import GrammarBuffers

    fd, memory = mask_memory(8, 1000, lambda: True)
    try:
        first = GrammarBuffers(memory, torch.device("cuda"))
        del first
        gc.collect()
        second = GrammarBuffers(memory, torch.device("cuda"))
        second.close()
        second.close()
        third = GrammarBuffers(memory, torch.device("cuda"))  # closed: registers again
        third.close()
    finally:
        os.close(fd)
