"""Prompt log-probabilities and the sampling controls through the whole engine on CPU, against
transformers: prompt scores equal its log-softmax (with and without prefix-cache hits, chunked,
preempted), and greedy decoding under penalties, logit_bias and min_tokens equals a reference loop
that applies each definition to transformers' logits."""

import gc
import random

import msgspec
import pytest
import torch
from transformers import GPT2LMHeadModel as HFModel

from server.config import EngineConfig
from server.engine import LLMEngine, RequestError, RequestOutput
from server.engine.outputs import PromptLogprobs
from server.sampling_params import SamplingParams


def _engine(path, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 128)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw))


@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    return HFModel.from_pretrained(tiny_ckpt).eval()


@pytest.fixture(scope="module")
def eng(tiny_ckpt):
    """One engine of the default configuration for the tests that need no other."""
    return _engine(tiny_ckpt)


@pytest.fixture(scope="module")
def prompts():
    g = random.Random(3)
    return [[g.randrange(512) for _ in range(n)] for n in (2, 19, 40, 70)]


def hf_prompt_scores(hf, prompt, k):
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    chosen = [logprobs[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]
    top = [logprobs[p].topk(k).indices.tolist() for p in range(len(prompt) - 1)]
    return chosen, top


def check_scores(out, hf, prompt, k=3):
    chosen, top = hf_prompt_scores(hf, prompt, k)
    got = out.prompt_logprobs
    assert len(got) == len(prompt) - 1
    for j, entry in enumerate(got):
        (tid, lp), *alts = entry
        assert tid == prompt[j + 1] and abs(lp - chosen[j]) < 1e-3
        assert len(alts) == k and [t for t, _ in alts][:1] == top[j][:1]


def test_prompt_logprobs_equal_transformers(eng, hf, prompts):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    for prompt, out in zip(prompts, eng.generate(prompts, params)):
        check_scores(out, hf, prompt)
        assert len(out.token_ids) == 3
    assert eng.block_manager.check_all_free()


def test_prompt_logprobs_chunked_and_with_a_cached_prefix(tiny_ckpt, hf, prompts):
    eng = _engine(tiny_ckpt, max_num_batched_tokens=16, block_size=8)
    long = prompts[3]
    eng.generate([long], SamplingParams(max_tokens=1, temperature=0))  # its blocks are in the prefix cache now
    hits = eng.block_manager.allocator.stats.hits
    again = eng.generate([long], SamplingParams(max_tokens=1, temperature=0))[0]
    assert again.cached_prompt_tokens > 0 and eng.block_manager.allocator.stats.hits > hits  # the cache is warm
    scored = eng.generate([long], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    assert scored.cached_prompt_tokens == 0  # scoring recomputes every position
    check_scores(scored, hf, long)


def test_prompt_logprobs_survive_preemption(tiny_ckpt, hf, prompts):
    # 8 blocks of 8 tokens: three 40-token prompts growing by 16 cannot all stay; some are recomputed.
    eng = _engine(tiny_ckpt, num_blocks=12, block_size=8, max_num_batched_tokens=32)
    ps = [prompts[2], prompts[2][::-1], prompts[2][1:] + [5]]
    outs = eng.generate(ps, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=3))
    assert eng.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs):
        check_scores(o, hf, p)


