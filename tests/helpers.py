"""Test helpers shared across the suite (importable as tests.helpers)."""

import contextlib
import json


def sse_events(resp) -> list:
    """The `data:` payloads of a streamed response: parsed JSON events, then "[DONE]"."""
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events

@contextlib.contextmanager
def failing_fill(engine, at: int):
    """The engine's grammar process fails its `at`-th mask fill from now ("injected fill failure";
    the others fill as usual) inside the block; no fill fails after it."""
    engine.grammars.fail_fill_at(at)
    try:
        yield
    finally:
        engine.grammars.fail_fill_at(0)


@contextlib.contextmanager
def slow_compiles(engine, seconds: float, deadline: float):
    """Inside the block, every spec new to the engine's grammar process takes `seconds` longer to
    compile there, under a compile deadline of `deadline` seconds (its own, not the engine's
    config: the API side's deadline is not changed)."""
    proc = engine.grammars
    kept, proc.compile_timeout = proc.compile_timeout, deadline
    proc.slow_compiles(seconds)
    try:
        yield proc
    finally:
        proc.compile_timeout = kept
        proc.slow_compiles(0)


def run_to_end(engine) -> dict:
    """Step the engine until nothing is left: the final output of each request, by id."""
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _train_tokenizer(path, vocab_size: int) -> None:
    """A small byte-level BPE, so tests need no network; saved in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog.", "Return a new list of the items.",
            "naïve café – 東京 🙂", "def f(x):\n    return x * 2\n"] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


def make_checkpoint(path, n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=512, seed=0,
                    safetensors=True, initializer_range=0.2, **extra):
    # initializer_range 0.2, not GPT-2's 0.02: at 0.02 random logits are near-uniform, greedy decoding
    # repeats one token, and a comparison of token sequences would prove little.
    """A random-initialised GPT-2 in Hugging Face format (config, weights, tokenizer) at `path`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    tok = _train_tokenizer(path, vocab_size=min(vocab_size, 400))
    config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions,
                        vocab_size=vocab_size, initializer_range=initializer_range, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **extra)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(path, safe_serialization=safetensors)
    return path


LLAMA_CONFIGS = {  # model_type -> transformers config class name
    "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


# The quantization tests' Llama (tests/models/conftest.py): head_dim 64, 2 KV heads, so that every
# part of the merged QKV is a multiple of the 128-row FP8 blocks
QUANT_LLAMA = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384)
# ... and the one that splits over two ranks (test_quant_shards.py): heads of 128, so that each rank's
# share of q, k, v, gate, up and of o_proj's and down_proj's inputs is whole 128-row blocks and
# 128-column groups; biases on all four attention projections (column- and row-parallel)
QUANT_TP_LLAMA = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      intermediate_size=256, attention_bias=True)


