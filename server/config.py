"""Engine configuration: one dataclass, and the one home of its defaults.

The CLI (server/cli.py) takes every engine flag's default from here, the engine, scheduler and
worker read their settings from it, and tests build it with only what they change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The CLI's choices, spelled here so that `python -m server --help` need not import torch to list
# them; tests/test_config.py checks them against models.BACKENDS and models.DTYPES.
ATTENTION_BACKENDS = ("triton", "eager", "sdpa")
DTYPE_NAMES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's; fp8 = fp8_e4m3 (kvcache/fp8.py)
LOAD_FORMATS = ("auto", "dummy")  # models.LOAD_FORMATS: the checkpoint's weight files, or random weights at its shape
MAX_TENSOR_PARALLEL_SIZE = 64  # ranks of one tensor-parallel group (one process and one GPU each)
# NVLink SHARP / multicast off in every process of a tensor-parallel group, before NCCL initialises:
# the GPU machines require it (a program using multicast can take a host's shared GPUs out of
# service). Here, not in the worker, so that a peer engine's processes (benchmarks/peers) get it too.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# --quantization's choices (vLLM's names; tests/test_config.py checks them against models.QUANTIZATION_METHODS)
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "awq", "gptq")

# The server's step token budget (the CLI's default), smaller than an offline engine's: every prefill
# step then fits the largest captured prefill graph (server/worker/cuda_graphs.py), so a step that
# admits prompts while hundreds of requests decode stays short. On the H100 (GPT-2 small, 256
# streaming clients, 4 API processes) it gave ITL p99 7.7 ms and 67.9k tok/s against 18.3 ms and
# 57.1k at 8192. Offline generation, where no one waits on the next token, keeps EngineConfig's
# 8192 (Llama-3.2-1B made 4% more tokens a second with it). vLLM splits its defaults the same way
# (its OpenAI server against its LLM class).
SERVE_MAX_NUM_BATCHED_TOKENS = 2048

# Cores the engine process leaves to each API process: its torch intra-op threads are the host's
# cores less this many per API process, at least one (`engine_threads`; OMP_NUM_THREADS, where set,
# wins). torch's default takes every core, so a CPU engine's OpenMP team competed with the API
# processes' event loops for the same cores, and a team waits at every barrier for its slowest
# thread: on a 2-core host beside one API process (and other work: load ~6), a step of 128
# sampled rows took 0.02-0.09 s with one thread and 0.7-12.7 s with two, and a plain completion in
# those steps 0.3 s against 2.7-13.9 s (issue 44, case 8). A GPU engine's few host-side ops lose
# nothing by it.
CORES_PER_API_PROCESS = 1


def engine_threads(api_processes: int, cores: int | None = None) -> int:
    """The engine process's torch intra-op threads beside `api_processes` on a host of `cores` (by
    default the cores this process may run on)."""
    import os

    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - CORES_PER_API_PROCESS * api_processes)


@dataclass(frozen=True)
class StructuredLimits:
    """Bounds on a structured-output spec (a JSON schema, regular expression, EBNF grammar or choice
    list), checked before any compiler sees it (server/engine/grammar_bounds.py), and on its compile,
    which runs in a sacrificial process (server/engine/grammar_compile.py). XGrammar's cost is not
    its input's size: a $ref chain 3,600 deep overflowed its stack (the process died), and a few
    hundred bytes can take it minutes or gigabytes. The field names are the flags' (server/cli.py);
    vLLM has none for these."""

    max_structured_spec_bytes: int = 65536  # the spec's text (a schema as JSON)
    max_structured_depth: int = 128  # objects and arrays inside each other in a schema, $refs followed
    # A count a spec asks for: maxLength, minLength, max/minItems, max/minProperties in a schema; {m,n}
    # in a regular expression or EBNF grammar (maxLength 20,000,000 took XGrammar 1.6 GB)
    max_structured_length: int = 16384
    max_structured_items: int = 4096  # entries of one list in a schema (enum, anyOf, required, ...) or choice
    max_structured_properties: int = 256  # properties of one object (400 optional ones compile for ~5 s)
    max_structured_regex_chars: int = 4096  # a regular expression, or a schema's pattern ("." * 30000: ~30 s)
    structured_compile_timeout: float = 10.0  # seconds a spec may take to compile; then a 400
    # Compiled grammars kept in each process that compiles (its compile processes, the grammar process),
    # least recently used going first: ~20 distinct specs took one from 503 to 1,348 MB
    structured_cache_memory: int = 256 << 20


@dataclass
class EngineConfig:
    model: str | None = None  # local directory or hub id; None = the embedded model
    served_model_name: str | None = None  # None = model (or "flashpage-embedded")
    dtype: str = "auto"  # auto = the checkpoint's fp16/bf16 on CUDA (else float16), float32 on CPU
    device: str | None = None  # None = cuda if available
    attention: str | None = None  # triton | eager | sdpa; None = triton on CUDA, sdpa on CPU
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks; None = from the memory budget
    kv_cache_memory: int | None = None  # bytes for the KV cache; None = from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # on CUDA, the share of GPU memory for weights, activations, KV
    cpu_kv_cache_memory: int = 512 * 2**20  # the KV cache's size on the CPU unless set otherwise
    # The KV cache's storage: auto = the model's dtype; fp8 (= fp8_e4m3) and fp8_e5m2 hold twice the
    # tokens in the same memory (kvcache/fp8.py).
    kv_cache_dtype: str = "auto"
    # fp8_e4m3 without scales in the checkpoint: calibrate them at start-up (server/worker/kv_scales.py);
    # False = scales of 1.0, with a warning
    calculate_kv_scales: bool = True
    max_num_seqs: int = 256  # most sequences in one step
    max_num_batched_tokens: int = 8192  # token budget of one step (offline; the server's: SERVE_MAX_NUM_BATCHED_TOKENS)
    max_model_len: int | None = None  # context limit; None = the model's
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Steps waiting requests may be held back while many others decode, so that prompts arriving
    # together share one prefill (server/engine/scheduler.py); 0 = admit at once.
    max_admit_delay: int = 8
    running_per_admit: int = 64  # hold waiting requests back while fewer than one waits per this many running
    enforce_eager: bool = False  # no CUDA graphs
    # Programmatic dependent launch (kernels/pdl.py; sm_90+): the decode GEMVs start their weight
    # stream in the tail of the kernel before them. Off: measured slower (H200, 2026-11-28, batch-1
    # TPOT on the Llama-3.1-8B shape: FP8_DYNAMIC 3.718 -> 3.856 ms, AWQ 3.531 -> 3.706 ms; the FP8
    # step's profile: 0.046 ms fewer gaps, 0.070 ms more kernel time; its results files under
    # benchmarks/results/experiments/)
    enable_pdl: bool = False
    async_scheduling: bool = True  # launch step k before step k-1's tokens reach the host
    seed: int = 0
    # Batch-invariant kernels (GEMMs, attention): a request's tokens and logprobs are the same bits
    # whatever else shares its steps (--deterministic / FLASHPAGE_DETERMINISTIC; triton attention only)
    deterministic: bool = False
    log_stats_interval: float = 5.0  # seconds between engine summary log lines while busy; 0 = off
    structured: StructuredLimits = field(default_factory=StructuredLimits)  # bounds on structured-output specs
    # Processes (one per GPU: cuda:0..N-1 from --device's index) that each hold 1/N of the model's
    # heads and MLP and run every step together (server/worker/parallel/); 1 = the whole model here
    tensor_parallel_size: int = 1
    # The small all-reduces of tensor parallelism (a decode step's rows) over NCCL, not the one-shot
    # all-reduce over symmetric memory (kernels/one_shot_all_reduce.py; vLLM's flag and default).
    # False: on H200s (2026-11-28) 4.0 us an 8 KB all-reduce against NCCL's 11.2 at two GPUs, 4.4
    # against 14.3 at four, NCCL's tokens at two (tests/gpu/test_gpu_tp.py), the 70B shape's TP=4
    # batch-1 TPOT 13.58 -> 12.25 ms (benchmarks/results/tp_llama-3.1-70b_h200.json)
    disable_custom_all_reduce: bool = False
    load_format: str = "auto"  # auto: the checkpoint's weight files; dummy: random weights at its shape (benchmarks)
    # Quantized weights (models/quant): None = as the checkpoint's config.json says (16-bit, or its
    # quantization_config); "fp8" also quantizes a 16-bit checkpoint at load (--quantization)
    quantization: str | None = None
    # Speculative decoding (--speculative-config; server/engine/spec/): None = off
    speculative_config: SpeculativeConfig | None = None


# Speculative decoding's back-off (server/engine/spec/policy.py), when the JSON does not set them;
# measured on an H100 at the Llama-3.1-8B shape, k = 4 (benchmarks/results/spec_h100.json).
# No sequence speculates while more than SPEC_DISABLE_BY_BATCH_SIZE run (vLLM's `disable_by_batch_size`):
# at 64 clients and a mean accepted length of 3.3, speculating anyway gave 1.15x (n-gram) but 0.79x
# (a 1B draft), and a verify step of k+1 tokens a row costs ever more once the step is compute
# bound; at 8 clients both gain from 2.7 on (n-gram 1.58x, the draft 0.97x at 2.7, 1.31x at 3.3).
# A sequence whose acceptance rate (a moving average over its verifications) falls below the
# method's floor stops proposing for 1, 2, 4, ... up to SPEC_MAX_BACKOFF steps, then tries again:
# n-gram proposals cost a lookup, and verifying them broke even near a quarter accepted (8 clients:
# 1.00x at p = 0.5, where 23% of proposals stood); a draft model's round costs k of its forwards, and
# broke even only near 45% at 8 clients (0.97x at 2.7 tokens a verification), 30% at 1 client.
SPEC_DISABLE_BY_BATCH_SIZE = 32
SPEC_MIN_ACCEPTANCE = 0.25  # ngram
SPEC_MIN_ACCEPTANCE_DRAFT = 0.4  # draft_model
# eagle3: a head's round is k forwards of one decoder layer (about a thirtieth of an 8B target's step
# each, in CUDA graphs), nearer the lookup's cost than a draft model's: n-gram's floor. Not measured yet.
SPEC_MIN_ACCEPTANCE_EAGLE3 = SPEC_MIN_ACCEPTANCE
SPEC_MAX_BACKOFF = 64
SPEC_METHODS = ("ngram", "draft_model", "eagle3")
SPEC_FLOORS = {"ngram": SPEC_MIN_ACCEPTANCE, "draft_model": SPEC_MIN_ACCEPTANCE_DRAFT,
               "eagle3": SPEC_MIN_ACCEPTANCE_EAGLE3}  # each method's default min_acceptance
# Which back-off rule (policy.py, the speculative config's `backoff`): per_sequence (the floor above)
# or batch (one decision a step for the whole batch, from the cost model below). batch for the
# model-based methods: replayed at the measured points (1 / 8 clients at p = 0 / 0.5 / 0.7 / 0.8 / 0.9,
# 64 / 256 at 0.8), its mean over 20 oracle seeds is never below per_sequence's, and it lifts 8 clients
# at p = 0.5 / 0.7 from 0.62x / 0.77x to 0.92x / 1.08x (draft) and 0.86x / 1.38x to 0.97x / 1.48x
# (EAGLE-3), an estimate (benchmarks/results/experiments/spec_policy_replay_estimate_h100.json) that
# the H100 then measured (spec_draft_model_eagle3_policies_h100.json, 8 clients): the draft 0.60x ->
# 0.93x at p = 0.5 and 1.11x -> 1.32x at 0.8, EAGLE-3 0.79x -> 0.93x at 0.5 and 1.90x either way at
# 0.8; 1 client alike; at 256 clients speculation is off above 32 running (15-17 verifications a
# rule), and the 0.92x rows there (the draft per_sequence, EAGLE-3 batch) are not the rules' doing.
# n-gram keeps per_sequence (the replay favours batch for it too, except 0.98x against 0.983x at 1
# client, p = 0).
SPEC_BACKOFFS = ("per_sequence", "batch")
SPEC_BACKOFF = {"ngram": "per_sequence", "draft_model": "batch", "eagle3": "batch"}
# The batch rule's cost model, in plain decode steps of one row (6.31 ms at the Llama-3.1-8B shape,
# k = 4, H100). Fitted to the wall times of the 51 rows of spec_h100.json and spec_eagle3_h100.json,
# each replayed step by step with the oracle's draws (the replay reproduces every row's
# verification count; benchmarks/engine/replay_spec_policy.py): plain steps of 6.31 / 6.71 / 8.55 /
# 17.85 ms at 1 / 8 / 64 / 256 rows (the "off" rows), and a speculating step adds 1.14 ms (its
# synchronous scheduling, the verification's fixed cost) + 0.035 ms a verified proposal, plus a
# round of the 1B-shaped draft 6.02 ms (+ 0 a row) or of the EAGLE-3 head 1.66 ms + 0.0275 ms a
# row; the fitted walls are within 8% of the measured, most within 3%.
SPEC_COST_PLAIN_ROW = 0.0057  # (8.55 - 6.31) ms over 63 rows
SPEC_COST_POSITION = 0.006  # 0.035 ms (+ the head's 0.0275 ms a row over k = 4)
# A round's fixed cost (the speculative config's `round_cost`: a draft much smaller against its
# target than 1B against 8B costs less): n-gram 1.14 ms, a draft model (1.14 + 6.02) ms, EAGLE-3
# (1.14 + 1.66) ms
SPEC_ROUND_COST = {"ngram": 0.18, "draft_model": 1.14, "eagle3": 0.44}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config keys (a JSON object), checked by `parse`."""

    method: str  # ngram | draft_model | eagle3
    num_speculative_tokens: int  # proposals verified per step and sequence (k: up to k + 1 tokens a step)
    # draft_model: the draft checkpoint (a registered family, the target's tokenizer); eagle3: the
    # EAGLE-3 head's (models/eagle3.py)
    model: str | None = None
    prompt_lookup_min: int | None = None  # ngram: shortest suffix looked up
    prompt_lookup_max: int | None = None  # ngram: longest
    disable_by_batch_size: int = SPEC_DISABLE_BY_BATCH_SIZE
    min_acceptance: float = SPEC_MIN_ACCEPTANCE  # flashpage's: the per-sequence back-off's floor (by method)
    backoff: str = "per_sequence"  # flashpage's: per_sequence | batch (by method: SPEC_BACKOFF)
    round_cost: float = SPEC_ROUND_COST["ngram"]  # flashpage's: the batch rule's round cost (by method)
    # under --tensor-parallel-size: the draft's (model or EAGLE-3 head) runs whole on rank 0
    # (server/worker/spec/parallel.py); vLLM's key, 1 the only value taken
    draft_tensor_parallel_size: int = 1
    # draft_model: the draft's --quantization (vLLM's key): "fp8" quantizes a 16-bit draft at load
    # (half its bytes a proposal step); a quantized draft checkpoint's own format is read without it
    quantization: str | None = None

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """The JSON object, as vLLM reads it: `method` may be left out when `model` names a draft
        ("ngram" or "[ngram]" as the model name the n-gram method); ngram's lookup bounds default
        to each other, or to 5 both. ValueError says what is wrong."""
        import json

        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("must be a JSON object, e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; known: {sorted(known)}")
        method, model = d.get("method"), d.get("model")
        if model in ("ngram", "[ngram]"):
            method, model = method or "ngram", None
        if method is None:
            method = "draft_model" if model is not None else None
        if method == "eagle":
            raise ValueError("method 'eagle' (EAGLE-1 heads) is not supported; EAGLE-3 heads are: "
                             "{\"method\": \"eagle3\", \"model\": DIR, \"num_speculative_tokens\": k}")
        if method in ("medusa", "mlp_speculator", "suffix", "mtp"):
            raise ValueError(f"method {method!r} is not supported; supported: {list(SPEC_METHODS)}")
        if method not in SPEC_METHODS:
            raise ValueError(f"method must be one of {list(SPEC_METHODS)} (or give a draft `model`), got {method!r}")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer from 1 to 16, got {k!r}")
        if method == "draft_model" and not (isinstance(model, str) and model.strip()):
            raise ValueError("draft_model needs `model`: the draft checkpoint's directory or hub id")
        if method == "eagle3" and not (isinstance(model, str) and model.strip()):
            raise ValueError("eagle3 needs `model`: the EAGLE-3 head's directory or hub id")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if method == "ngram":
            lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        elif lo is not None or hi is not None:
            raise ValueError("prompt_lookup_min/max belong to the ngram method")
        batch = d.get("disable_by_batch_size", SPEC_DISABLE_BY_BATCH_SIZE)
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"disable_by_batch_size must be an integer >= 1, got {batch!r}")
        floor = d.get("min_acceptance", SPEC_FLOORS[method])
        if not isinstance(floor, (int, float)) or isinstance(floor, bool) or not 0 <= floor <= 1:
            raise ValueError(f"min_acceptance must be a number from 0 to 1, got {floor!r}")
        backoff = d.get("backoff", SPEC_BACKOFF[method])
        if backoff not in SPEC_BACKOFFS:
            raise ValueError(f"backoff must be one of {list(SPEC_BACKOFFS)}, got {backoff!r}")
        cost = d.get("round_cost", SPEC_ROUND_COST[method])
        if not isinstance(cost, (int, float)) or isinstance(cost, bool) or not 0 <= cost <= 100:
            raise ValueError(f"round_cost must be a number from 0 to 100 (plain decode steps), got {cost!r}")
        draft_tp = d.get("draft_tensor_parallel_size", 1)
        if draft_tp != 1 or isinstance(draft_tp, bool):
            raise ValueError(f"draft_tensor_parallel_size must be 1, got {draft_tp!r}: flashpage runs the draft whole "
                             "on the first GPU of a tensor-parallel group (a sharded draft is not supported)")
        quantization = d.get("quantization")
        if quantization is not None and method != "draft_model":
            raise ValueError(f"quantization belongs to the draft_model method (its draft's weights), not {method}")
        if quantization is not None and quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, got {quantization!r}")
        return cls(method, k, model, lo, hi, batch, float(floor), backoff, float(cost), quantization=quantization)
