"""The engine end to end on CPU: greedy equality with transformers, preemption, prefix caching,
chunked prefill, sampling, stop conditions, and no leaked blocks."""

import random

import pytest
from transformers import GPT2LMHeadModel as HFModel

from server.config import EngineConfig
from server.engine import LLMEngine, RequestError
from server.sampling_params import SamplingParams
from tests.helpers import hf_greedy

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(path, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 128)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw))


def _prompts(vocab, lengths, seed=0):
    g = random.Random(seed)
    return [[g.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_tiny(tiny_ckpt):
    return HFModel.from_pretrained(tiny_ckpt).eval()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_greedy_matches_transformers_batched(tiny_ckpt, hf_tiny, attention):
    prompts = _prompts(512, [1, 5, 17, 40, 3])
    eng = _engine(tiny_ckpt, attention=attention)
    outs = eng.generate(prompts, GREEDY)  # all five batched together
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf_tiny, p, GREEDY.max_tokens)
        assert o.finish_reason == "length"
    assert eng.block_manager.check_all_free()


def test_preemption_under_tiny_cache_gives_same_tokens(tiny_ckpt, hf_tiny):
    prompts = _prompts(512, [30, 22, 41, 9, 35, 28], seed=1)
    # 12 blocks of 16 tokens cannot hold six sequences of ~60 tokens: the scheduler must preempt.
    eng = _engine(tiny_ckpt, attention="eager", num_blocks=12, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf_tiny, p, 30)
    assert eng.block_manager.check_all_free()


# (budget 1: every prompt a token a step, its one-token chunks prefill chunks, not decodes)
@pytest.mark.parametrize("prefix_caching,chunked,budget", [(True, True, 24), (True, False, 2048), (False, True, 7),
                                                           (True, True, 1)])
def test_prefix_caching_and_chunking_do_not_change_outputs(tiny_ckpt, prefix_caching, chunked, budget):
    shared = _prompts(512, [37], seed=2)[0]  # ends mid-block (16-token blocks)
    tails = _prompts(512, [1, 6, 19, 2], seed=3)
    prompts = [shared + t for t in tails] + [shared]
    ref = _engine(tiny_ckpt, attention="eager", enable_prefix_caching=False, max_num_batched_tokens=4096)
    expected = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    eng = _engine(tiny_ckpt, attention="eager", enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked,
                  max_num_batched_tokens=budget, num_blocks=24)
    first = eng.generate(prompts[:1], GREEDY)  # warm the prefix cache
    rest = eng.generate(prompts[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == expected
    if prefix_caching:
        assert all(o.cached_prompt_tokens == 32 for o in rest)
        assert eng.block_manager.allocator.stats.hits > 0
    assert eng.block_manager.check_all_free()


def test_copied_prefixes_do_not_change_outputs(tiny_ckpt, monkeypatch):
    """The Triton backend copies a step's prefixes out of the cache where its chunks are long enough
    (models/attention/triton_backend.py gather_plan; here every prefix: gather_min_rows 1): over
    prefix hits and chunks, the tokens of the same engine reading its prefixes paged."""
    import models.attention.triton_backend as tb

    copies, real = [], tb._blocks
    monkeypatch.setattr(tb, "_blocks", lambda cache, ids: copies.append(ids.numel()) or real(cache, ids))
    shared = _prompts(512, [37], seed=2)[0]
    prompts = [shared + t for t in _prompts(512, [6, 19], seed=3)] + [shared]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(attention="triton", dtype="float16", max_num_batched_tokens=24, num_blocks=24)
    paged = _engine(tiny_ckpt, **kw)
    expected = [o.token_ids for o in paged.generate(prompts, params)]
    assert not copies  # (chunks of at most 24 tokens never pay for a copy by default)
    eng = _engine(tiny_ckpt, **kw)
    eng.runner.model.attention.gather_min_rows = 1
    got = [o.token_ids for o in eng.generate(prompts[:1], params) + eng.generate(prompts[1:], params)]
    assert got == expected
    assert copies and eng.block_manager.allocator.stats.hits > 0
    assert eng.block_manager.check_all_free()


def test_prefix_cache_eviction_and_preemption_together(tiny_ckpt):
    prompts = _prompts(512, [40, 33, 50, 47, 20, 45, 38], seed=4)
    prompts += [p[:35] + [7, 8] for p in prompts[:3]]  # shared prefixes
    ref = _engine(tiny_ckpt, attention="eager", enable_prefix_caching=False)
    expected = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    eng = _engine(tiny_ckpt, attention="eager", num_blocks=14, max_num_batched_tokens=32)
    got = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    assert got == expected
    assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.check_all_free()


def test_random_aborts_never_leak(tiny_ckpt):
    eng = _engine(tiny_ckpt, attention="sdpa", num_blocks=10)
    rng = random.Random(5)
    live = []
    for i in range(60):
        if rng.random() < 0.5:
            rid = f"r{i}"
            eng.add_request(rid, _prompts(512, [rng.randrange(1, 30)], seed=i)[0],
                            SamplingParams(max_tokens=rng.randrange(1, 20), temperature=rng.choice([0, 1.0])))
            live.append(rid)
        if live and rng.random() < 0.3:
            eng.abort_request(live.pop(rng.randrange(len(live))))
        for out in eng.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    for rid in live:
        eng.abort_request(rid)
    assert not eng.has_unfinished()
    assert eng.block_manager.check_all_free()


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_ckpt):
    eng = _engine(tiny_ckpt)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = eng.generate([[1, 2, 3]], p)[0].token_ids
    noisy = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batched = eng.generate([[9, 9], [1, 2, 3], [4]], [noisy, p, noisy])[1].token_ids
    assert alone == batched
    other = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0.9, seed=99, ignore_eos=True))
    assert other[0].token_ids != alone


