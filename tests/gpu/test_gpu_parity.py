"""GPU-only checks (skipped without CUDA; run on the GPU machine): the Triton backend and CUDA
graphs give the same greedy tokens as eager attention and eager execution."""

import random

import pytest
import torch

from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    from tests.helpers import make_checkpoint

    # GPT-2 small's shapes (12 x 64 heads), fewer layers to keep it quick; random weights 5x GPT-2's
    # init scale, so greedy decoding does not collapse onto one token, yet fp16 does not overflow.
    return make_checkpoint(tmp_path_factory.mktemp("gpu-gpt2"), n_layer=4, n_head=12, n_embd=768,
                           n_positions=1024, vocab_size=2048, initializer_range=0.1)


def _prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2048) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run(path, prompts, max_tokens=24, **kw):
    eng = LLMEngine(EngineConfig(model=str(path), device="cuda", num_blocks=2048, **kw))
    outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    assert eng.block_manager.check_all_free()
    return [o.token_ids for o in outs]


class _Fp8Error:
    """How far an fp8 cache moves the gap between two tokens' log-probabilities after a context, for
    each of the two runs compared: per attention backend the runs used (`backends`, one per run), the
    gap from an engine with that backend over the fp8 cache minus the gap from the same engine over a
    16-bit cache (the same bf16 weights and kernels, so what both of its runs share drops out). Each
    token's log-probability is read as the last token of a scored prompt (prompt_logprobs), so any
    two tokens are measured, not only those among an engine's top 20 (an fp8_e5m2 parting's token
    was outside them, and the allowance fell back to the bf16 tie's). The engines start at the first
    parting and close with `close()`."""

    def __init__(self, path, kv_cache_dtype, backends=("eager", "eager")):
        self.path, self.kv_cache_dtype, self.backends, self.engines = path, kv_cache_dtype, backends, None
        self.last = ""  # what the last call measured (a failure's message says it)
        self.params = SamplingParams(max_tokens=0, prompt_logprobs=0)  # score the prompt, generate nothing

    def _start(self) -> dict:
        engines = {}
        for backend in dict.fromkeys(self.backends):
            engines[backend] = [LLMEngine(EngineConfig(
                model=str(self.path), device="cuda", num_blocks=512, attention=backend, dtype="bfloat16",
                enforce_eager=backend == "eager", enable_prefix_caching=False, kv_cache_dtype=kv))
                for kv in (self.kv_cache_dtype, "auto")]
        return engines

    def gap(self, eng, tokens, a: int, b: int) -> float:
        """log p(a) - log p(b) after `tokens`, by one engine."""
        la, lb = (out.prompt_logprobs.entries()[-1][0][1]
                  for out in eng.generate([tokens + [a], tokens + [b]], self.params))
        return la - lb

    def __call__(self, tokens, a: int, b: int) -> float:
        """The sum over the two runs' backends of |fp8 gap - 16-bit gap|."""
        if self.engines is None:
            self.engines = self._start()
        moved = {}
        for backend, (fp8, bf16) in self.engines.items():
            moved[backend] = abs(self.gap(fp8, tokens, a, b) - self.gap(bf16, tokens, a, b))
        self.last = ", ".join(f"{backend} moved it {m:.3f}" for backend, m in moved.items())
        return sum(moved[backend] for backend in self.backends)

    def close(self) -> None:
        for engines in (self.engines or {}).values():
            for eng in engines:
                eng.close()


def _assert_same_greedy(path, prompts, got, ref, dtype="float16", min_exact=0.75, kv_cache_dtype=None,
                        backends=("eager", "eager")):
    """Token-identical, except where two half-precision runs part at a near-tie. Different kernels
    round differently in fp16/bf16, so where the reference model's two best tokens are within
    rounding of each other either choice is right, and the sequences legitimately part there. Each
    parting point is checked against float32 logits of transformers' model: the two tokens chosen
    must be within a few rounding steps of the logits' scale (16 ulps of the dtype at the largest
    logit). A real bug parts sequences at clear winners and fails.

    Over an fp8 cache (`kv_cache_dtype`), two runs quantize K/V computed by different kernels: a
    value that lands near a rounding boundary of the mantissa (3 bits in e4m3, 2 in e5m2) goes one
    way in one run and the other way in the other, a step far larger than bf16's. So there a
    parting's gap may also be as large as what the fp8 cache does to that pair's gap in each run,
    measured for each run's attention backend (`backends`: got's, ref's) as an engine over the same
    cache dtype against one over a 16-bit cache (_Fp8Error); the runs' gaps can part by up to the sum
    of the two. (Until 2026-11-28 it allowed twice the eager backend's move, and the e5m2 graphs test
    parted at a gap of 2.2 where that allowed 1.1; the Triton run's own move was not measured. Then
    a token outside an engine's top 20 counted as no move, and the test parted there again; with
    each token scored by prompt_logprobs it passes on an H200.) A real bug still parts at gaps many
    times that."""
    error = _Fp8Error(path, kv_cache_dtype, backends) if kv_cache_dtype not in (None, "auto") else None
    try:
        _check_partings(path, prompts, got, ref, dtype, min_exact, error)
    finally:
        if error is not None:
            error.close()