def test_max_tokens_zero_scores_the_prompt_only(eng, hf, prompts):
    out = eng.generate([prompts[1]], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.finished and out.token_ids == [] and out.completion_tokens == 0 and out.finish_reason == "length"
    check_scores(out, hf, prompts[1])
    with pytest.raises(RequestError, match="max_tokens is 0"):
        eng.add_request("x", prompts[1], SamplingParams(max_tokens=0))
    assert eng.block_manager.check_all_free()


def test_prompt_logprobs_travel_packed_with_no_object_a_token(eng, hf):
    """Issue 44: a 12.5k-token prompt with 20 alternatives held the engine's loop 128-533 ms while the
    worker and the engine built a list of tuples a prompt position. Now the step that scores a prompt
    allocates fewer GC-tracked objects (lists, tuples) than the prompt has tokens, and its output
    carries two arrays' bytes, which cross the pipe as two blobs; they read as the same entries."""
    prompt = [random.Random(5).randrange(400) for _ in range(250)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20)
    eng.generate([prompt], params)  # warm: what a first request builds once (detokenizer, caches)
    eng.add_request("packed", prompt, params)
    collections = []
    gc.collect()
    threshold = gc.get_threshold()
    gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
    gc.set_threshold(len(prompt), *threshold[1:])  # a collection per prompt's length of container objects
    try:
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.pop()
    assert len(collections) < 3, f"{len(collections)} collections: objects built per prompt token"  # lists: 22
    [out] = outs
    scores = out.prompt_logprobs
    assert isinstance(scores, PromptLogprobs) and type(scores.token_ids) is bytes and type(scores.logprobs) is bytes
    assert len(scores) == len(prompt) - 1 and scores.pairs == 21 * (len(prompt) - 1)
    wire = msgspec.msgpack.encode(out)
    assert len(wire) < 8 * scores.pairs + 200  # int32 + fp32 a pair, and little else
    decoded = msgspec.msgpack.Decoder(RequestOutput).decode(wire)
    check_scores(decoded, hf, prompt, k=20)
    assert decoded.prompt_logprobs[0] == scores.entries()[0] and decoded.prompt_logprobs[-1] == list(scores)[-1]
    assert eng.block_manager.check_all_free()


def reference_controls(logits, p: SamplingParams, prompt, generated, eos):
    """The definitions of vLLM and OpenAI, written out."""
    x = logits.clone()
    for tid, b in p.logit_bias.items():
        x[tid] += b
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=x.shape[0])[: x.shape[0]].float()
    seen = counts > 0
    seen[torch.tensor(prompt)] = True
    r = p.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    if len(generated) < p.min_tokens:
        x[list(eos | set(p.stop_token_ids))] = float("-inf")
    return x


def reference_greedy(hf, prompt, p: SamplingParams, eos):
    generated = []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + generated])).logits[0, -1].float()
        tok = int(reference_controls(logits, p, prompt, generated, eos).argmax())
        generated.append(tok)
        if tok in eos and not p.ignore_eos and len(generated) > p.min_tokens:
            break
    return generated


@pytest.mark.parametrize("p", [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=1.5),
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=2.0),
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5,
                   presence_penalty=0.5, logit_bias={7: 3.0, 9: -100.0}),
], ids=["repetition", "frequency", "presence", "all"])
def test_penalties_equal_their_reference_and_change_the_output(eng, hf, prompts, p):
    eos = set(eng.eos_token_ids)
    plain = SamplingParams(max_tokens=p.max_tokens, temperature=0, ignore_eos=True)
    # batched with plain requests and each other: controls are per row
    outs = eng.generate([prompts[1], prompts[2], prompts[1], prompts[3]], [p, plain, plain, p])
    assert outs[0].token_ids == reference_greedy(hf, prompts[1], p, eos)
    assert outs[3].token_ids == reference_greedy(hf, prompts[3], p, eos)
    assert outs[0].token_ids != outs[2].token_ids  # the penalty changed what greedy picks
    assert eng.block_manager.check_all_free()


def test_controls_are_built_again_only_when_the_rows_change(eng, hf, prompts, monkeypatch):
    """Steady decoding reuses the previous step's controls (server/worker/runner.py _controls); a
    row that finishes early changes the rows, and the controls built then still give each
    remaining row its own penalties."""
    from server.worker.logits import StepControls

    built = []
    build = StepControls.build
    monkeypatch.setattr(StepControls, "build", staticmethod(lambda *a, **kw: built.append(1) or build(*a, **kw)))
    eos = set(eng.eos_token_ids)
    long_ = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8, logit_bias={7: 2.0})
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, frequency_penalty=1.5)
    other = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=2.0)
    outs = eng.generate([prompts[1], prompts[3], prompts[2]], [long_, short, other])
    for prompt, p, out in zip([prompts[1], prompts[3], prompts[2]], [long_, short, other], outs):
        assert out.token_ids == reference_greedy(hf, prompt, p, eos)
    # built for the prompts' step (whose rows the decodes keep) and again once the short one ended,
    # not for each of the 12 steps
    assert 2 <= len(built) <= 4


