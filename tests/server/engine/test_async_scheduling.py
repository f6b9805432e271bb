"""Asynchronous scheduling (step k launched before step k-1's tokens reach the host) must change
nothing a client can see: the same tokens, text, finish reasons and logprobs as running each step
to completion, through stop conditions, preemption, prefix caching, chunking and aborts."""

import random

import pytest

from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams
from server.engine.sequence import PLACEHOLDER


def _engine(path, async_scheduling, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 128)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", attention="eager",
                                  async_scheduling=async_scheduling, **kw))


def _prompts(n, seed, lo=1, hi=45):
    g = random.Random(seed)
    return [[g.randrange(512) for _ in range(g.randint(lo, hi))] for _ in range(n)]


def _mixed_params(eos_like: int, n: int, seed: int) -> list[SamplingParams]:
    g = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            p = SamplingParams(max_tokens=g.randint(1, 30), temperature=0.0, ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[eos_like], ignore_eos=True)
        elif kind == 2:
            p = SamplingParams(max_tokens=25, temperature=0.8, top_k=40, seed=100 + i, ignore_eos=True)
        elif kind == 3:
            p = SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, ignore_eos=True)
        else:
            p = SamplingParams(max_tokens=28, temperature=0.0, stop=["e", "a"], ignore_eos=True)
        out.append(p)
    return out


def _run(path, async_scheduling, prompts, params, **kw):
    eng = _engine(path, async_scheduling, **kw)
    outs = eng.generate(prompts, params)
    assert eng.block_manager.check_all_free() and not eng.has_unfinished()
    return eng, [(o.token_ids, o.text, o.finish_reason) for o in outs]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(num_blocks=14, enable_prefix_caching=False),  # forces preemption
    dict(num_blocks=20, max_num_batched_tokens=24),  # chunked prefill + prefix caching + preemption
    dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
], ids=["plain", "preempt", "chunked-prefix", "unchunked"])
def test_async_scheduling_gives_the_same_outputs(tiny_ckpt, kw):
    base = _prompts(12, seed=7)
    prompts = base + [base[0][:33] + [3, 4], base[1][:20] + [9]]  # shared prefixes
    params = _mixed_params(eos_like=prompts[0][0], n=len(prompts), seed=8)
    sync_eng, sync_out = _run(tiny_ckpt, False, prompts, params, **kw)
    async_eng, async_out = _run(tiny_ckpt, True, prompts, params, **kw)
    assert async_out == sync_out
    if "preempt" in str(kw) or kw.get("num_blocks", 128) < 30:
        assert async_eng.scheduler.num_preemptions > 0


def test_streams_and_logprobs_match_step_by_step(tiny_ckpt):
    prompts = _prompts(6, seed=11)
    params = _mixed_params(eos_like=prompts[1][0], n=6, seed=12)

    def stream(async_scheduling):
        eng = _engine(tiny_ckpt, async_scheduling)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"r{i}", p, sp)
        got = {f"r{i}": [] for i in range(len(prompts))}
        while eng.has_unfinished():
            for out in eng.step():
                got[out.request_id].append((out.new_text, out.new_token_ids, out.finished, out.finish_reason,
                                            [[(t, round(v, 4)) for t, v in lp] for lp in out.new_logprobs]))
        assert eng.block_manager.check_all_free()
        return got

    assert stream(True) == stream(False)


def test_the_next_step_is_launched_before_the_last_tokens_arrive(tiny_ckpt):
    eng = _engine(tiny_ckpt, True)
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert eng.step() == []  # prefill launched; nothing has come back yet
    seq = eng.seqs["a"]
    assert seq.token_ids[-1] == PLACEHOLDER and seq.num_pending == 1
    outs = eng.step()  # launches the first decode (its input read on the device), returns the prefill's token
    assert [o.request_id for o in outs] == ["a"] and len(seq.output_token_ids) == 1
    assert seq.num_pending == 1 and seq.token_ids[-1] == PLACEHOLDER
    assert seq.token_ids[3] == seq.output_token_ids[0]  # the placeholder it replaced
    n = 1
    while eng.has_unfinished():
        n += len(eng.step())
    assert n == 5 and eng.block_manager.check_all_free()
    # The last token was capped (max_tokens), so no step past it was launched: 1 prefill + 4 decodes.
    sync = _engine(tiny_ckpt, False)
    assert sync.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0].token_ids \
        == seq.output_token_ids


def test_abort_while_in_flight_and_random_traffic_never_leak(tiny_ckpt):
    eng = _engine(tiny_ckpt, True, num_blocks=10)
    rng = random.Random(13)
    live, aborted = [], set()
    for i in range(80):
        if rng.random() < 0.5:
            rid = f"r{i}"
            eng.add_request(rid, _prompts(1, seed=i, hi=30)[0],
                            SamplingParams(max_tokens=rng.randrange(1, 20), temperature=rng.choice([0, 1.0]),
                                           stop_token_ids=[rng.randrange(512)]))
            live.append(rid)
        if live and rng.random() < 0.3:
            rid = live.pop(rng.randrange(len(live)))
            eng.abort_request(rid)  # often while one of its tokens is still on the device
            aborted.add(rid)
        for out in eng.step():
            assert out.request_id not in aborted  # its in-flight token is dropped
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    for rid in live:
        eng.abort_request(rid)
    while eng.has_unfinished():
        assert eng.step() == []  # only aborted requests' results were in flight
    assert eng.block_manager.check_all_free()
