"""Unit tests of the scheduler against a real BlockManager: no model, no engine."""

from kvcache import BlockManager, SeqBlocks
from models import placeholder_id
from server.config import EngineConfig
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence, Status
from server.sampling_params import SamplingParams

BS = 4


def make(num_blocks=64, **cfg):
    bm = BlockManager(num_blocks, BS)
    return bm, Scheduler(bm, EngineConfig(block_size=BS, **cfg))


def seq(rid, n, base=None):
    # Distinct token ids per request, so that no two prompts share a prefix unless a test says so.
    base = sum(map(ord, rid)) * 1000 if base is None else base
    return Sequence(rid, [base + i for i in range(n)], SamplingParams(max_tokens=1000))


def step(sched, tok=7):
    return complete(sched, sched.schedule(), tok)


def complete(sched, out, tok=7):
    """The rest of a synchronous engine step: progress, then every sampling row gets its token
    (placeholder first, resolved later, as LLMEngine.step/_finish do)."""
    sched.after_step(out)
    rows = [s.seq for s in out.decodes] + [s.seq for s in out.prefills if s.samples]
    for row, s in enumerate(rows):
        s.add_placeholder(row)
    for s in rows:
        s.resolve(tok)
    return out


def chunks(items):
    return [(s.seq.request_id, s.start, s.num_tokens) for s in items]


def test_admission_fills_the_token_budget_and_chunks_the_last_prompt():
    _, sched = make(max_num_batched_tokens=10)
    a, b, c = seq("a", 4), seq("b", 4), seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert chunks(out.prefills) == [("a", 0, 4), ("b", 0, 4), ("c", 0, 2)]
    assert [s.samples for s in out.prefills] == [True, True, False]
    assert out.decodes == [] and out.num_tokens == 10
    assert sched.running == [a, b, c] and not sched.waiting
    assert all(s.status is Status.RUNNING for s in (a, b, c))


def test_admission_capped_by_max_num_seqs():
    _, sched = make(max_num_seqs=2)
    a, b, c = seq("a", 3), seq("b", 3), seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    out = step(sched)
    assert [s.seq for s in out.prefills] == [a, b]
    assert list(sched.waiting) == [c] and c.status is Status.WAITING
    sched.finish(a, "stop")
    out = sched.schedule()
    assert chunks(out.prefills) == [("c", 0, 3)] and chunks(out.decodes) == [("b", 3, 1)]


def test_admission_waits_for_free_blocks_in_arrival_order():
    bm, sched = make(num_blocks=4)
    a, b, c = seq("a", 10), seq("b", 8), seq("c", 2)  # 3, 2 and 1 blocks
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    # b does not fit in the one block left; c would, but does not overtake it.
    assert [s.seq for s in out.prefills] == [a]
    assert list(sched.waiting) == [b, c] and bm.num_free_blocks == 1
    sched.finish(a, "abort")
    assert [s.seq for s in sched.schedule().prefills] == [b, c]


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    _, sched = make(max_num_batched_tokens=8)
    a = seq("a", 20)
    sched.add(a)
    seen = []
    for _ in range(3):
        out = sched.schedule()
        assert out.decodes == []
        seen += [(s.start, s.num_tokens, s.samples, s.is_decode) for s in out.prefills]
        complete(sched, out)
    assert seen == [(0, 8, False, False), (8, 8, False, False), (16, 4, True, False)]
    assert a.num_computed == 20 and a.output_token_ids == [7]
    out = sched.schedule()
    assert chunks(out.decodes) == [("a", 20, 1)] and out.decodes[0].is_decode


def test_a_one_token_chunk_inside_a_prompt_is_a_prefill_chunk():
    # A budget down to one token (here the whole budget; under load, what decodes leave) still
    # continues a prompt one token a step, as prefill chunks that sample nothing: taken for decodes,
    # each sampled a token from inside the prompt (an engine at max_num_batched_tokens=1 answered
    # a 5-token prompt with a wrong token, or failed the request where it asked for logprobs)
    _, sched = make(max_num_batched_tokens=1)
    a = seq("a", 3)
    sched.add(a)
    seen = []
    for _ in range(3):
        out = sched.schedule()
        seen += [(s.start, s.num_tokens, s.samples, s.is_decode, s in out.decodes) for s in out.prefills + out.decodes]
        complete(sched, out)
    # (the prompt's last token alone samples: a decode row, as the runner takes it)
    assert seen == [(0, 1, False, False, False), (1, 1, False, False, False), (2, 1, True, True, True)]
    assert a.output_token_ids == [7]
    out = sched.schedule()
    assert chunks(out.decodes) == [("a", 3, 1)] and out.decodes[0].is_decode and not out.prefills


