"""GPU-only (skipped without two CUDA GPUs): tensor parallelism over NCCL, with the Triton backend,
CUDA graphs (the all-reduces, the LM head's gather and the sampled ids' broadcast captured in them),
asynchronous scheduling, chunked prefill and prefix caching: --tensor-parallel-size 2 gives one
GPU's greedy tokens up to bf16 near-ties (each parting checked against transformers' fp32 logits,
as test_gpu_parity does) and its chosen tokens' log-probabilities within bf16 noise, at the
Llama-3.1-8B shape's attention (32 query and 8 K/V heads of 128, hidden 4096) with fewer layers, a
narrower MLP and a smaller vocabulary; eager steps (--enforce-eager) likewise; the rank-0-only
parts (penalties, seeded sampling, structured outputs with the grammar's wait on the device, prompt
log-probabilities) run beside the collectives and choose what one GPU chooses; speculative decoding
(n-gram, a draft model and an EAGLE-3 head whole on rank 0, the verification graphs on both ranks)
gives two GPUs' greedy tokens without it; --deterministic
at two GPUs keeps a request's bits whatever shares its batch; and quantized checkpoints (FP8 per
channel and in 128x128 blocks, GPTQ with act order, AWQ) at two GPUs, each rank holding its share of
the quantized tensors (models/quant/shards.py), give one GPU's greedy tokens up to near-ties of the
dequantized weights. The custom all-reduce (the default: a one-shot over symmetric memory,
kernels/one_shot_all_reduce.py) gives NCCL's sum bit for bit at two ranks, on awkward sizes,
eagerly and replayed from a CUDA graph, and an engine with it gives the tokens of one with
--disable-custom-all-reduce.

The one-GPU reference engine runs on cuda:0 throughout; the two-GPU engines have rank 0 in this
process and rank 1 in a process of its own on cuda:1, one at a time (one group per process)."""

import gc
import json

import pytest
import torch

from models import tensor_parallel
from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams, StructuredOutput
from tests.gpu.test_gpu_parity import _assert_same_greedy, _assert_same_logprobs, _logprob_gap, _logprobs, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs")

# Llama-3.1-8B's attention; 3 layers, MLP 4096 wide, 4096-token vocabulary (_prompts draws ids < 2048)
SHAPE = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096, intermediate_size=4096,
             num_hidden_layers=3, max_position_embeddings=2048, vocab_size=4096, initializer_range=0.02)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.helpers import make_llama_checkpoint

    path = make_llama_checkpoint(tmp_path_factory.mktemp("tp-llama-8b-shape"), "llama", **SHAPE)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))  # served in bf16, as 8B is
    return path


def _engine(path, tp: int, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cuda", tensor_parallel_size=tp, num_blocks=1024,
                                  max_model_len=2048, max_num_batched_tokens=256, **kw))


