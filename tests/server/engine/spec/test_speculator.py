"""Speculative decoding end to end on the CPU (server/engine/spec/, server/worker/spec/): the tokens
are the ones decoding gives without it (greedy, seeded sampling, every control, penalties read
per verification row; constrained rows: tests/server/engine/test_grammar.py), under chunked
prefill, preemption and prefix hits, with stops, max_tokens and logprobs inside accepted runs, no
block lost; sampled tokens keep the target's distribution (a chi-squared test); the back-off."""

import json
import random

import pytest
import torch

from server.config import EngineConfig, SpeculativeConfig
from server.engine import LLMEngine
from server.engine.spec.policy import SpecState, record
from server.sampling_params import SamplingParams, StructuredOutput
from tests.helpers import make_checkpoint, make_llama_checkpoint


def _spec(method: str, k: int = 3, **kw) -> SpeculativeConfig:
    return SpeculativeConfig.parse(json.dumps({"method": method, "num_speculative_tokens": k, **kw}))


def _draft(path, k: int = 3, **kw) -> SpeculativeConfig:
    return _spec("draft_model", k, model=str(path), **kw)


NGRAM = dict(prompt_lookup_min=1, prompt_lookup_max=3)


def _run(path, prompts, params, spec=None, **kw):
    """(outputs, engine) of one engine over `prompts` with the blocks checked free afterwards."""
    kw.setdefault("num_blocks", 96)
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", speculative_config=spec, **kw))
    outs = eng.generate(prompts, params)
    assert eng.block_manager.check_all_free()
    return outs, eng


def _prompts(vocab, n, seed, repeat=True):
    """Mixed lengths; half of them repeat a phrase (something for the n-gram method to find)."""
    g = random.Random(seed)
    out = []
    for i in range(n):
        p = [g.randrange(vocab) for _ in range(g.randint(2, 30))]
        out.append(p * 3 if repeat and i % 2 else p)
    return out


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("spec-llama"), num_hidden_layers=2)


@pytest.fixture(scope="module")
def other_gpt2(tmp_path_factory):
    """A draft that seldom agrees with the tiny checkpoint (other random weights): most proposals fail."""
    return make_checkpoint(tmp_path_factory.mktemp("spec-other"), n_layer=1, seed=7)


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
_REFS = {}  # family -> (prompts, outputs without speculation): one reference run per family


@pytest.mark.parametrize("family,method", [("gpt2", "self"), ("gpt2", "other"), ("gpt2", "ngram"),
                                           ("llama", "self"), ("llama", "ngram"), ("llama-fp8", "ngram")])
def test_greedy_tokens_unchanged_with_preemption_prefix_hits_and_chunks(tiny_ckpt, llama_ckpt, other_gpt2, family,
                                                                        method):
    """A shared prefix (hits), a 40-token step budget (prompts in chunks beside verifications) and 20
    blocks for 12 sequences (preemption, recomputation): greedy tokens identical to decoding without
    speculation, proposals verified and accepted, no block lost."""
    path = tiny_ckpt if family == "gpt2" else llama_ckpt
    shared = _prompts(400, 1, seed=9, repeat=False)[0] * 2
    prompts = [shared + p for p in _prompts(400, 6, seed=1)] + _prompts(400, 6, seed=2)
    kw = dict(num_blocks=20, max_num_batched_tokens=40, max_num_seqs=64)
    if family == "llama-fp8":  # the target's cache in fp8, written and read by the verifications too
        kw |= dict(kv_cache_dtype="fp8", num_blocks=40)
    if family not in _REFS:
        _REFS[family] = _run(path, prompts, GREEDY, **kw)[0]
    ref = _REFS[family]
    draft = {"self": path, "other": other_gpt2}.get(method)
    spec = _draft(draft, disable_by_batch_size=16) if draft else _spec("ngram", disable_by_batch_size=16, **NGRAM)
    got, eng = _run(path, prompts, GREEDY, spec, **kw)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    c = eng.speculator.counters
    assert c.drafts > 0 and c.draft_tokens >= c.drafts
    assert eng.scheduler.num_preemptions > 0 and eng.block_manager.allocator.stats.hits > 0
    if method == "self":  # the draft is the target: (nearly) every proposal stands
        assert c.accepted_tokens >= 0.9 * c.draft_tokens
    assert sum(o.completion_tokens for o in got) == eng.num_generated_tokens == 20 * len(prompts)