def _check_partings(path, prompts, got, ref, dtype, min_exact, error):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    exact = 0
    for prompt, g, r in zip(prompts, got, ref):
        if g == r:
            exact += 1
            continue
        i = next(k for k, (x, y) in enumerate(zip(g, r)) if x != y)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + r[:i]], device="cuda")).logits[0, -1]
        gap = (logits[r[i]] - logits[g[i]]).abs().item()
        tie = 16 * torch.finfo(getattr(torch, dtype)).eps * logits.abs().max().item()
        if error is not None:
            tie += error(prompt + r[:i], r[i], g[i])
        fp8 = f"; the fp8 cache: {error.last}" if error is not None else ""
        assert gap < tie, f"parted at token {i} where the logits differ by {gap:.3f} (tie: < {tie:.3f}{fp8})"
    if dtype == "float16":  # bf16 keeps 8 bits of mantissa: near-ties are common, partings too
        assert exact >= min_exact * len(prompts), f"only {exact} of {len(prompts)} sequences token-identical"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_triton_matches_eager_greedy(gpt2_ckpt, dtype):
    # Mixed lengths (1, block-size multiples and not), prompts longer than one kernel tile.
    prompts = _prompts(24, 1, 300) + [[7], [3] * 16, [5] * 17, [9] * 64]
    ref = _run(gpt2_ckpt, prompts, attention="eager", dtype=dtype, enforce_eager=True)
    got = _run(gpt2_ckpt, prompts, attention="triton", dtype=dtype, enforce_eager=True)
    _assert_same_greedy(gpt2_ckpt, prompts, got, ref, dtype)


def test_triton_with_prefix_cache_and_chunks_matches_eager(gpt2_ckpt):
    shared = _prompts(1, 200, 200, seed=3)[0]
    prompts = [shared + p for p in _prompts(12, 1, 90, seed=4)]
    ref = _run(gpt2_ckpt, prompts, attention="eager", enable_prefix_caching=False, enforce_eager=True)
    got = _run(gpt2_ckpt, prompts, attention="triton", max_num_batched_tokens=128)
    # Twelve continuations of one 200-token text are far from independent: where one meets a
    # near-tie, others tend to. Each parting is still checked to be a near-tie; the numerics of
    # these mixed steps are pinned down by test_mixed_step_logprobs_match_enforce_eager.
    _assert_same_greedy(gpt2_ckpt, prompts, got, ref, min_exact=0.5)


@pytest.mark.parametrize("budget", [8192, 96])
@pytest.mark.parametrize("attention", ["triton", "eager"])
def test_cuda_graphs_match_enforce_eager(gpt2_ckpt, attention, budget):
    # 5, 11, 23 and 40 sequences: none is a captured size, so every graph step runs padded. With a
    # 96-token budget prompts are prefilled a chunk at a time while earlier ones decode: mixed steps,
    # whose decodes replay a graph beside the eager prefill chunk.
    for n in (5, 11, 23, 40):
        prompts = _prompts(n, 3, 120, seed=n)
        kw = dict(attention=attention, max_num_batched_tokens=budget)
        graphs = _run(gpt2_ckpt, prompts, **kw)
        # Captured prefill steps pad their token count, so cuBLAS may pick other GEMM kernels than
        # the eager step: near-tie partings get likelier. Each one is still checked to be a
        # near-tie, and the logprob tests below bound the numerics.
        _assert_same_greedy(gpt2_ckpt, prompts, graphs, _run(gpt2_ckpt, prompts, enforce_eager=True, **kw),
                            min_exact=0.5)


def _logprob_run(path, prompts, on_engine=None, **kw):
    """Greedy tokens and the chosen tokens' log-probabilities per request."""
    eng = LLMEngine(EngineConfig(model=str(path), device="cuda", num_blocks=2048, **kw))
    if on_engine is not None:
        on_engine(eng)
    return _logprobs(eng, prompts)


