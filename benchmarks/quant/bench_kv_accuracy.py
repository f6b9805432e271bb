"""Accuracy of an fp8 KV cache (--kv-cache-dtype) against the 16-bit cache, on the CPU.

perplexity  The embedded model (float16, as a GPU serves it; sdpa attention) scores the held-out
            docstrings of its own corpus (tools/embedded: the Python standard library's docstrings and
            comments, the 5% validation split by document, seed 1234; rebuilt here from this
            interpreter's stdlib, whose corpus hash the model card gives) through prompt_logprobs, at a
            step budget of --chunk tokens: every chunk after a document's first reads the earlier ones
            from the cache. Perplexity per cache dtype (the float16 cache, fp8 = e4m3 with the scales
            calibrated at start-up, fp8_e5m2, and a float32 model for scale); goal: fp8 within 1% of
            the 16-bit cache's.
kl          Random Llama-family checkpoints (GQA and MQA, head 64 and 128; benchmarks/shared/checkpoint.py),
            bfloat16, initialised at KL_INITS: each held-out document prefilled in chunks of --chunk
            tokens over the engine's own cache (the server's scales), the next-token distribution at
            every position against the 16-bit cache's: KL(16-bit || fp8) mean, p99 and max, top-1
            agreement, and the 16-bit distribution's entropy. Random weights bracket what a trained
            model does: near-uniform distributions at one scale, attention that rounding can tip
            from one key to another at the other (KL_INITS).

  python -m benchmarks.quant.bench_kv_accuracy --out-dir benchmarks/results

Writes kv_accuracy_cpu.json; report(result) renders its table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.shared.checkpoint import make_random_llama
from models import EMBEDDED_MODEL
from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams
from server.worker.warmup import prefill_rows

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "embedded"
CORPUS_SHA256 = "69d9c6d0"  # the model card's corpus hash (first hex digits), Python 3.11.7's stdlib
CACHES = ("auto", "fp8", "fp8_e5m2")
# Random weights at two scales: transformers' 0.02 gives near-uniform next-token distributions at
# these widths (entropy 8.9 of 9.0 nats) and mild attention; 0.1 gives logits a trained model's spread
# but attention scores of std ~5 (one key takes nearly all the weight, and which one is a near-tie
# that rounding flips), except where QK norms bound them (qwen3).
KL_INITS = (0.02, 0.1)
# Llama-family shapes at a CPU's size: what differs between them is what the cache's layout sees.
KL_MODELS = {
    "llama GQA 8/2 d64": dict(model_type="llama", num_hidden_layers=4, hidden_size=512, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=64, intermediate_size=1024),
    "mistral MQA 4/1 d128": dict(model_type="mistral", num_hidden_layers=4, hidden_size=512, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=128, intermediate_size=1024, sliding_window=None),
    "qwen2 GQA 8/2 d128": dict(model_type="qwen2", num_hidden_layers=4, hidden_size=1024, num_attention_heads=8,
                               num_key_value_heads=2, intermediate_size=2048),
    "qwen3 GQA 8/4 d128": dict(model_type="qwen3", num_hidden_layers=4, hidden_size=512, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=128, intermediate_size=1024),
}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def held_out_documents(work: Path) -> tuple[list[list[int]], dict]:
    """The embedded model's validation documents as token ids (each ending in <|endoftext|>), rebuilt
    by its own scripts, and their data.meta.json."""
    _load("build_corpus").main(["--out", str(work / "corpus.txt")])
    _load("prepare_data").main(["--corpus", str(work / "corpus.txt"), "--tokenizer", str(EMBEDDED_MODEL),
                                "--out-dir", str(work)])
    meta = json.loads((work / "data.meta.json").read_text())
    stream = np.fromfile(work / "val.bin", dtype=np.uint16).astype(np.int64)
    ends = np.flatnonzero(stream == meta["eot_id"])
    docs = [stream[a + 1 : b + 1].tolist() for a, b in zip(np.concatenate([[-1], ends[:-1]]), ends)]
    return docs, meta


def perplexity(docs: list[list[int]], kv_cache_dtype: str, dtype: str, chunk: int) -> dict:
    """Every document after <|endoftext|> (the training stream's separator), scored by prompt_logprobs."""
    engine = LLMEngine(EngineConfig(dtype=dtype, device="cpu", attention="sdpa", kv_cache_dtype=kv_cache_dtype,
                                    max_num_batched_tokens=chunk, max_num_seqs=32, enable_prefix_caching=False,
                                    num_blocks=4096))
    limit = engine.max_model_len - 1
    prompts = [[0] + d[:limit] for d in docs]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    nll = [-lp[0][1] for o in outs for lp in o.prompt_logprobs[1:]]
    engine.runner.close()
    return {"impl": "perplexity", "kv_cache_dtype": kv_cache_dtype, "dtype": dtype, "tokens": len(nll),
            "perplexity": math.exp(sum(nll) / len(nll)), "seconds": time.perf_counter() - t0}


@torch.inference_mode()
def chunked_logits(engine: LLMEngine, ids: list[int], chunk: int) -> torch.Tensor:
    """fp32 logits of every position of `ids`, prefilled in `chunk`-token chunks over the engine's own
    cache (blocks 0, 1, ... in order; nothing else runs): each chunk reads the earlier ones from it."""
    runner, out = engine.runner, []
    blocks = np.arange(-(-len(ids) // runner.block_size))[None]
    for start in range(0, len(ids), chunk):
        pos = np.arange(start, min(start + chunk, len(ids)))
        tokens, positions, rows = prefill_rows(runner, pos, [len(pos)], [start], blocks, ids=np.asarray(ids)[pos],
                                               slots=pos)
        hidden = runner.forward(runner.kv_caches, tokens, positions, rows)
        out.append(runner.model.lm_head(hidden)[:, : runner.model.vocab_size].float())
    return torch.cat(out)


def kl_divergence(path: Path, docs: list[list[int]], chunk: int) -> dict:
    """KL(16-bit || fp8) of the next-token distributions at every position of every document."""
    logits = {}
    scales = ""
    for kv in ("auto", "fp8"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", device="cpu", attention="sdpa",
                                        kv_cache_dtype=kv, num_blocks=64))
        logits[kv] = [chunked_logits(engine, d, chunk) for d in docs]
        if kv != "auto":
            k = engine.runner.kv_caches[0][0].scale
            scales = f"{k.min().item():.3g}..{k.max().item():.3g}"
        engine.runner.close()
    p16 = torch.cat(logits["auto"]).log_softmax(-1)
    p8 = torch.cat(logits["fp8"]).log_softmax(-1)
    kl = (p16.exp() * (p16 - p8)).sum(-1)
    entropy = -(p16.exp() * p16).sum(-1)
    return {"impl": "kl", "positions": len(kl), "kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
            "kl_max": kl.max().item(), "top1_agree": (p16.argmax(-1) == p8.argmax(-1)).float().mean().item(),
            "entropy_mean": entropy.mean().item(), "k_scale_layer0": scales}


def report(result: dict) -> str:
    ppl = [r for r in result["rows"] if r["impl"] == "perplexity"]
    lines = [f"Through the sdpa backend on the CPU (the same cache bytes the Triton kernels write and read; "
             f"tests/kernels matches the kernels to the reference over them), prefill in {result['chunk']}-token "
             f"steps. Perplexity of the held-out split's first documents ({ppl[0]['tokens']} tokens "
             f"of its {result['held_out']['tokens']}):", "",
             "| model | cache | tokens | perplexity | vs 16-bit cache |", "|---|---|---:|---:|---:|"]
    base = next(r["perplexity"] for r in ppl if r["kv_cache_dtype"] == "auto" and r["dtype"] == "float16")
    for r in ppl:
        lines.append(f"| embedded ({r['dtype']}) | {r['kv_cache_dtype']} | {r['tokens']} | {r['perplexity']:.4f} | "
                     f"{r['perplexity'] / base - 1:+.2%} |")
    lines += ["", "| random checkpoint (bf16) | positions | KL mean | KL p99 | KL max | top-1 agree | entropy |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in result["rows"] if r["impl"] == "kl"):
        lines.append(f"| {r['model']} | {r['positions']} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} | {r['kl_max']:.2e} | "
                     f"{r['top1_agree']:.2%} | {r['entropy_mean']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--chunk", type=int, default=16, help="prefill tokens a step (perplexity) or a chunk (kl)")
    ap.add_argument("--documents", type=int, default=160,
                    help="held-out documents to score, in the split's order (0: all 740; ~2 h on 2 CPU cores)")
    ap.add_argument("--kl-documents", type=int, default=12, help="documents (>= 64 tokens, first 256) per checkpoint")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        docs, meta = held_out_documents(work)
        if not meta["corpus_sha256"].startswith(CORPUS_SHA256):
            print(f"warning: this interpreter's stdlib gives corpus {meta['corpus_sha256'][:8]}, the model card's is "
                  f"{CORPUS_SHA256}: the held-out split is not the one the model was trained without", flush=True)
        scored = docs[: args.documents or None]
        ppl = []
        for kv, dtype in [(kv, "float16") for kv in CACHES] + [("auto", "float32")]:
            ppl.append(perplexity(scored, kv, dtype, args.chunk))
            print(json.dumps(ppl[-1]), flush=True)
        kl_docs = [d[:256] for d in docs if len(d) >= 64][: args.kl_documents]
        kl = []
        for init in KL_INITS:
            for i, (name, fields) in enumerate(KL_MODELS.items()):
                path = make_random_llama(work / f"kl{i}-{init}", dict(fields, vocab_size=8192, tie_word_embeddings=False,
                                                                      max_position_embeddings=2048,
                                                                      initializer_range=init), seed=i)
                kl.append(dict(model=f"{name}, init {init}", **kl_divergence(path, kl_docs, args.chunk)))
                print(json.dumps(kl[-1]), flush=True)
    import triton

    result = dict(device="cpu", torch=torch.__version__.split("+")[0], triton=triton.__version__,
                  date=datetime.date.today().isoformat(),
                  command="python -m benchmarks.quant.bench_kv_accuracy " + " ".join(argv if argv is not None else sys.argv[1:]),
                  python=sys.version.split()[0], corpus_sha256=meta["corpus_sha256"], held_out=meta["val"],
                  chunk=args.chunk, documents=len(scored), kl_documents=len(kl_docs), rows=ppl + kl)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_accuracy_cpu.json").write_text(json.dumps(result, indent=1))
    print(report(result))
    return result


if __name__ == "__main__":
    main()