def test_triton_verifications_attend_as_decode_rows(llama_ckpt, monkeypatch):
    """Our kernels (the interpreter on the CPU): a verification's tokens attend through the paged
    decode kernel as decode rows (models/attention/triton_backend.py token_rows), and the greedy
    tokens are decoding's without speculation."""
    import models.attention.triton_backend as tb

    built, original = [], tb.token_rows
    monkeypatch.setattr(tb, "token_rows", lambda *a: built.append(a[-1]) or original(*a))
    prompts = _prompts(400, 2, seed=4, repeat=False)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(attention="triton", dtype="float16")
    ref = _run(llama_ckpt, prompts, params, **kw)[0]
    got, eng = _run(llama_ckpt, prompts, params, _draft(llama_ckpt), **kw)  # (the target as its draft)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert eng.speculator.counters.drafts > 0 and built


def test_stops_max_tokens_and_logprobs_inside_accepted_runs(tiny_ckpt):
    """With the target as its own draft every step accepts a run of up to four tokens: a stop id, a
    stop string or max_tokens inside a run ends the request exactly where decoding without
    speculation does (nothing of the run past it), and each token's logprobs are its own row's."""
    prompts = _prompts(400, 4, seed=3)
    base, _ = _run(tiny_ckpt, prompts, GREEDY)
    params = []
    for i, o in enumerate(base):
        ids, text = o.token_ids, o.text
        if i == 0:
            params.append(SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[ids[6]]))
        elif i == 1 and len(text) > 8:
            params.append(SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[text[5:8]]))
        else:
            params.append(SamplingParams(max_tokens=7 + 2 * i, temperature=0.0, ignore_eos=True, logprobs=2))
    ref, _ = _run(tiny_ckpt, prompts, params)
    got, eng = _run(tiny_ckpt, prompts, params, _draft(tiny_ckpt, k=4))
    assert eng.speculator.counters.accepted_tokens > 0
    for r, g, p in zip(ref, got, params):
        assert (g.token_ids, g.text, g.finish_reason) == (r.token_ids, r.text, r.finish_reason)
        assert len(g.token_ids) <= p.max_tokens
    # the chosen token's logprob and its two alternatives, per token, as without speculation
    lp_ref = _logprobs(tiny_ckpt, prompts[2:], params[2:], None)
    lp_got = _logprobs(tiny_ckpt, prompts[2:], params[2:], _draft(tiny_ckpt, k=4))
    for a, b in zip(lp_ref, lp_got):
        assert [[t for t, _ in e] for e in a] == [[t for t, _ in e] for e in b]
        assert max(abs(x - y) for ea, eb in zip(a, b) for (_, x), (_, y) in zip(ea, eb)) < 1e-4


def _logprobs(path, prompts, params, spec):
    """Every token's logprob entries, per request, collected from the engine's outputs step by step."""
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", num_blocks=96, speculative_config=spec))
    got = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_logprobs)
    return [got[str(i)] for i in range(len(prompts))]


def test_sampled_controls_and_constrained_rows_beside_speculating_ones(tiny_ckpt):
    """Seeded sampling (temperature, top-k/top-p, logit_bias, min_tokens) speculates and samples the
    tokens it samples without speculation (the noise is counted by position), beside penalized and
    grammar-constrained requests in the same steps."""
    prompts = _prompts(400, 7, seed=4)
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.7, top_k=20, top_p=0.9, seed=12, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.0, logit_bias={5: 3.0}, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=13, min_tokens=10),
              SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=0.5, repetition_penalty=1.2,
                             ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.0, structured=StructuredOutput("regex", "[a-f]{3,12}")),
              GREEDY]
    ref, _ = _run(tiny_ckpt, prompts, params)
    got, eng = _run(tiny_ckpt, prompts, params, _draft(tiny_ckpt))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert eng.speculator.counters.accepted_tokens > 0
    draft = eng.speculator.proposer.runner
    assert draft.kv_caches
    eng.close()
    assert draft.kv_caches == [] and draft.graphs is None  # the draft's memory goes back with the engine's


def test_penalized_rows_speculate_and_choose_as_without(tiny_ckpt):
    """Presence, frequency and repetition penalties, greedy and seeded sampling (the argmax kernel's
    choice, and the general sampler's with top-k): each verification row is penalized by the counts
    after the proposals before it, and the sequence's counts take the accepted run, so the tokens
    are the ones decoding without speculation chooses; runs of proposals stand; every count slot,
    scratch ones included, is free afterwards."""
    prompts = _prompts(400, 4, seed=8)
    params = [SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=0.4, frequency_penalty=0.3,
                             ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, frequency_penalty=0.5, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, top_k=30, seed=6, presence_penalty=0.6,
                             repetition_penalty=1.1, ignore_eos=True)]
    ref, _ = _run(tiny_ckpt, prompts, params)
    got, eng = _run(tiny_ckpt, prompts, params, _draft(tiny_ckpt, k=4))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    c = eng.speculator.counters
    assert c.accepted_per_pos[1] > 0  # runs past the first proposal: counted by count_runs
    counts = eng.runner.counts
    assert not counts.slots and not counts.scratched and len(counts.free) + len(counts.released) == counts.counts.shape[0]