@pytest.fixture(scope="module")
def one_gpu(ckpt):
    eng = _engine(ckpt, 1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def two_gpus(ckpt):
    eng = _engine(ckpt, 2)
    yield eng
    eng.close()


# 16-bit messages for the one-shot: a decode row of the 8B shape, odd widths, one element, several
# rows, the 2 MiB that fill its slots (the kernel's persistent loop: more chunks than programs), fp16;
# and two it does not serve (NCCL's, in the same graph): fp32, and one past its slots
AR_CASES = [((1, 4096), torch.bfloat16), ((1, 4097), torch.bfloat16), ((3, 999), torch.bfloat16),
            ((1, 1), torch.bfloat16), ((7, 4096), torch.bfloat16), ((256, 4096), torch.bfloat16),
            ((2, 4096), torch.float16), ((1, 1001), torch.float16),
            ((2, 4096), torch.float32), ((300, 4096), torch.bfloat16)]


def _all_reduce_rank(rank: int, size: int, port: int, out) -> None:
    """One rank of a group with the custom all-reduce: each AR_CASES message summed by it and by
    NCCL, eagerly, then from one CUDA graph capturing all of them, replayed over new inputs."""
    import os

    import torch.distributed as dist
    from torch.distributed import TCPStore

    from models import close_tensor_parallel, init_tensor_parallel
    from server.config import NCCL_ENV

    os.environ.update(NCCL_ENV)
    device = torch.device("cuda", rank)
    tp = init_tensor_parallel(rank, size, TCPStore("127.0.0.1", port, size, is_master=rank == 0), device,
                              custom_all_reduce=True)
    gen = torch.Generator(device=device).manual_seed(rank)

    def nccl(x):
        y = x.clone()
        dist.all_reduce(y)
        return y

    def new(shape, dtype):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    graph = None
    try:
        served = [tp.custom is not None and tp.custom.fits(new(s, d)) for s, d in AR_CASES]
        eager = []
        for shape, dtype in AR_CASES:
            x = new(shape, dtype)
            got = tp.all_reduce(x.clone())
            eager.append((got - nccl(x)).abs().max().item())
        inputs = [torch.zeros(s, dtype=d, device=device) for s, d in AR_CASES]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [tp.all_reduce(x) for x in inputs]
        replays = []
        for _ in range(3):
            parts = [new(x.shape, x.dtype) for x in inputs]
            for x, part in zip(inputs, parts):
                x.copy_(part)
            graph.replay()  # (NCCL's, past the buffer, sums its input in place: compare with the parts kept)
            replays.append([(o - nccl(part)).abs().max().item() for part, o in zip(parts, outs)])
        torch.cuda.synchronize()
        if rank == 0:
            out.put(("all-reduce", served, eager, replays))
    finally:
        del graph  # before the group goes (pytorch#115388)
        gc.collect()
        close_tensor_parallel()


def test_symmetric_all_reduce_is_nccls_sum_eagerly_and_in_a_cuda_graph():
    """At two ranks the one-shot adds each element once, in rank order, rounded once to the message's
    dtype, as NCCL's sum of two does: the same bits, eagerly and over graph replays (whose parities
    alternate on the device: a replay that read a stale or uncleared slot would differ or hang)."""
    from tests.helpers import run_ranks

    served, eager, replays = run_ranks(_all_reduce_rank, 2, (), 1)["all-reduce"]
    assert served == [True] * (len(AR_CASES) - 2) + [False, False], "the custom all-reduce is not set up (its log says why)"
    assert eager == [0.0] * len(AR_CASES), f"eager sums differ from NCCL's by {eager}"
    assert replays == [[0.0] * len(AR_CASES)] * 3, f"graph replays differ from NCCL's by {replays}"


def _workload():
    shared = _prompts(1, 150, 150, seed=3)[0]
    return _prompts(20, 1, 300) + [[7], [5] * 17] + [shared + p for p in _prompts(6, 1, 40, seed=4)]


def _compare(ckpt, prompts, two, one):
    order = [str(i) for i in range(len(prompts))]
    _assert_same_greedy(ckpt, prompts, [two[0][r] for r in order], [one[0][r] for r in order], "bfloat16")
    _assert_same_logprobs(two, one, bound=0.15)


def test_two_gpus_give_one_gpus_greedy_tokens_and_logprobs(ckpt, one_gpu, two_gpus):
    prompts = _workload()
    _compare(ckpt, prompts, _logprobs(two_gpus, prompts), _logprobs(one_gpu, prompts))


def test_rank_0s_choices_beside_the_collectives(one_gpu, two_gpus):
    """Penalties (the decode graph's penalized argmax), seeded sampling with top-k (the general
    sampler) and without (the argmax's noise), a structured regex (the grammar's wait kernel on rank
    0's stream, then its masked argmax), and prompt log-probabilities (eager steps with LM-head
    slices on every rank), all in one batch."""
    params = [SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.2, frequency_penalty=0.3),
              SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=5),
              SamplingParams(max_tokens=16, temperature=1.0, seed=6),
              SamplingParams(max_tokens=16, temperature=0, structured=StructuredOutput("regex", "[a-z ]{4,20}")),
              SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)] * 2
    prompts = _prompts(len(params), 20, 120, seed=9)
    want = one_gpu.generate(prompts, params)
    got = two_gpus.generate(prompts, params)
    assert two_gpus.block_manager.check_all_free()
    for p, a, b in zip(params, want, got):
        assert len(b.token_ids) == len(a.token_ids) or p.structured is not None
        if p.prompt_logprobs:
            worst = max(abs(x[0][1] - y[0][1]) for x, y in zip(a.prompt_logprobs, b.prompt_logprobs))
            assert worst < 0.15, f"prompt log-probabilities differ by {worst:.3f}"
    same = sum(a.token_ids == b.token_ids for a, b in zip(want, got))
    assert same >= len(params) // 2, f"only {same} of {len(params)} requests chose one GPU's tokens"