def test_unchunked_prompt_over_the_budget_goes_alone_or_waits():
    _, sched = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    big = seq("big", 12)
    sched.add(big)
    assert chunks(sched.schedule().prefills) == [("big", 0, 12)]  # budget untouched: whole, alone

    _, sched = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    small, big = seq("small", 3), seq("big", 12)
    sched.add(small)
    sched.add(big)
    out = step(sched)
    # Not split: big is admitted (it holds its blocks) but gets no tokens this step.
    assert chunks(out.prefills) == [("small", 0, 3)]
    assert sched.running == [small, big] and big.num_computed == 0 and big.blocks.block_table
    out = step(sched)
    assert chunks(out.decodes) == [("small", 3, 1)] and out.prefills == []  # still not untouched
    sched.finish(small, "stop")
    assert chunks(sched.schedule().prefills) == [("big", 0, 12)]


def test_decodes_are_scheduled_before_new_admissions():
    _, sched = make(max_num_batched_tokens=4)
    a = seq("a", 3)
    sched.add(a)
    step(sched)
    b = seq("b", 10)
    sched.add(b)
    out = sched.schedule()
    assert chunks(out.decodes) == [("a", 3, 1)]
    assert chunks(out.prefills) == [("b", 0, 3)]  # what the decode left of the budget
    assert [s.seq for s in out.scheduled] == [b, a]  # batch order: prefill tokens first

    _, sched = make(max_num_batched_tokens=2)
    a, b = seq("a", 2), seq("b", 2)
    sched.add(a)
    step(sched)
    sched.add(b)
    step(sched)  # b's prompt takes the budget left; a decodes first
    c = seq("c", 2)
    sched.add(c)
    out = sched.schedule()
    assert [s.seq for s in out.decodes] == [a, b] and out.prefills == [] and list(sched.waiting) == [c]


def test_capped_sequence_is_not_scheduled():
    _, sched = make()
    a, b = seq("a", 3), seq("b", 3)
    sched.add(a)
    sched.add(b)
    step(sched)
    a.capped = True  # its last token is in flight
    out = sched.schedule()
    assert [s.seq for s in out.decodes] == [b] and a in sched.running


def test_preemption_takes_the_newest_running_sequence_first():
    bm, sched = make(num_blocks=6)
    a, b, c, d = seq("a", 8), seq("b", 8), seq("c", 8), seq("d", 2)
    for s in (a, b, c, d):
        sched.add(s)
    out = step(sched)  # a, b, c fill all six blocks; d cannot be admitted
    assert [s.seq for s in out.prefills] == [a, b, c] and list(sched.waiting) == [d]
    assert bm.num_free_blocks == 0

    out = sched.schedule()  # each decode needs a third block
    assert out.preempted == [c]
    assert [s.seq for s in out.decodes] == [a, b] and out.prefills == []
    assert c not in [s.seq for s in out.scheduled]
    assert list(sched.waiting) == [c, d] and sched.running == [a, b]  # c back at the front; no admission
    assert c.status is Status.WAITING and c.blocks.block_table == [] and c.num_computed == 0
    assert c.num_preemptions == 1 and a.num_preemptions == 0 and sched.num_preemptions == 1
    assert bm.num_free_blocks == 0  # c's two blocks went to a and b
    sched.after_step(out)

    sched.finish(a, "stop")
    sched.finish(b, "stop")
    out = sched.schedule()
    first = out.prefills[0]
    # c recomputes its prompt and its generated token, and samples the next.
    assert first.seq is c and first.start + first.num_tokens == 9 and first.samples
    assert c.token_ids == list(range(c.prompt_token_ids[0], c.prompt_token_ids[0] + 8)) + [7]
    assert c.num_cached_prompt == 0  # set at the first admission only