def make_llama_checkpoint(path, model_type="llama", num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
                          vocab_size=512, seed=0, initializer_range=0.2, **extra):
    """A random-initialised Llama-family checkpoint (config, weights, tokenizer) in Hugging Face
    format at `path`, through transformers' own model class of that family."""
    import torch
    import transformers

    torch.manual_seed(seed)
    tok = _train_tokenizer(path, vocab_size=min(vocab_size, 400))
    config = getattr(transformers, LLAMA_CONFIGS[model_type])(
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, hidden_size=hidden_size, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, vocab_size=vocab_size, initializer_range=initializer_range,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if model_type == "qwen3":  # transformers initialises the Q/K norms to ones: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    if getattr(config, "attention_bias", False) or model_type == "qwen2":
        with torch.no_grad():  # biases start at zero: make them matter too
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of a transformers model after `prompt`, EOS ignored. The attention mask is
    explicit: without one, generate masks every prompt token equal to pad_token_id."""
    import torch

    ids = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def bits(t):
    """The raw bits of a 16- or 32-bit float tensor, for bit-for-bit comparisons."""
    import torch

    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def ulps(a, b):
    """|a - b| in units in the last place of their (common) dtype, for finite values: the distance
    between the two values' positions in the ordered sequence of representable numbers."""
    import torch

    def ordered(t):
        i = bits(t).long()
        sign = 1 << (8 * t.element_size() - 1)
        return torch.where(i < 0, -(i + sign), i)  # two's-complement bits of -x, made monotonic
    return (ordered(a) - ordered(b)).abs()


def prefill_logits(model, ids: list[int], dtype=None, caches=None, split: int | None = None):
    """One sequence through a model as a single prefill chunk over a fresh paged cache (or over
    `caches`, from block 0), through the model contract (models/base.py): fp32 logits of every
    position. `split`: two chunks, ids[:split] then the rest, which reads the first's K/V from the
    cache."""
    import torch

    from kvcache import CacheSpec, allocate_kv_cache
    from models import StepRows

    s, n = model.spec, len(ids)
    if caches is None:
        cache = CacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, 16, dtype or torch.float32)
        caches = allocate_kv_cache(cache, -(-n // 16), "cpu")
    table = torch.arange(-(-n // caches[0][0].shape[1]), dtype=torch.int32)[None]
    logits = []
    for lo, hi in ((0, split), (split, n)) if split else ((0, n),):
        m = hi - lo
        rows = StepRows(torch.arange(lo, hi, dtype=torch.int32), m, torch.tensor([0, m], dtype=torch.int32),
                        torch.tensor([lo], dtype=torch.int32), table, [m], [lo])
        hidden = model.forward(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), caches, model.attention.metadata(rows))
        logits.append(model.lm_head(hidden)[:, : model.vocab_size].float())
    return torch.cat(logits)


def run_ranks(target, size: int, args: tuple, reports: int) -> dict:
    """A tensor-parallel group's `size` ranks, each a spawned `target(rank, size, port, *args, out)`
    (they meet at a TCPStore on `port`), and the first `reports` items they put on `out`, by their
    first element (the rest of each item); the test fails if they report fewer or a rank exits
    non-zero. Items are numpy, not tensors: a torch queue shares a tensor's storage through a
    descriptor the rank must outlive, and the ranks exit before the test reads everything."""
    import multiprocessing as mp

    import pytest

    from benchmarks.shared.common import free_port, wait_for_report

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=target, args=(r, size, port, *args, out)) for r in range(size)]
    for p in ranks:
        p.start()
    got, failed = {}, False
    try:
        while len(got) < reports:
            try:
                item = wait_for_report(ranks, out, 300)  # (a rank that fails ends the wait at once)
            except RuntimeError as e:
                failed = True
                pytest.fail(f"the ranks reported {sorted(got)} only: {e}")
            got[item[0]] = item[1:]
    finally:
        for p in ranks:
            p.join(0 if failed else 60)  # after a failure the others may wait in a collective for good
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in ranks] == [0] * size
    return got


def with_chat_template(src, path, template: str):
    """A copy of checkpoint `src` at `path` whose tokenizer has `template` as its chat template and
    adds a BOS itself (as Llama-style tokenizers do), so templates that write one double it."""
    import json
    import shutil

    from tokenizers import Tokenizer, processors

    shutil.copytree(src, path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return path


def openai_client(url: str, timeout: float = 120, http_client=None):
    """The official `openai` client on a server at `url`: no retries, a generous timeout
    (`http_client`: an app_client's TestClient, with url "http://testserver")."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=timeout, http_client=http_client)


@contextlib.contextmanager
def app_client(argv: list[str]):
    """The app `python -m server ARGV --no-engine-process` serves, in this process and without
    uvicorn: its config and limits from the command line's parser, the engine on a thread, requests
    through Starlette's TestClient (base URL http://testserver). For what the API layer does with a
    flag, where a server process would only add seconds of start-up (sockets, processes, signals and
    timeouts are the real servers' tests)."""
    from starlette.testclient import TestClient

    from server.api.app import create_app
    from server.api.guards import ServerLimits
    from server.bridge.async_engine import AsyncEngine
    from server.cli import build_parser, config_from_args
    from server.engine import LLMEngine

    args = build_parser().parse_args(argv)
    limits = ServerLimits.from_args(args)
    engine = AsyncEngine(LLMEngine(config_from_args(args)), max_waiting=limits.max_waiting_requests,
                         request_timeout=limits.request_timeout)
    with TestClient(create_app(engine, limits)) as client:
        yield client


def with_tensors(src, dst, tensors: dict):
    """A copy of checkpoint `src` (one model.safetensors) at `dst` with `tensors` added to its file."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    save_file({**weights, **tensors}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # the fp8 KV cache formats (torch attribute names)


def fp8_cache(cache, fp8_dtype, seed: int = 0):
    """An fp8 copy of a [blocks, block_size, kv_heads, head_dim] cache through the reference quantizer
    (NaN slots stay NaN bytes), with per-head fp32 scales [kv_heads]: each head's largest |value| over
    the format's largest, times a factor in [1, 2) (scales that are not powers of two)."""
    import torch

    from kernels.reference import FP8_MAX, fp8_quantize_ref

    dtype = getattr(torch, fp8_dtype) if isinstance(fp8_dtype, str) else fp8_dtype
    g = torch.Generator().manual_seed(seed)
    amax = cache.float().nan_to_num(0.0).abs().amax(dim=(0, 1, 3)).cpu().clamp(min=1e-3)
    scale = (amax / FP8_MAX[dtype] * (1 + torch.rand(cache.shape[2], generator=g))).to(cache.device)
    return fp8_quantize_ref(cache, scale, dtype), scale
