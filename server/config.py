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

# The server's step token budget (the CLI's default), smaller than an offline engine's: every prefill
# step then fits the largest captured prefill graph (server/worker/cuda_graphs.py), so a step that
# admits prompts while hundreds of requests decode stays short. On the H100 (GPT-2 small, 256
# streaming clients, 4 API processes) it gave ITL p99 7.7 ms and 67.9k tok/s against 18.3 ms and
# 57.1k at 8192. Offline generation, where no one waits on the next token, keeps EngineConfig's
# 8192 (Llama-3.2-1B made 4% more tokens a second with it). vLLM splits its defaults the same way
# (its OpenAI server against its LLM class).
SERVE_MAX_NUM_BATCHED_TOKENS = 2048


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
    async_scheduling: bool = True  # launch step k before step k-1's tokens reach the host
    seed: int = 0
    # Batch-invariant kernels (GEMMs, attention): a request's tokens and logprobs are the same bits
    # whatever else shares its steps (--deterministic / FLASHPAGE_DETERMINISTIC; triton attention only)
    deterministic: bool = False
    log_stats_interval: float = 5.0  # seconds between engine summary log lines while busy; 0 = off
    structured: StructuredLimits = field(default_factory=StructuredLimits)  # bounds on structured-output specs