def test_a_sequence_with_nothing_newer_to_preempt_preempts_itself():
    bm, sched = make(num_blocks=2)
    a = seq("a", 8)
    sched.add(a)
    step(sched)
    out = sched.schedule()
    assert out.is_empty and out.preempted == [a]
    assert list(sched.waiting) == [a] and not sched.running and bm.check_all_free()


def _three_decoding(sched):
    seqs = [seq(r, 3) for r in "abc"]
    for s in seqs:
        sched.add(s)
    step(sched)
    assert all(len(s.output_token_ids) == 1 for s in seqs)
    return seqs


def test_admission_is_held_back_at_most_max_admit_delay_steps():
    _, sched = make(max_admit_delay=2, running_per_admit=2)
    _three_decoding(sched)
    d = seq("d", 3)
    sched.add(d)  # 1 waiting * 2 < 3 running: hold
    for held in (1, 2):
        out = step(sched)
        assert out.prefills == [] and len(out.decodes) == 3
        assert list(sched.waiting) == [d] and sched.steps_waited == held
    out = step(sched)
    assert [s.seq for s in out.prefills] == [d] and sched.steps_waited == 0


def test_enough_waiting_requests_are_admitted_at_once():
    _, sched = make(max_admit_delay=2, running_per_admit=2)
    _three_decoding(sched)
    d, e = seq("d", 3), seq("e", 3)
    sched.add(d)
    sched.add(e)  # 2 waiting * 2 >= 3 running
    assert [s.seq for s in sched.schedule().prefills] == [d, e]


def test_no_admission_delay_when_it_is_zero():
    _, sched = make(max_admit_delay=0, running_per_admit=2)
    _three_decoding(sched)
    d = seq("d", 3)
    sched.add(d)
    assert [s.seq for s in sched.schedule().prefills] == [d]


def test_finish_frees_blocks_of_running_and_waiting_sequences():
    bm, sched = make(num_blocks=3)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.running == [a] and list(sched.waiting) == [b]
    sched.finish(b, "abort")
    assert not sched.waiting and b.status is Status.FINISHED and b.finish_reason == "abort"
    sched.finish(a, "stop")
    assert not sched.running and a.is_finished and a.finish_reason == "stop"
    assert a.blocks.block_table == [] and bm.check_all_free()
    sched.finish(a, "error")  # finishing twice changes nothing
    assert a.finish_reason == "stop" and bm.check_all_free() and not sched.has_work()


def _cached_tokens(bm, token_ids):
    probe = SeqBlocks()
    n = bm.allocate(probe, token_ids)
    bm.free(probe)
    return n


def test_after_step_advances_progress_and_publishes_full_blocks():
    bm, sched = make(max_num_batched_tokens=6)
    prompt = list(range(100, 110))
    a = Sequence("a", prompt, SamplingParams())
    sched.add(a)
    out = sched.schedule()
    assert _cached_tokens(bm, prompt) == 0  # scheduled is not computed
    sched.after_step(out)
    assert a.num_computed == 6 and len(a.blocks.hashes) == 1 and _cached_tokens(bm, prompt) == 4
    step(sched)
    assert a.num_computed == 10 and len(a.blocks.hashes) == 2

    b = Sequence("b", list(prompt), SamplingParams())
    sched.add(b)
    out = sched.schedule()
    assert chunks(out.prefills) == [("b", 8, 2)] and b.num_cached_prompt == 8
    assert b.blocks.block_table[:2] == a.blocks.block_table[:2]


def test_after_step_does_not_publish_a_block_holding_a_placeholder():
    bm, sched = make()
    prompt = list(range(200, 207))  # 7 tokens: the first sampled one completes block 2
    a = Sequence("a", prompt, SamplingParams())
    sched.add(a)
    sched.after_step(sched.schedule())
    a.add_placeholder(0)  # asynchronous scheduling: sampled, id still on the device
    out = sched.schedule()
    assert chunks(out.decodes) == [("a", 7, 1)] and a.input_token(7) == placeholder_id(0)
    sched.after_step(out)
    assert a.num_computed == 8 and len(a.blocks.hashes) == 1
    a.resolve(5)
    a.add_placeholder(0)
    sched.after_step(sched.schedule())
    assert len(a.blocks.hashes) == 2
    assert _cached_tokens(bm, prompt + [5, 9]) == 8