def test_argmax_steps_choose_in_one_pass_and_others_use_the_sampler(eng, hf, prompts, monkeypatch):
    """Steps whose rows need only the argmax kernel's choice (greedy or sampled, penalties the only
    control) take it (in the decode graph on a GPU; here, without graphs, server/worker/choice.py
    argmax_choice with its reference), never the general sampler, and still give the reference's
    tokens and counts (the counts feed the next steps' penalties); a step with a bias or a top-p
    row takes the sampler. Seeded sampled rows give the same tokens either way."""
    import server.worker.choice as choice_mod
    import server.worker.runner as runner_mod

    calls = {"fused": 0, "sampler": 0}
    fused, sampler = choice_mod.penalized_argmax_ref, runner_mod.sample
    monkeypatch.setattr(choice_mod, "penalized_argmax_ref",
                        lambda *a, **kw: calls.__setitem__("fused", calls["fused"] + 1) or fused(*a, **kw))
    monkeypatch.setattr(runner_mod, "sample",
                        lambda *a, **kw: calls.__setitem__("sampler", calls["sampler"] + 1) or sampler(*a, **kw))
    eos = set(eng.eos_token_ids)
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.2)
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = eng.generate([prompts[1], prompts[2]], [p, plain])
    assert outs[0].token_ids == reference_greedy(hf, prompts[1], p, eos)
    assert calls == {"fused": 10, "sampler": 0}
    biased = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, frequency_penalty=1.5, logit_bias={7: 1.0})
    sampled = SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True, frequency_penalty=1.5)
    eng.generate([prompts[1], prompts[2]], [biased, sampled])
    assert calls == {"fused": 10, "sampler": 4}
    kinds = [dict(temperature=0.8, seed=5), dict(temperature=1.3, seed=6, presence_penalty=0.9),
             dict(temperature=0.6, seed=7, repetition_penalty=1.3, frequency_penalty=0.4), dict(temperature=0)]
    one_pass = eng.generate(prompts, [SamplingParams(max_tokens=12, ignore_eos=True, **k) for k in kinds])
    assert calls == {"fused": 22, "sampler": 4}
    general = eng.generate(prompts, [SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={5: 0.0}, **k)
                                     for k in kinds])
    assert calls == {"fused": 22, "sampler": 16}
    assert [o.token_ids for o in one_pass] == [o.token_ids for o in general]
    top_p = eng.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, ignore_eos=True))
    assert calls == {"fused": 22, "sampler": 19} and len(top_p[0].token_ids) == 3


def test_logit_bias_forces_and_bans_tokens(eng, prompts):
    forced = eng.generate([prompts[1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                       logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * 5
    plain = eng.generate([prompts[1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    banned = eng.generate([prompts[1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                       logit_bias={t: -100.0 for t in plain.token_ids}))[0]
    assert not set(banned.token_ids) & set(plain.token_ids)
    sampled = eng.generate([prompts[1]], SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True,
                                                        logit_bias={42: 100.0}))[0]
    assert sampled.token_ids == [42] * 5  # the sampler sees the bias too


def test_min_tokens_holds_back_eos_and_stop_ids(eng, prompts):
    eos = next(iter(eng.eos_token_ids))
    # EOS made the likeliest token: without min_tokens it ends at once, with it only after 6.
    p = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 50.0})
    assert eng.generate([prompts[1]], p)[0].token_ids == [eos]
    held = eng.generate([prompts[1]], SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 50.0},
                                                     min_tokens=6))[0]
    assert len(held.token_ids) == 7 and held.token_ids[-1] == eos and eos not in held.token_ids[:6]
    assert held.finish_reason == "stop"
    stop = eng.generate([prompts[1]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                     logit_bias={11: 50.0}, stop_token_ids=[11], min_tokens=4))[0]
    assert len(stop.token_ids) == 5 and stop.token_ids[-1] == 11 and 11 not in stop.token_ids[:4]
    with pytest.raises(RequestError, match="min_tokens"):
        eng.add_request("y", prompts[1], SamplingParams(max_tokens=3, min_tokens=4))
    with pytest.raises(RequestError, match="logit_bias token id 9999"):
        eng.add_request("z", prompts[1], SamplingParams(max_tokens=3, logit_bias={9999: 1.0}))