def test_custom_all_reduce_gives_nccls_tokens(ckpt, one_gpu, two_gpus):
    """The default (no --disable-custom-all-reduce): a decode step's all-reduces (and the short
    prefills') are the one-shot's, inside the graphs. Its sums are NCCL's bits at two ranks (above),
    so the tokens are those of an engine whose all-reduces are all NCCL's, and so one GPU's up to
    bf16 near-ties."""

    prompts = _workload()
    assert tensor_parallel().custom is not None, "the custom all-reduce is not set up (the log says why)"
    custom = _logprobs(two_gpus, prompts)
    two_gpus.close()  # (its group: one per process)
    eng = _engine(ckpt, 2, disable_custom_all_reduce=True)
    try:
        assert tensor_parallel().custom is None
        nccl = _logprobs(eng, prompts)
    finally:
        eng.close()
    assert custom[0] == nccl[0]
    _assert_same_logprobs(custom, nccl, bound=1e-3)
    _compare(ckpt, prompts, custom, _logprobs(one_gpu, prompts))


def _fused_rank(rank: int, size: int, port: int, path: str, fused: str, out) -> None:
    """A spawned process (run_ranks' one rank; its port unused): a two-GPU engine, the process's first
    (symm_all_reduce sets a group up once a process), with FUSED_ADD_RMSNORM_ENV as `fused`."""
    import os

    from models.parallel.layers import FUSED_ADD_RMSNORM_ENV

    os.environ[FUSED_ADD_RMSNORM_ENV] = fused  # (read as the model is built, on every rank)
    eng = _engine(path, 2)
    try:
        assert tensor_parallel().custom is not None, "the custom all-reduce is not set up (the log says why)"
        out.put(("logprobs", _logprobs(eng, _workload()[::2])))
    finally:
        eng.close()


def test_fused_all_reduce_add_rmsnorm_gives_the_unfused_bits(request, ckpt):
    """FLASHPAGE_FUSED_ADD_RMSNORM=1 (models/parallel/layers.py): each row-parallel projection's sum,
    the residual add and the norm after it in one launch (kernels/one_shot_all_reduce.py), whose
    bits are the all-reduce's then add_rmsnorm's: every token and log-probability the same as the
    default engine's. Each engine in a new process: this one may have set its group up already."""
    from tests.helpers import run_ranks

    if tensor_parallel().size > 1:  # (the module's engine holds cuda:1's rank for good otherwise)
        request.getfixturevalue("two_gpus").close()
    got = {fused: run_ranks(_fused_rank, 1, (str(ckpt), fused), 1)["logprobs"][0] for fused in ("0", "1")}
    assert got["1"] == got["0"]