def test_top_k_1_is_greedy_and_top_p_filters(tiny_ckpt):
    eng = _engine(tiny_ckpt)
    greedy = eng.generate([[5, 6, 7]], GREEDY)[0].token_ids
    k1 = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=24, temperature=1.5, top_k=1, ignore_eos=True))
    tiny_p = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=24, temperature=1.5, top_p=1e-6, ignore_eos=True))
    assert k1[0].token_ids == greedy and tiny_p[0].token_ids == greedy


def test_stop_strings_tokens_and_eos(tiny_ckpt):
    eng = _engine(tiny_ckpt)
    full = eng.generate([[5, 6, 7]], GREEDY)[0]
    text = full.text
    assert text == eng.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    tok = full.token_ids[3]
    by_id = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[tok]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]
    # An EOS token ends the request unless ignore_eos; pin EOS to a token greedy decoding produces.
    eng.eos_token_ids = frozenset([full.token_ids[5]])
    eos = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert eos.finish_reason == "stop" and len(eos.token_ids) <= 6


def test_requests_that_do_not_fit_are_refused(tiny_ckpt):
    eng = _engine(tiny_ckpt, num_blocks=4)
    with pytest.raises(RequestError, match="exceeds the model's context of 256"):
        eng.add_request("a", [1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="whole cache has 4"):
        eng.add_request("b", [1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request("c", [1, 512], SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        eng.add_request("d", [], SamplingParams())
    assert not eng.has_unfinished() and eng.block_manager.check_all_free()


def test_streamed_text_never_contains_a_cut_stop_string(tiny_ckpt):
    eng = _engine(tiny_ckpt)
    full = eng.generate([[5, 6, 7]], GREEDY)[0].text
    # A stop string spanning a token boundary: its first character arrives a step before the rest.
    for i in range(1, len(full) - 1):
        stop = full[i : i + 2]
        rid = f"s{i}"
        eng.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
        pieces, final = [], None
        while final is None:
            for out in eng.step():
                pieces.append(out.new_text)
                if out.finished:
                    final = out
        assert "".join(pieces) == final.text == full[: full.index(stop)]


def test_every_ending_reaches_the_finish_hook(tiny_ckpt):
    eng = _engine(tiny_ckpt)
    ended = []

    class Recorder:
        def first_token(self, ttft):
            pass

        def step(self, num_seqs, num_tokens, now):
            pass

        def finished(self, e2e, tpot, reason):
            ended.append(reason)

    eng.stats = Recorder()
    eng.add_request("done", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    eng.add_request("aborted", [4, 5, 6], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.abort_request("aborted")
    while eng.has_unfinished():
        eng.step()
    assert sorted(ended) == ["abort", "length"]
    assert eng.block_manager.check_all_free()


def test_fill_rows_writes_ragged_page_tables_and_leaves_the_rest():
    import numpy as np

    from server.worker.inputs import fill_rows, pad_rows

    out = np.full((4, 6), 7, dtype=np.int32)
    fill_rows(out, [[1, 2, 3], [4], [5, 6, 8, 9, 10]])
    assert out.tolist() == [[1, 2, 3, 7, 7, 7], [4, 7, 7, 7, 7, 7], [5, 6, 8, 9, 10, 7], [7] * 6]
    fill_rows(out, [])  # nothing to do
    assert pad_rows([[3], [1, 2]], 4).tolist() == [[3, 0, 0, 0], [1, 2, 0, 0]]


@pytest.mark.parametrize("delay", [0, 3])
def test_waiting_requests_gather_for_one_prefill_while_many_decode(tiny_ckpt, delay):
    # running_per_admit 3, 4 running: one waiting is held back, two are not
    eng = _engine(tiny_ckpt, max_admit_delay=delay, running_per_admit=3, async_scheduling=False)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"first{i}", [1, 2, 3 + i], params)
    eng.step()  # nothing was running: admitted and prefilled at once
    assert len(eng.scheduler.running) == 4
    admitted, seen = [], {s.request_id for s in eng.scheduler.running}  # (step, request ids admitted in it)
    for step in range(6):
        if step < 2:
            eng.add_request(f"late{step}", [4, 5, 6, 7], params)
        eng.step()
        new = [s.request_id for s in eng.scheduler.running if s.request_id not in seen]
        seen.update(new)
        if new:
            admitted.append((step, new))
    if delay == 0:
        assert admitted == [(0, ["late0"]), (1, ["late1"])]
    else:  # late0 alone is held back until late1 joins it; both share one prefill
        assert admitted == [(1, ["late0", "late1"])]
    assert eng.scheduler.steps_waited == 0


def test_a_lone_waiting_request_is_held_back_at_most_max_admit_delay_steps(tiny_ckpt):
    # running_per_admit 2, 4 running: one waiting is held back
    eng = _engine(tiny_ckpt, max_admit_delay=3, running_per_admit=2, async_scheduling=False)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"first{i}", [1, 2, 3 + i], params)
    eng.step()
    eng.add_request("late", [4, 5, 6, 7], params)
    steps = 0
    while not any(s.request_id == "late" for s in eng.scheduler.running):
        eng.step()
        steps += 1
    assert steps == 4  # three steps held back, admitted in the fourth


def test_close_gives_back_the_cache(tiny_ckpt):
    eng = _engine(tiny_ckpt)
    assert len(eng.runner.kv_caches) == eng.spec.num_layers
    eng.close()
    assert eng.runner.kv_caches == [] and eng.runner.graphs is None and eng.runner.prefill_graphs is None


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_deadline_ends_running_and_queued_requests_with_timeout(tiny_ckpt, async_scheduling):
    import time

    # 16 blocks of 16: "run" holds 13 (200 tokens), so "queued" (4 blocks) waits, and "free" behind it.
    eng = _engine(tiny_ckpt, num_blocks=16, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    deadline = time.monotonic() + 60  # far enough for the first steps on any machine; moved up below
    eng.add_request("run", _prompts(512, [200])[0], params, deadline=deadline)
    eng.add_request("queued", _prompts(512, [60])[0], params, deadline=deadline)
    eng.add_request("free", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finals, streamed = {}, {}

    def step():
        for out in eng.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out

    for _ in range(20):
        if len(streamed.get("run", [])) >= 3:
            break
        step()
    assert not finals and [s.request_id for s in eng.scheduler.waiting] == ["queued", "free"]
    # The deadline passes: both are past it (the engine reads Sequence.deadline; its heap entry is
    # what makes it look, so the earlier entries stay and are now due).
    for seq in (eng.seqs["run"], eng.seqs["queued"]):
        seq.deadline = time.monotonic()
    eng.deadlines = [(seq.deadline, rid) for rid, seq in eng.seqs.items() if seq.deadline is not None]
    for _ in range(200):
        if not eng.has_unfinished():
            break
        step()
    assert finals["run"].finish_reason == "timeout" and finals["queued"].finish_reason == "timeout"
    assert finals["free"].finish_reason == "length"
    assert 3 <= len(finals["run"].token_ids) < 50 and finals["run"].token_ids == streamed["run"]
    assert finals["queued"].token_ids == [] and finals["queued"].completion_tokens == 0
    assert eng.block_manager.check_all_free() and not eng.seqs


def test_a_request_that_ends_first_leaves_no_deadline_behind(tiny_ckpt):
    import time

    eng = _engine(tiny_ckpt)
    # a deadline no loaded host reaches in two steps; once the request has ended, its heap entry
    # (left behind: the heap is only popped when due) is made due by hand, not by sleeping
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                    deadline=time.monotonic() + 600)
    outs = [o for _ in range(10) if eng.has_unfinished() for o in eng.step()]
    assert [o.finish_reason for o in outs if o.finished] == ["length"]
    assert [rid for _, rid in eng.deadlines] == ["a"]
    eng.deadlines = [(time.monotonic(), "a")]
    eng.add_request("a", [4, 5, 6], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    outs = [o for _ in range(10) if eng.has_unfinished() for o in eng.step()]
    assert [o.finish_reason for o in outs if o.finished] == ["length"]  # the stale entry is skipped
    assert eng.deadlines == []


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_filling_the_context_gets_every_token(tiny_ckpt, async_scheduling):
    # prompt + max_tokens == the context (256): with a step in flight, its placeholder must not count.
    eng = _engine(tiny_ckpt, async_scheduling=async_scheduling)
    out = eng.generate([list(range(1, 44))], SamplingParams(max_tokens=213, temperature=0.0, ignore_eos=True))[0]
    assert (len(out.token_ids), out.finish_reason) == (213, "length")
    assert eng.block_manager.check_all_free()


def test_a_failed_launch_under_tensor_parallelism_is_fatal(tiny_ckpt):
    """One rank cannot fail a step alone: the others may be inside its collectives, waiting for good
    (server/worker/parallel/). So where one GPU's engine fails the step's requests and carries on,
    a tensor-parallel engine stops at once."""
    import pytest

    from server.engine.faults import FaultInjector
    from server.engine.requests import EngineFatalError

    eng = _engine(tiny_ckpt)
    eng.faults = FaultInjector(raise_token=7)
    eng.add_request("a", [7, 1], SamplingParams(max_tokens=2))
    (out,) = eng.step()
    assert out.finish_reason == "error"  # one GPU: the step's requests fail, the engine goes on
    eng.config.tensor_parallel_size = 2  # (the hook reads only the setting)
    eng.add_request("b", [7, 2], SamplingParams(max_tokens=2))
    with pytest.raises(EngineFatalError, match="tensor parallelism"):
        eng.step()
