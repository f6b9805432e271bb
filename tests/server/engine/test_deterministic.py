"""The deterministic mode end to end, on CPU in CI (the batch-invariant kernels under Triton's
interpreter) and on the GPU where there is one: one probe request's tokens and log-probabilities, bitwise, whether it runs alone or
among other traffic, with its prompt chunked at other boundaries, after a prefix-cache hit, after
preemption and recompute, with and without asynchronous scheduling, with speculative decoding
(a verification's rows have the bits of decoding's); and a seeded sampled probe
likewise. The probe's prompt passes the attention kernel's first key segment (256 positions), so
positions are folded over two segments."""

from __future__ import annotations

import random

import pytest
import torch

from server.config import EngineConfig, SpeculativeConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (tests/conftest.py)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True, logprobs=2)


def _engine(path, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 96)
    return LLMEngine(EngineConfig(model=str(path), device=DEVICE, dtype="float16", attention="triton",
                                  deterministic=True, enforce_eager=True, **kw))


def _prompts(vocab, lengths, seed):
    g = random.Random(seed)
    return [[g.randrange(vocab) for _ in range(n)] for n in lengths]


VOCAB = 256
PROBE = _prompts(VOCAB, [262], seed=5)[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Small enough for the interpreter, with contexts past the first 256-key segment."""
    from tests.helpers import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("det-gpt2"), n_layer=2, n_head=2, n_embd=32, n_positions=320,
                           vocab_size=VOCAB, seed=3)


def _run(eng: LLMEngine, requests: list[tuple[list[int], SamplingParams]], stagger: int = 0) -> dict:
    """Every request's (token ids, logprobs) by index; `stagger` steps between admissions."""
    got: dict[int, tuple[list, list]] = {}
    pending = list(enumerate(requests))
    while pending or eng.has_unfinished():
        if pending:
            i, (prompt, params) = pending.pop(0)
            eng.add_request(f"r{i}", prompt, params)
            got[i] = ([], [])
        for _ in range(stagger if pending else 1):
            for out in eng.step():
                ids, lps = got[int(out.request_id[1:])]
                ids += out.new_token_ids
                lps += [[(t, float(v).hex()) for t, v in lp] for lp in out.new_logprobs]
    assert eng.block_manager.check_all_free()
    return got


@pytest.fixture(scope="module")
def alone(ckpt):
    eng = _engine(ckpt, max_num_batched_tokens=4096)
    return _run(eng, [(PROBE, GREEDY), (PROBE, SEEDED)], stagger=40)


def _others(n, seed):
    lens = random.Random(seed).choices(range(1, 120), k=n)
    return [(p, SamplingParams(max_tokens=random.Random(seed + i).randrange(1, 9), temperature=0.0, ignore_eos=True))
            for i, p in enumerate(_prompts(VOCAB, lens, seed))]


@pytest.mark.parametrize("case", ["batched-chunked", "prefix-hit", "preempted", "sync", "speculative"])
def test_probe_is_bitwise_the_same(ckpt, alone, case):
    kw, others, stagger = {}, _others(5, seed=len(case)), 1
    if case == "batched-chunked":  # budget 40: the probe's prompt is cut wherever the others leave room
        kw = dict(max_num_batched_tokens=40)
    elif case == "prefix-hit":  # another request with the probe's first 200 tokens runs first
        others = [(PROBE[:200] + [7, 8], GREEDY)] + others
        stagger = 8
    elif case == "preempted":  # 25 blocks: the first request (8 blocks) and the probe (17) fill the
        # cache; the first outgrows its 8th block at its 9th token, while the probe decodes, so the
        # probe is preempted (after its 3rd token) and recomputed (its generated tokens by a prefill
        # this time). 12 tokens each: past the 9th, more decoding (under the interpreter) adds nothing.
        kw = dict(num_blocks=25, max_num_batched_tokens=64)
        others = [(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                  for p in _prompts(VOCAB, [120, 70, 60], seed=9)]
    elif case == "speculative":  # n-gram proposals: runs of the probe's tokens come from verifications
        kw = dict(speculative_config=SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                                             '"prompt_lookup_min": 1, "prompt_lookup_max": 2}'))
        others = others[:3]
    else:
        kw = dict(async_scheduling=False, max_num_batched_tokens=96)
    eng = _engine(ckpt, **kw)
    got = _run(eng, others[:1] + [(PROBE, GREEDY)] + others[1:3] + [(PROBE, SEEDED)] + others[3:], stagger)
    probe_greedy, probe_seeded = got[1], got[4]
    assert probe_greedy == alone[0], f"{case}: the greedy probe's tokens or logprobs changed"
    assert probe_seeded == alone[1], f"{case}: the seeded probe's tokens or logprobs changed"
    if case == "preempted":
        assert eng.scheduler.num_preemptions > 0
    if case == "speculative":
        assert eng.speculator.counters.accepted_tokens > 0
    if case == "prefix-hit":
        assert eng.block_manager.allocator.stats.hits > 0 and eng.block_manager.check_all_free()


def test_needs_the_triton_backend(ckpt):
    with pytest.raises(ValueError, match="deterministic mode needs the triton attention backend .*pass --attention triton"):
        LLMEngine(EngineConfig(model=str(ckpt), device="cpu", attention="sdpa", deterministic=True))


def test_flag_and_environment(monkeypatch):
    from server.cli import build_parser

    assert build_parser().parse_args(["--deterministic"]).deterministic is True
    assert build_parser().parse_args([]).deterministic is False
    monkeypatch.setenv("FLASHPAGE_DETERMINISTIC", "1")
    assert build_parser().parse_args([]).deterministic is True
    assert build_parser().parse_args(["--no-deterministic"]).deterministic is False