@pytest.fixture(scope="module")
def v16_ckpt(tmp_path_factory):
    """A 16-token vocabulary, its logits spread enough that sampling draws many tokens."""
    return make_checkpoint(tmp_path_factory.mktemp("spec-v16"), n_layer=1, n_head=2, n_embd=32, vocab_size=16,
                           initializer_range=0.5, seed=3)


def test_a_draft_with_another_tokenizer_is_refused(tiny_ckpt, v16_ckpt):
    with pytest.raises(ValueError, match="another tokenizer"):
        LLMEngine(EngineConfig(model=str(tiny_ckpt), device="cpu", num_blocks=8, speculative_config=_draft(v16_ckpt)))


def test_sampled_token_frequencies_match_plain_sampling(v16_ckpt):
    """A 16-token vocabulary, temperature 1: the tokens at output positions 1-3 (verified rows: the
    first comes from the prompt's prefill) of 1200 requests sampled with speculation (the target
    as its own draft, so most tokens come from accepted runs) against 1200 without, other seeds: a
    two-sample chi-squared test per position. Seeded, so the verdict is fixed for the code."""
    path = v16_ckpt
    n, prompt = 1200, [3, 1, 4, 1, 5]
    spec = _draft(path, k=3, disable_by_batch_size=256)
    # 64 blocks of 16 tokens hold 64 requests at once: the step's rows (at most max_num_seqs) leave
    # room for their verifications
    kw = dict(num_blocks=64, max_num_seqs=256)

    def sample(seed0, s, count=n):
        params = [SamplingParams(max_tokens=4, temperature=1.0, seed=seed0 + i, ignore_eos=True) for i in range(count)]
        outs, eng = _run(path, [prompt] * count, params, s, **kw)
        return torch.tensor([o.token_ids for o in outs]), eng

    with_spec, eng = sample(0, spec)
    without, _ = sample(10 * n, None)
    c = eng.speculator.counters
    assert c.drafts > n / 2 and c.accepted_tokens > c.draft_tokens / 4  # runs were accepted
    for pos in (1, 2, 3):
        a, b = (torch.bincount(x[:, pos], minlength=16).double() for x in (with_spec, without))
        keep = (a + b) >= 10  # cells too rare for the test are pooled
        a, b = torch.cat([a[keep], a[~keep].sum()[None]]), torch.cat([b[keep], b[~keep].sum()[None]])
        total = a + b
        exp_a, exp_b = total * a.sum() / (a.sum() + b.sum()), total * b.sum() / (a.sum() + b.sum())
        nz = total > 0
        stat = (((a - exp_a) ** 2 / exp_a)[nz] + ((b - exp_b) ** 2 / exp_b)[nz]).sum()
        df = int(nz.sum()) - 1
        p = torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.double), stat / 2).item()
        assert p > 1e-3, f"position {pos}: chi2 {stat:.1f} on {df} df, p = {p:.2g}"
    # and a seeded request samples what it samples without speculation
    again, _ = sample(0, None, 200)
    assert torch.equal(again, with_spec[:200])


def test_back_off_and_batch_size_limit(tiny_ckpt, other_gpt2):
    """A draft that keeps missing stops being asked (a probe every few steps, not every step), under
    either back-off rule (the batch one: the draft's default); above disable_by_batch_size running
    sequences nothing speculates."""
    prompts = _prompts(400, 2, seed=5, repeat=False)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ref, _ = _run(tiny_ckpt, prompts, params)
    for rule in ({"backoff": "per_sequence", "min_acceptance": 0.5}, {}):
        got, eng = _run(tiny_ckpt, prompts, params, _draft(other_gpt2, **rule))
        assert (eng.speculator.batch is None) == bool(rule)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        c = eng.speculator.counters
        assert 0 < c.drafts < 60 and c.accepted_tokens < c.draft_tokens / 2
    # six requests that run and end together: never four or fewer running
    _, eng = _run(tiny_ckpt, _prompts(400, 6, seed=6), params, _draft(tiny_ckpt, disable_by_batch_size=4))
    assert eng.speculator.counters.drafts == 0


def test_back_off_rule():
    st = SpecState()
    record(st, 3, 3, 0.25)
    assert (st.skip, st.backoff) == (0, 0)
    lengths = []
    for _ in range(12):
        record(st, 3, 0, 0.25)
        lengths.append(st.skip)
    assert lengths == [0, 0, 0, 0, 1, 2, 4, 8, 16, 32, 64, 64]  # (the first misses only lower the average)
    record(st, 3, 2, 0.25)
    assert st.backoff == 0