def _logprobs(eng, prompts):
    """_logprob_run's requests on a running engine."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    toks, lps = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            toks.setdefault(out.request_id, []).extend(out.new_token_ids)
            lps.setdefault(out.request_id, []).extend(lp[0][1] for lp in out.new_logprobs)
    assert eng.block_manager.check_all_free()
    return toks, lps


def _logprob_gap(a, b) -> float:
    """The largest difference of two runs' (_logprobs') log-probabilities wherever their sequences
    still agree (and at the first token where they part)."""
    (gt, gl), (et, el) = a, b
    assert gt.keys() == et.keys()
    worst = 0.0
    for rid in gt:
        same = next((i for i, (x, y) in enumerate(zip(gt[rid], et[rid])) if x != y), len(gt[rid]))
        worst = max([worst] + [abs(x - y) for x, y in zip(gl[rid][: same + 1], el[rid][: same + 1])])
    return worst


def _assert_same_logprobs(a, b, bound=0.1):
    """Wherever two runs' sequences still agree, every token's log-probability agrees (a wrong
    input token, page table or row order would be off by nats, not rounding)."""
    worst = _logprob_gap(a, b)
    assert worst < bound, f"log-probabilities differ by up to {worst:.3f}"


def test_mixed_step_logprobs_match_enforce_eager(gpt2_ckpt):
    # A 96-token budget prefills prompts a chunk at a time while earlier ones decode, so most steps
    # mix a prefill chunk (its own graph) with graph-replayed decodes.
    prompts = _prompts(24, 40, 200, seed=11)
    kw = dict(max_num_batched_tokens=96)
    _assert_same_logprobs(_logprob_run(gpt2_ckpt, prompts, **kw), _logprob_run(gpt2_ckpt, prompts, enforce_eager=True, **kw))


def test_prefill_graphs_logprobs_match_enforce_eager(gpt2_ckpt):
    # Prefill steps replayed from graphs: many chunks per step, lengths 1 to 300 (padded to the next
    # captured token count), cached prefixes read through page tables (prefix caching, chunking),
    # and a first step with more prompts than one graph holds (that one runs eagerly).
    from server.worker.cuda_graphs import PREFILL_GRAPH_SEQS

    shared = _prompts(1, 70, 70, seed=5)[0]
    prompts = (_prompts(PREFILL_GRAPH_SEQS + 4, 1, 8, seed=12)  # the first step's chunks: too many for a graph
               + _prompts(12, 1, 300, seed=13) + [shared + p for p in _prompts(8, 1, 60, seed=6)])
    calls = {"graph": 0, "eager": 0}

    def count(eng):
        graphs, eager = eng.runner.prefill_graphs.run, eng.runner._eager

        def run(*a, **k):
            calls["graph"] += 1
            return graphs(*a, **k)

        def eager_step(prefills, decodes, *a):
            calls["eager"] += bool(prefills)
            return eager(prefills, decodes, *a)

        eng.runner.prefill_graphs.run, eng.runner._eager = run, eager_step

    kw = dict(max_num_batched_tokens=512, enable_prefix_caching=True)
    got = _logprob_run(gpt2_ckpt, prompts, on_engine=count, **kw)
    assert calls["graph"] >= 3 and calls["eager"] >= 1, calls
    _assert_same_logprobs(got, _logprob_run(gpt2_ckpt, prompts, enforce_eager=True, **kw))


def test_async_scheduling_matches_synchronous_steps(gpt2_ckpt):
    # Same kernels, same numerics: overlapping host and device must not change a single token.
    prompts = _prompts(37, 1, 200, seed=9)
    assert _run(gpt2_ckpt, prompts, max_tokens=40) == _run(gpt2_ckpt, prompts, max_tokens=40, async_scheduling=False)


@pytest.mark.parametrize("n", [77, 9])
def test_fused_cuda_path_logits_match_transformers(gpt2_ckpt, n):
    # On CUDA the model runs its fused embedding and add+LayerNorm kernels; in float32 its logits
    # must match transformers' as closely as the CPU path's do (a long prompt and a decode-sized one).
    from transformers import GPT2LMHeadModel

    from models import StepRows, load_model

    hf = GPT2LMHeadModel.from_pretrained(gpt2_ckpt, dtype=torch.float32).cuda().eval()
    ours = load_model(gpt2_ckpt, torch.float32, torch.device("cuda"), "sdpa")
    prompt = _prompts(1, n, n, seed=5)[0]
    ids = torch.tensor(prompt, device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    rows = StepRows(torch.full((n,), -1, **i32), n, torch.tensor([0, n], **i32), torch.zeros(1, **i32),
                    torch.zeros(1, 1, **i32), [n], [0])
    meta = ours.attention.metadata(rows)
    from kvcache import CacheSpec, allocate_kv_cache

    caches = allocate_kv_cache(CacheSpec(4, 12, 64, 16, torch.float32), 1, torch.device("cuda"))
    with torch.no_grad():
        got = ours.lm_head(ours(ids, torch.arange(n, device="cuda"), caches, meta))[:, : ours.vocab_size].float()
        ref = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4)