@pytest.fixture(scope="module")
def heads(ckpt, tmp_path_factory):
    """Drafts for the target: itself (whole on rank 0, so that runs are accepted) and a random
    EAGLE-3 head reading its three layers."""
    from benchmarks.shared.checkpoint import make_random_eagle3

    head = make_random_eagle3(tmp_path_factory.mktemp("tp-eagle3"), ckpt, draft_vocab_size=1024, layer_ids=[0, 1, 2],
                              std=0.05)
    return {"draft_model": ckpt, "eagle3": head}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_speculation_at_two_gpus_gives_two_gpus_tokens(request, ckpt, heads, method):
    """--speculative-config at two GPUs (server/worker/spec/parallel.py): rank 1 replays rank 0's
    verification graphs (their messages counted), the draft runs whole on rank 0 in its own graphs,
    an EAGLE-3 head over the target's states and token table there; greedy tokens are two GPUs'
    without speculation (the same engine, its speculator taken away after its run), up to bf16
    near-ties. (Closes the module's two-GPU engine where it runs: one group per process.)"""
    from collections import Counter

    from server.config import SpeculativeConfig

    prompts = [p + p[: len(p) // 2] for p in _prompts(10, 4, 200, seed=31)]  # repeats: n-grams to find
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    if tensor_parallel().size > 1:  # (only the module's engine is left open between tests)
        request.getfixturevalue("two_gpus").close()
    spec = {"method": method, "num_speculative_tokens": 4}
    spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {"model": str(heads[method])}
    eng = _engine(ckpt, 2, speculative_config=SpeculativeConfig.parse(json.dumps(spec)))
    try:
        sent, send = Counter(), eng.runner.peers.send

        def count(op):
            sent[type(op).__name__, getattr(op, "verify", False)] += 1
            send(op)

        eng.runner.peers.send = count
        got = [o.token_ids for o in eng.generate(prompts, greedy)]
        assert eng.block_manager.check_all_free()
        c = eng.speculator.counters
        assert c.drafts > 0 and sent["GraphStep", True] > 0  # verifications replayed on rank 1
        if method != "ngram":
            assert eng.speculator.proposer.runner.graphs is not None  # the draft's own graphs, rank 0's
        if method == "draft_model":  # the whole model on rank 0 proposes what the two ranks choose
            assert c.accepted_tokens > 0.5 * c.draft_tokens
        speculator, eng.speculator = eng.speculator, None
        plain = [o.token_ids for o in eng.generate(prompts, greedy)]
        eng.speculator = speculator  # (closed with the engine: the draft's graphs and cache)
    finally:
        eng.close()
    _assert_same_greedy(ckpt, prompts, got, plain, "bfloat16")


def test_eager_steps_at_two_gpus_too(ckpt, one_gpu, two_gpus):
    prompts = _workload()[::2]
    want = _logprobs(one_gpu, prompts)
    two_gpus.close()  # (its group: one per process)
    eager = _engine(ckpt, 2, enforce_eager=True)
    try:
        _compare(ckpt, prompts, _logprobs(eager, prompts), want)
    finally:
        eager.close()


# an engine its script never closes, with start-up's heap frozen as the server and the benchmarks
# freeze it: its exit must not wait on a CUDA graph that captured collectives (NCCL's destroy hangs
# while one lives; the peers harness's 70B TP=4 process hung 6 min in its exit, 2026-11-28)
_EXIT_SCRIPT = """
import gc, sys
from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams
engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cuda", tensor_parallel_size=2, num_blocks=256,
                                max_model_len=512, max_num_batched_tokens=256))
out = engine.generate([[1, 2, 3, 4]], [SamplingParams(max_tokens=8, ignore_eos=True)])
assert len(out[0].token_ids) == 8
gc.collect()
gc.freeze()
print("generated", flush=True)
"""


def test_an_engine_never_closed_exits_with_its_process(ckpt, two_gpus):
    import subprocess
    import sys
    from pathlib import Path

    two_gpus.close()  # (one group per process: the script's engine is the only one on these GPUs' ranks)
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(ckpt)], cwd=root, capture_output=True,
                              text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit within 240 s of its script's end: {(e.stdout or b'')[-2000:]!r}")
    assert "generated" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]


def test_deterministic_mode_at_two_gpus_keeps_a_requests_bits_whatever_its_batch(ckpt):
    """The row-parallel sums are an all-gather and a sum in rank order there (models/parallel/group.py)."""
    probe = _prompts(1, 90, 90, seed=12)
    eng = _engine(ckpt, 2, deterministic=True)
    try:
        alone = _logprobs(eng, probe)
        crowded = _logprobs(eng, probe + _prompts(15, 1, 200, seed=13))
    finally:
        eng.close()
    assert alone[0]["0"] == crowded[0]["0"] and alone[1]["0"] == crowded[1]["0"]


