"""Offline throughput through the engine's Python API (no HTTP), and decode-step time per batch size.

Same N requests (random token ids, random input/output lengths, ignore_eos) through:
  flashpage        our engine, --attention triton, CUDA graphs
  flashpage_eager  our engine, --attention eager (same scheduler, batching and graphs; GPT-2 only by default)
  hf_eager         transformers generate, attn_implementation="eager", left-padded static batches
  hf_sdpa          the same with attn_implementation="sdpa" (Llama-family models by default)
and decode steps of our engine at several batch sizes against the floor
(weight bytes + K/V bytes read) / measured copy bandwidth. `--family` picks the model: GPT-2 small
(float16) or a Llama-family model at its published shape (bf16), random weights either way.
`--protocol nano-vllm` runs nano-vllm's published benchmark instead (its bench.py: 256 requests,
prompts of 100-1024 token ids below 10,000, 100-1024 output tokens each, temperature 0.6,
ignore_eos; output tokens over wall time), our engine only, so readers can place us beside the
figures published for it.

  python -m benchmarks.engine.bench_throughput --out-dir benchmarks/results
  python -m benchmarks.engine.bench_throughput --family llama-3.2-1b --out-dir benchmarks/results
  python -m benchmarks.engine.bench_throughput --family qwen3-0.6b --protocol nano-vllm --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.shared.checkpoint import LLAMA_SHAPES, make_random_gpt2, make_random_llama  # noqa: E402
from benchmarks.shared.common import gpu_run_info, write_result  # noqa: E402
from server.config import EngineConfig  # noqa: E402
from server.engine import LLMEngine  # noqa: E402
from server.sampling_params import SamplingParams  # noqa: E402


def workload(n: int, in_range, out_range, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    outs = [rng.randint(*out_range) for _ in range(n)]
    return prompts, outs


def run_engine(engine: LLMEngine, prompts, outs, temperature: float = 0.0) -> tuple[float, int, dict]:
    params = [SamplingParams(max_tokens=o, temperature=temperature, ignore_eos=True) for o in outs]
    engine.generate(prompts[:4], params[:4])  # warm-up (prefill shapes, sampling)
    # Where the time goes: host time launching steps (scheduling excluded), time blocked waiting
    # for the device, and everything else on the host (scheduling, detokenization, stop checks).
    split = {"steps": 0, "prefill_steps": 0, "launch_s": 0.0, "wait_s": 0.0}
    runner = engine.runner
    launch, collect = runner.launch, runner.collect

    def timed_launch(prefills, decodes, verifies=None):
        t = time.perf_counter()
        out = launch(prefills, decodes, verifies)
        split["launch_s"] += time.perf_counter() - t
        split["steps"] += 1
        split["prefill_steps"] += bool(prefills)
        return out

    def timed_collect(handle):
        t = time.perf_counter()
        out = collect(handle)
        split["wait_s"] += time.perf_counter() - t
        return out

    runner.launch, runner.collect = timed_launch, timed_collect
    if torch.cuda.is_available():  # (the CPU test of this timer has none)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    runner.launch, runner.collect = launch, collect
    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == sum(outs), "engine produced a different token count than asked"
    split["host_other_s"] = dt - split["launch_s"] - split["wait_s"]
    return dt, tokens, {k: round(v, 3) for k, v in split.items()}


def run_hf(path, prompts, outs, batch: int, attn: str, dtype: torch.dtype) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype).cuda().eval()

    def one_batch(ps, os_):
        width = max(len(p) for p in ps)
        ids = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(ps):  # left padding, as generate expects for decoder-only models
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(os_)
        with torch.no_grad():
            model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)

    one_batch(prompts[:2], [4, 4])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        one_batch(prompts[i:i + batch], outs[i:i + batch])
    torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(outs)  # only the tokens each request asked for count


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n / ms / 1e9  # TB/s


def decode_steps(engine: LLMEngine, batches, context: int, copy_tbps: float, vocab: int):
    from triton.testing import do_bench

    spec, model = engine.spec, engine.runner.model
    elem = next(model.parameters()).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * elem
    rows = []
    rng = random.Random(1)
    for b in batches:
        ids = [f"step-{b}-{i}" for i in range(b)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(vocab) for _ in range(context)],
                               SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True))
        while any(engine.seqs[r].num_computed < context for r in ids):
            engine.step()  # prefill everyone; afterwards each step is a pure decode of b sequences
        batch = engine.scheduler.schedule()
        assert not batch.prefills and len(batch.decodes) == b
        ms = do_bench(lambda: engine.runner.collect(engine.runner.launch(batch.prefills, batch.decodes)),
                      return_mode="median")
        graphs = engine.runner.graphs
        size = next(s for s in graphs.sizes if s >= b) if graphs is not None else None
        # The device alone: replaying the step's CUDA graph, no host work, no sampling.
        graph_ms = do_bench(graphs.graphs[size][0].replay, return_mode="median") if size else None
        # The whole engine step too (scheduler, runner, sampling, detokenization), over real steps.
        # (The timed batch was never committed, so the next step schedules the same tokens again.)
        t0 = time.perf_counter()
        steps = 32  # steady state: with asynchronous scheduling, host work overlaps the device
        for _ in range(steps):
            engine.step()
        step_ms = (time.perf_counter() - t0) / steps * 1e3
        kv_bytes = b * (context + 1) * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * elem
        floor_ms = (weight_bytes + kv_bytes) / (copy_tbps * 1e12) * 1e3
        rows.append(dict(impl="flashpage_step", batch=b, context=context, step_ms=round(ms, 4),
                         engine_step_ms=round(step_ms, 4), graph_ms=round(graph_ms, 4) if graph_ms else None,
                         floor_ms=round(floor_ms, 4),
                         ratio_to_floor=round(ms / floor_ms, 2), weight_bytes=weight_bytes, kv_bytes=kv_bytes))
        print(f"decode step batch {b:4d} ctx {context}: {ms:.3f} ms (engine step {step_ms:.3f} ms, "
              f"graph {graph_ms or 0:.3f} ms), "
              f"floor {floor_ms:.3f} ms", flush=True)
        for rid in ids:
            engine.abort_request(rid)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: random weights of --family)")
    ap.add_argument("--family", default="gpt2-small", choices=["gpt2-small", *LLAMA_SHAPES])
    ap.add_argument("--hf-attn", nargs="+", default=None, choices=["eager", "sdpa"],
                    help="transformers attention implementations to compare (default: eager for GPT-2, eager "
                         "and sdpa for the Llama family)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=[128, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[128, 512])
    ap.add_argument("--hf-batch", type=int, default=256, help="requests per transformers generate call")
    ap.add_argument("--repeats", type=int, default=5, help="runs of our engine's workload; the median is reported")
    ap.add_argument("--step-batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--step-context", type=int, default=512)
    ap.add_argument("--skip", nargs="*", default=None,
                    choices=["flashpage", "flashpage_eager", "hf_eager", "hf_sdpa", "steps"],
                    help="(default: none for GPT-2, flashpage_eager for the Llama family)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                    help="the engine's token budget per step (server/config.py)")
    ap.add_argument("--max-token-id", type=int, default=None, help="prompt ids below this (default: the vocabulary)")
    ap.add_argument("--protocol", choices=["nano-vllm"], default=None,
                    help="nano-vllm's benchmark: sets the workload and sampling flags above, our engine only")
    ap.add_argument("--deterministic", action="store_true",
                    help="also run the engine in its deterministic mode (flashpage_deterministic), same workload")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    if args.protocol == "nano-vllm":  # nano-vllm's bench.py, as published
        args.num_requests, args.input_len, args.output_len = 256, [100, 1024], [100, 1024]
        args.temperature, args.max_token_id = 0.6, 10_000
        args.skip = ["flashpage_eager", "hf_eager", "hf_sdpa", "steps"]

    gpt2 = args.family == "gpt2-small"
    skip = args.skip if args.skip is not None else ([] if gpt2 else ["flashpage_eager"])
    hf_attn = args.hf_attn or (["eager"] if gpt2 else ["eager", "sdpa"])
    dtype = "float16" if gpt2 else "bfloat16"
    work = tempfile.mkdtemp(prefix=f"{args.family}-")
    path = args.model or (make_random_gpt2(work, "small") if gpt2 else make_random_llama(work, args.family))
    from models import ModelSpec, load_config

    spec = ModelSpec.from_hf_config(load_config(Path(path)))
    vocab = spec.vocab_size
    # The workload's longest request, with room: Llama-family contexts (128k) would size graphs for nothing.
    max_model_len = min(spec.max_position_embeddings, 4096)
    prompts, outs = workload(args.num_requests, args.input_len, args.output_len,
                             min(vocab, args.max_token_id or vocab), seed=0)
    copy_tbps = copy_bandwidth()
    print(f"copy bandwidth {copy_tbps:.2f} TB/s", flush=True)
    rows = [dict(impl="copy", tbps=round(copy_tbps, 3))]

    impls = (("flashpage", "triton", False), ("flashpage_deterministic", "triton", True),
             ("flashpage_eager", "eager", False))
    for impl, attention, deterministic in impls:
        if impl in skip or (deterministic and not args.deterministic):
            continue
        # No prefix caching: the workload is random ids with nothing to share, and repeated runs of
        # the same requests must not find their prompts cached.
        engine = LLMEngine(EngineConfig(model=str(path), attention=attention, dtype=dtype, max_model_len=max_model_len,
                                        enable_prefix_caching=False, max_num_batched_tokens=args.max_num_batched_tokens,
                                        deterministic=deterministic))
        gc.collect()
        gc.freeze()  # as `python -m server` does after start-up: no full collection walks the start-up heap
        # One run is about a second of host-bound work, whose time varies by +-10% from run to run on
        # the same machine: the figure is the median of --repeats runs (all of them kept).
        runs = [run_engine(engine, prompts, outs, args.temperature)
                for _ in range(args.repeats if attention == "triton" else 1)]
        dt, tokens, split = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        rows.append(dict(impl=impl, requests=len(prompts), output_tokens=tokens, seconds=round(dt, 3),
                         output_tokens_per_s=round(tokens / dt, 1), time_split=split,
                         runs_tokens_per_s=[round(t / d, 1) for d, t, _ in runs]))
        print(f"{impl:16s} {tokens / dt:10.1f} output tok/s ({dt:.2f} s, median of {len(runs)}) {split}", flush=True)
        if attention == "triton" and "steps" not in skip:
            rows += [dict(r, mode="deterministic" if deterministic else "default")
                     for r in decode_steps(engine, args.step_batches, args.step_context, copy_tbps, vocab)]
        engine.close()
        del engine
        gc.unfreeze()
    for attn in hf_attn:
        impl = f"hf_{attn}"
        if impl in skip:
            continue
        dt, tokens = run_hf(path, prompts, outs, args.hf_batch, attn, getattr(torch, dtype))
        rows.append(dict(impl=impl, requests=len(prompts), output_tokens=tokens, seconds=round(dt, 3),
                         output_tokens_per_s=round(tokens / dt, 1), hf_batch=args.hf_batch))
        print(f"{impl:16s} {tokens / dt:10.1f} output tok/s ({dt:.2f} s)", flush=True)
        gc.collect()
        torch.cuda.empty_cache()

    result = dict(gpu_run_info("benchmarks.engine.bench_throughput", argv),
                  workload=dict(num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
                                temperature=args.temperature, protocol=args.protocol,
                                model=args.model or ("random-initialised GPT-2 small (124M), float16" if gpt2 else
                                                     f"random-initialised {args.family} shape ({spec.num_layers} layers, "
                                                     f"{spec.num_heads}/{spec.num_kv_heads} heads x {spec.head_dim}, "
                                                     f"vocab {spec.vocab_size}), bfloat16")),
                  rows=rows)
    name = ("throughput_gpt2" if gpt2 else f"throughput_{args.family}") + ("_deterministic" if args.deterministic else "")
    write_result(result, args.out_dir, f"nanovllm_{args.family}" if args.protocol else name)
    print(report(result))
    return result


# nano-vllm's README, for placement only (other hardware): Qwen3-0.6B on an RTX 4070 Laptop GPU
# (8 GB), 133,966 output tokens.
NANO_VLLM_PUBLISHED = "nano-vllm 1,434 output tok/s and vLLM 1,362 (Qwen3-0.6B, RTX 4070 Laptop GPU, 8 GB)"


def summary(result: dict) -> str:
    """One cell for docs/benchmarks.md's table of runs: each engine's output tokens/s."""
    return ", ".join(f"{r['impl']} {r['output_tokens_per_s']:,.0f}" for r in result["rows"]
                     if r.get("output_tokens_per_s")) + " tok/s"


def report(result: dict) -> str:
    rows = result["rows"]
    tput = {r["impl"]: r for r in rows if "output_tokens_per_s" in r}
    protocol = result["workload"].get("protocol")
    lines = [f"Offline throughput{f' ({protocol} protocol)' if protocol else ''}, "
             f"{result['workload']['num_requests']} requests, inputs "
             f"{result['workload']['input_len'][0]}–{result['workload']['input_len'][1]}, outputs "
             f"{result['workload']['output_len'][0]}–{result['workload']['output_len'][1]} tokens, "
             f"temperature {result['workload'].get('temperature', 0.0)}, "
             f"{result['workload']['model']}, {result['device']}:", "",
             "| engine | output tokens/s | vs hf_eager | runs (tokens/s) |", "|---|---:|---:|---|"]
    base = tput.get("hf_eager", {}).get("output_tokens_per_s")
    for impl in ("flashpage", "flashpage_deterministic", "flashpage_eager", "hf_eager", "hf_sdpa"):
        if impl in tput:
            v = tput[impl]["output_tokens_per_s"]
            runs = tput[impl].get("runs_tokens_per_s") or []
            spread = f"median of {len(runs)}: {min(runs):,.0f}–{max(runs):,.0f}" if len(runs) > 1 else ""
            lines.append(f"| {impl} | {v:,.0f} | {v / base:.1f}× | {spread} |" if base else
                         f"| {impl} | {v:,.0f} | | {spread} |")
    if protocol == "nano-vllm":
        lines += ["", f"Published with this protocol on other hardware, for placement only: {NANO_VLLM_PUBLISHED}."]
    steps = [r for r in rows if r["impl"] == "flashpage_step" and r.get("mode", "default") == "default"]
    det = {r["batch"]: r for r in rows if r["impl"] == "flashpage_step" and r.get("mode") == "deterministic"}
    if det and "flashpage_deterministic" in tput:
        ratio = tput["flashpage_deterministic"]["output_tokens_per_s"] / tput["flashpage"]["output_tokens_per_s"]
        lines += ["", f"Deterministic mode (`--deterministic`): {ratio:.0%} of the default's output tokens/s. "
                  "Decode step (CUDA graph alone, ms), default vs deterministic:", "",
                  "| batch | context | default | deterministic | ratio |", "|---:|---:|---:|---:|---:|"]
        for r in steps:
            d = det.get(r["batch"])
            if d and r.get("graph_ms") and d.get("graph_ms"):
                lines.append(f"| {r['batch']} | {r['context']} | {r['graph_ms']:.3f} | {d['graph_ms']:.3f} | "
                             f"{d['graph_ms'] / r['graph_ms']:.2f}× |")
    if steps:
        lines += ["", "Decode step against the floor (weights + K/V read) / copy bandwidth. *graph*: the "
                  "step's CUDA graph replayed alone (device time); *step*: one step launched and waited "
                  "for (graph + sampling + host preparation, no overlap); *engine step*: steady-state time "
                  "per `LLMEngine.step()` with asynchronous scheduling (host work of one step overlaps the "
                  "device work of the next).", "",
                  "| batch | context | graph ms | step ms | engine step ms | floor ms | engine step / floor |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in steps:
            g = f"{r['graph_ms']:.3f}" if r.get("graph_ms") else "–"
            lines.append(f"| {r['batch']} | {r['context']} | {g} | {r['step_ms']:.3f} | {r['engine_step_ms']:.3f} | "
                         f"{r['floor_ms']:.3f} | {r['engine_step_ms'] / r['floor_ms']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