def test_fp8_cache_at_two_gpus(ckpt, two_gpus):
    """--kv-cache-dtype fp8 at two GPUs: each rank's cache holds its 4 K/V heads and their scales
    (calibrated on both ranks at once, server/worker/kv_scales.py), and the greedy tokens and
    log-probabilities are one GPU's over an fp8 cache, up to bf16 near-ties."""
    two_gpus.close()  # (one group per process)
    prompts = _workload()
    one = _engine(ckpt, 1, kv_cache_dtype="fp8")
    try:
        ref = _logprobs(one, prompts)
        whole = one.runner.kv_caches[0][0].scale.clone()
    finally:
        one.close()
    two = _engine(ckpt, 2, kv_cache_dtype="fp8")
    try:
        got = _logprobs(two, prompts)
        k_cache = two.runner.kv_caches[0][0]
        assert k_cache.dtype == torch.float8_e4m3fn and k_cache.shape[2] == 4
        torch.testing.assert_close(k_cache.scale, whole[:4], rtol=1e-2, atol=0)  # rank 0's heads
    finally:
        two.close()
    _compare(ckpt, prompts, got, ref)


# a format of each family (test_quant_shards.py's): FP8 per channel with per-token activations (a
# row-parallel rank scales its own columns), FP8 blocks, GPTQ's act order (every group's scales on
# each rank: the g_idx gathers), AWQ
QUANT = ("fp8-dynamic", "fp8-block", "gptq-desc-act", "awq")


@pytest.fixture(scope="module")
def quantized(ckpt, tmp_path_factory):
    """format -> (its checkpoint of the 8B-shape model, a 16-bit copy holding its dequantized
    weights: the float32 reference of the parting points)."""
    from benchmarks.quant.quant_checkpoint import quantize_checkpoint
    from tests.helpers import with_tensors

    root = tmp_path_factory.mktemp("tp-quant")
    out = {}
    for fmt in QUANT:
        deq = quantize_checkpoint(ckpt, root / fmt, fmt, device="cuda")
        out[fmt] = root / fmt, with_tensors(ckpt, root / f"{fmt}-dequantized", deq)
    return out


@pytest.mark.parametrize("fmt", QUANT)
def test_quantized_checkpoints_at_two_gpus_give_one_gpus_tokens(quantized, fmt):
    """Two GPUs with CUDA graphs (each rank's quantized GEMMs captured beside the all-reduces) against
    one GPU's eager steps (whose bits its graphs replay: test_gpu_quant.py). Each rank holds half of
    the quantized bytes (the embedding and head are split too; norms are whole). FP8 per channel
    quantizes a row-parallel input per token over a rank's own columns, and any FP8 activation's
    scale moves with its row's largest value, in which a last bit differs where the all-reduce adds
    in another order (fp8-block's too): so FP8 log-probabilities may move by twice that
    quantization's own error (each run's rounding against the 16-bit values; measured here, one
    GPU's FP8 run against the dequantized weights' 16-bit run), not by bf16's alone. (Last in the
    file: the tests before close the module's two-GPU engine, whose group would stop another's in
    this process.)"""
    path, dequantized = quantized[fmt]
    prompts = _workload()[::2]
    one = _engine(path, 1, enforce_eager=True)
    try:
        want, whole = _logprobs(one, prompts), one.weight_bytes
    finally:
        one.close()
    fp8_error = 0.0
    if fmt.startswith("fp8"):
        dense = _engine(dequantized, 1, enforce_eager=True)
        try:
            fp8_error = _logprob_gap(want, _logprobs(dense, prompts))
        finally:
            dense.close()
        assert fp8_error < 1.0  # FP8 activations' own error: tenths of a nat, not a wrong row's several
    two = _engine(path, 2)
    try:
        got = _logprobs(two, prompts)
        assert two.quantization == one.quantization and two.weight_bytes < 0.6 * whole
        down = two.runner.model.layers[0].mlp.down_proj
        held = down.weight if fmt.startswith("fp8") else down.qweight
        assert held.dtype == (torch.float8_e4m3fn if fmt.startswith("fp8") else torch.int32)
        assert held.shape[1] == (SHAPE["intermediate_size"] // 2) // (1 if fmt.startswith("fp8") else 8)
    finally:
        two.close()
    order = [str(i) for i in range(len(prompts))]
    _assert_same_greedy(dequantized, prompts, [got[0][r] for r in order], [want[0][r] for r in order], "bfloat16")
    _assert_same_logprobs(got, want, bound=0.15 + 2 * fp8_error)
