"""Batch invariance: does a request's output depend on what else is in the batch, and what does
`--deterministic` (FLASHPAGE_DETERMINISTIC=1) cost?

    python -m benchmarks.engine.bench_determinism                                 # GPT-2 small shape, both modes
    python -m benchmarks.engine.bench_determinism --modes deterministic --merge   # one mode, added to the file
    python -m benchmarks.engine.bench_determinism --quick                         # CPU smoke run, embedded model

Per mode, one server (`python -m server --model CKPT --max-num-batched-tokens 512 [--deterministic]`):
- probes: `--copies` copies of each of `--prompts` random-id prompts (half share a long prefix, so
  prompts hit each other's cached blocks; every copy after the first hits its own), spread over
  phases: strictly alone (one at a time), then one phase per `--background` level with that many
  background clients (random lengths, some with the shared prefix, greedy or sampled, logprobs or
  not) kept in flight while the probes go out shuffled, `--probe-concurrency` at a time. The small
  step budget chunks long prompts, so chunk boundaries move with the traffic. A probe is one
  /v1/completions request (greedy, or every `--seeded-every`-th one temperature 1 with a fixed
  per-prompt seed), logprobs 1, ignore_eos; its output (token strings, logprobs, top alternatives,
  text) is compared exactly, floats by repr. The route gives token strings, not ids: two ids that
  decode alike would count as one output only if every logprob also agreed bitwise.
- throughput: benchmarks/load_test.run_load (closed loop, streaming /generate, greedy, ignore_eos)
  at each `--concurrency`, prompts 512 +- 128 tokens, outputs 256 +- 64: output tok/s (on the same
  server, so under the same step budget; raise it with --max-num-batched-tokens for both parts).
- batch-1 decode step: run_load with one client, 128-token prompts, long outputs: median TPOT.
Writes <out-dir>/determinism_<gpu>.json and a table. The targets (deterministic: 1 output per
prompt, throughput >= 0.8x the default's, batch-1 TPOT <= 1.25x) are reported under `criteria`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.shared.checkpoint import LLAMA_SHAPES, SIZES, make_random_gpt2, make_random_llama  # noqa: E402
from benchmarks.shared.common import REPO_ROOT, ServerProcess, gpu_run_info, gpu_slug, write_result  # noqa: E402
from benchmarks.serving.load_metrics import print_row  # noqa: E402
from benchmarks.serving.load_test import run_load  # noqa: E402

GPT2_SHAPES = {("gpt2" if k == "small" else f"gpt2-{k}"): k for k in SIZES}  # gpt2, gpt2-medium, ...
SHAPES = ("embedded", *GPT2_SHAPES, *LLAMA_SHAPES)
TARGETS = {"throughput_ratio_min": 0.8, "tpot_ratio_max": 1.25}


@dataclass
class Prompt:
    index: int
    token_ids: list[int]
    shared_prefix: bool
    seed: int  # the seed of this prompt's sampled probes (same seed, same tokens is the API's contract)


@dataclass
class Probe:
    prompt: int
    kind: str  # "greedy" | "seeded"
    phase: str  # "alone" | "bg<N>"


@dataclass
class Output:
    """One probe's answer: what is compared, and the digest of all of it (exact)."""
    tokens: list[str]
    logprobs: list[float]
    digest: str
    parts: dict[str, str] = field(default_factory=dict)  # digest of each compared field


@dataclass
class Tally:
    """The outputs of one (prompt, kind): count per digest, digests per phase, one example of each."""
    counts: Counter = field(default_factory=Counter)
    by_phase: dict[str, set] = field(default_factory=dict)
    examples: dict[str, Output] = field(default_factory=dict)

    def add(self, phase: str, out: Output) -> None:
        self.counts[out.digest] += 1
        self.by_phase.setdefault(phase, set()).add(out.digest)
        self.examples.setdefault(out.digest, out)


# ------------------------------------------------------------------------------- model and prompts
def model_limits(model_dir: Path) -> tuple[int, int]:
    """(vocab size, context length) from the checkpoint's config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg["vocab_size"], cfg.get("n_positions") or cfg.get("max_position_embeddings") or 1024


def build_checkpoint(shape: str, tmp: Path, on_gpu: bool) -> Path | None:
    """A random checkpoint at a real shape (benchmarks/shared/checkpoint.py); None for the embedded model."""
    if shape == "embedded":
        return None
    if shape in GPT2_SHAPES:
        import torch

        # fp16 on a GPU, as the other GPT-2 benchmarks serve it; fp32 on a CPU
        return make_random_gpt2(tmp / shape, GPT2_SHAPES[shape], dtype=torch.float16 if on_gpu else None)
    return make_random_llama(tmp / shape, shape)


def make_prompts(n: int, vocab: int, scale: int, seed: int) -> list[Prompt]:
    """Even-indexed prompts are a shared prefix (half of `scale`) plus their own tail, so they hit
    each other's cached blocks; odd ones stand alone, lengths spread from a few tokens to `scale`."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(scale // 2)]
    out = []
    for i in range(n):
        if i % 2 == 0:
            ids = prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, scale - len(prefix)))]
        else:  # lengths spread over the range, off block boundaries
            length = min(scale, max(2, scale * (i + 1) // (n + 1) + rng.randint(-3, 3)))
            ids = [rng.randrange(vocab) for _ in range(length)]
        out.append(Prompt(i, ids, i % 2 == 0, seed * 1000 + i))
    return out


def plan_probes(prompts: list[Prompt], copies: int, phases: list[str], seeded_every: int) -> list[Probe]:
    """Copy j of each prompt goes to phase j % len(phases); within a phase every `seeded_every`-th
    copy is sampled, so every phase sees both kinds."""
    return [Probe(p.index, "seeded" if seeded_every and (j // len(phases)) % seeded_every == seeded_every - 1
                  else "greedy", phases[j % len(phases)]) for p in prompts for j in range(copies)]


# ------------------------------------------------------------------------------- HTTP
async def send_probe(client: httpx.AsyncClient, url: str, model: str, prompt: Prompt, probe: Probe,
                     max_tokens: int) -> Output:
    body = {"model": model, "prompt": prompt.token_ids, "max_tokens": max_tokens, "logprobs": 1,
            "ignore_eos": True, "temperature": 0.0}
    if probe.kind == "seeded":
        body.update(temperature=1.0, seed=prompt.seed)
    r = await client.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"probe got {r.status_code}: {r.text[:300]}")
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    # json.dumps writes floats by repr, the shortest string that round-trips the double: equal
    # strings are equal bits (the server's float32 logprobs widen to doubles exactly).
    fields = {"tokens": lp["tokens"], "token_logprobs": lp["token_logprobs"], "top_logprobs": lp["top_logprobs"],
              "text": choice["text"], "finish_reason": choice["finish_reason"]}
    material = json.dumps(list(fields.values()), sort_keys=True)
    parts = {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16] for k, v in fields.items()}
    return Output(lp["tokens"], lp["token_logprobs"], hashlib.sha256(material.encode()).hexdigest()[:16], parts)


async def background_client(client: httpx.AsyncClient, url: str, model: str, rng: random.Random, prefix: list[int],
                            vocab: int, scale: int, max_out: int, stop: asyncio.Event, stats: Counter) -> None:
    """Keeps one background request in flight until `stop`, each of a random shape, so the batch
    around the probes changes size and make-up (sampler on or off, prompt chunks, prefix hits)."""
    while not stop.is_set():
        n = rng.randint(1, scale)
        ids = (prefix[:n] if rng.random() < 0.25 else []) + [rng.randrange(vocab) for _ in range(n)]
        body = {"model": model, "prompt": ids[:scale], "max_tokens": rng.randint(1, max_out), "ignore_eos": True,
                "temperature": rng.choice([0.0, 0.0, 0.8])}
        if rng.random() < 0.5:
            body["logprobs"] = rng.choice([0, 1, 5])
        try:
            r = await client.post(url + "/v1/completions", json=body)
            stats["ok" if r.status_code == 200 else f"http_{r.status_code}"] += 1
        except httpx.HTTPError as e:
            stats[type(e).__name__] += 1
            await asyncio.sleep(0.05)  # the server is in trouble: do not spin


async def run_phase(url: str, model: str, phase: str, level: int, probes: list[tuple[Prompt, Probe]],
                    cfg: argparse.Namespace, vocab: int, scale: int, tallies: dict, seed: int) -> dict:
    """One phase's probes: one at a time ("alone"), else among `level` background clients."""
    rng = random.Random(seed)
    rng.shuffle(probes)  # interleave prompts and kinds
    prefix = next((p.token_ids[:scale // 2] for p, _ in probes if p.shared_prefix), [])
    stop, bg_stats, errors = asyncio.Event(), Counter(), []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=level + cfg.probe_concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        bg = [asyncio.create_task(background_client(client, url, model, random.Random(seed * 7919 + i), prefix,
                                                    vocab, scale, cfg.background_max_tokens, stop, bg_stats))
              for i in range(level)]
        if bg:
            await asyncio.sleep(cfg.ramp_s)  # let the background fill the batch before the first probe
        sem = asyncio.Semaphore(1 if phase == "alone" else cfg.probe_concurrency)

        async def one(prompt: Prompt, probe: Probe) -> None:
            async with sem:
                if phase != "alone":
                    await asyncio.sleep(rng.random() * 0.01)  # stagger arrivals against the step clock
                try:
                    out = await send_probe(client, url, model, prompt, probe, cfg.max_tokens)
                except (httpx.HTTPError, RuntimeError, KeyError, TypeError, ValueError) as e:
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                    return
                tallies.setdefault((probe.prompt, probe.kind), Tally()).add(phase, out)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p, q) for p, q in probes))
        elapsed = time.perf_counter() - t0
        stop.set()
        for t in bg:  # in-flight background requests are dropped: the server aborts them
            t.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
    return {"phase": phase, "background": level, "probes": len(probes), "errors": len(errors),
            "error_examples": errors[:3], "elapsed_s": round(elapsed, 3), "background_requests": dict(bg_stats)}


def divergence(a: Output, b: Output) -> dict:
    """Where `b` first differs from `a` (token string, logprob), and the largest logprob difference
    while their tokens agree."""
    n = min(len(a.tokens), len(b.tokens))
    tok = next((i for i in range(n) if a.tokens[i] != b.tokens[i]), None)
    lp = next((i for i in range(n) if a.logprobs[i] != b.logprobs[i]), None)
    diff = max((abs(a.logprobs[i] - b.logprobs[i]) for i in range(n if tok is None else tok)), default=0.0)
    return {"first_token_diff": tok, "first_logprob_diff": lp, "max_abs_logprob_diff": diff,
            "fields_differing": [k for k in a.parts if a.parts[k] != b.parts.get(k)]}


def summarize_tallies(tallies: dict, prompts: list[Prompt], phases: list[str]) -> dict:
    """Per kind: the most distinct outputs of any prompt, and per prompt its distinct outputs overall
    and per phase, the most common one's count, whether the batch-1 (alone) answer is it, and where
    the others (up to 3) diverge from it."""
    out = {}
    for kind in ("greedy", "seeded"):
        rows = []
        for p in prompts:
            if (t := tallies.get((p.index, kind))) is None:
                continue
            top, top_n = t.counts.most_common(1)[0]
            alone = t.by_phase.get("alone")
            rows.append({"prompt": p.index, "prompt_len": len(p.token_ids), "shared_prefix": p.shared_prefix,
                         "requests": sum(t.counts.values()), "distinct": len(t.counts),
                         "distinct_by_phase": {ph: len(t.by_phase[ph]) for ph in phases if ph in t.by_phase},
                         "most_common_count": top_n, "alone_is_most_common": alone == {top} if alone else None,
                         "divergences": [divergence(t.examples[top], t.examples[d])
                                         for d, _ in t.counts.most_common(4)[1:]]})
        out[kind] = {"requests": sum(r["requests"] for r in rows),
                     "max_distinct": max((r["distinct"] for r in rows), default=None),
                     "prompts_with_one_output": sum(r["distinct"] == 1 for r in rows), "per_prompt": rows}
    return out


# ------------------------------------------------------------------------------- one mode
def run_mode(mode: str, model_dir: Path | None, cfg: argparse.Namespace, vocab: int, ctx: int, log_dir: Path) -> dict:
    """Start the server in `mode`, run the probe phases, the throughput levels and the batch-1 run."""
    args = ([] if model_dir is None else ["--model", str(model_dir)]) + [
        "--max-num-batched-tokens", str(cfg.max_num_batched_tokens), "--enable-prefix-caching",
        "--enable-chunked-prefill", *(["--deterministic"] if mode == "deterministic" else []), *cfg.server_args]
    env = dict(os.environ)
    # The default mode must not inherit the switch from the caller's shell; the deterministic one
    # gets the flag (an older server refuses it rather than silently measuring the default mode).
    env.pop("FLASHPAGE_DETERMINISTIC", None)
    if not cfg.on_gpu:
        env.setdefault("TRITON_INTERPRET", "1")  # any Triton kernel a mode picks runs interpreted on a CPU
    server = ServerProcess.python_server(args, log_dir / f"server_{mode}.log", env=env)
    print(f"== {mode}: {' '.join(server.cmd)}", file=sys.stderr)
    try:
        server.wait_healthy(600)
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        scale = min(cfg.max_prompt_len, ctx - max(cfg.max_tokens, cfg.background_max_tokens))
        prompts = make_prompts(cfg.prompts, vocab, scale, cfg.seed)
        phases = ["alone"] + [f"bg{n}" for n in cfg.background]
        probes = plan_probes(prompts, cfg.copies, phases, cfg.seeded_every)
        tallies: dict = {}
        phase_rows = []
        for i, phase in enumerate(phases):
            mine = [(prompts[q.prompt], q) for q in probes if q.phase == phase]
            row = asyncio.run(run_phase(server.url, model, phase, 0 if phase == "alone" else int(phase[2:]), mine,
                                        cfg, vocab, scale, tallies, cfg.seed + 101 * i))
            print(f"   {phase}: {row['probes']} probes in {row['elapsed_s']:.1f} s, {row['errors']} errors, "
                  f"background {row['background_requests']}", file=sys.stderr)
            phase_rows.append(row)
        # Throughput and the batch-1 step time: the repo's load generator (streaming /generate).
        throughput = []
        for j, c in enumerate(cfg.concurrency):
            throughput.append(run_load(
                server.url, concurrency=c, num_requests=max(2 * c, cfg.min_requests), duration=cfg.duration,
                warmup=cfg.warmup if j == 0 else 0, input_len=cfg.input_len, input_jitter=cfg.input_len // 4,
                output_len=cfg.output_len, output_jitter=cfg.output_len // 4, vocab_size=vocab, seed=cfg.seed + j,
                temperature=0.0, ignore_eos=True, progress=False, label=mode))
            print_row(throughput[-1])
        batch1 = run_load(server.url, concurrency=1, num_requests=cfg.tpot_requests, warmup=1, input_len=128,
                          output_len=cfg.tpot_output_len, vocab_size=vocab, seed=cfg.seed + 999, temperature=0.0,
                          ignore_eos=True, progress=False, label=f"{mode} batch-1")
        print_row(batch1)
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_tail()}")
        # A 5xx to a background request is a server fault, not load: keep what the server logged.
        faults = sum(v for row in phase_rows for k, v in row["background_requests"].items() if k.startswith("http_5"))
        errors_logged = [ln for ln in server.log_text().splitlines() if "Error" in ln or "error" in ln][-20:]
    finally:
        server.stop()
    return {"server_command": server.cmd[1:], "prompt_lengths": [len(p.token_ids) for p in prompts],
            "background_server_errors": faults, "server_error_lines": errors_logged if faults else [],
            "probe_requests": len(probes), "probe_errors": sum(r["errors"] for r in phase_rows),
            "phases": phase_rows, **summarize_tallies(tallies, prompts, phases),
            "throughput": throughput, "batch1": batch1}


# ------------------------------------------------------------------------------- result and CLI
def compare_modes(modes: dict) -> tuple[dict, dict]:
    """(ratios, criteria): deterministic / default throughput per level and batch-1 TPOT, and the
    targets checked (empty without both modes; criteria need only the deterministic one)."""
    d, x = modes.get("default"), modes.get("deterministic")
    r: dict = {}
    if d and x:
        base = {row["concurrency"]: row["output_tokens_per_s"] for row in d["throughput"]}
        r["throughput"] = {str(row["concurrency"]): row["output_tokens_per_s"] / base[row["concurrency"]]
                           for row in x["throughput"] if base.get(row["concurrency"])}
        t_d, t_x = d["batch1"]["tpot_p50_ms"], x["batch1"]["tpot_p50_ms"]
        r["batch1_tpot"] = t_x / t_d if t_d and t_x else None
    if not x:
        return r, {}
    tput = list(r.get("throughput", {}).values())
    return r, {"one_output_per_prompt": all(x[k]["max_distinct"] in (1, None) for k in ("greedy", "seeded")),
               "requests": x["probe_requests"], "probe_errors": x["probe_errors"],
               "throughput_ratio_ok": all(v >= TARGETS["throughput_ratio_min"] for v in tput) if tput else None,
               "tpot_ratio_ok": r["batch1_tpot"] <= TARGETS["tpot_ratio_max"] if r.get("batch1_tpot") else None}


def summary_rows(result: dict) -> list[dict]:
    """One row per mode (the results files' shared shape: `rows` with an `impl`)."""
    rows = []
    for mode, m in result["modes"].items():
        rows.append({"impl": mode, "probe_requests": m["probe_requests"], "probe_errors": m["probe_errors"],
                     **{f"max_distinct_{k}": m[k]["max_distinct"] for k in ("greedy", "seeded")},
                     **{f"output_tokens_per_s_c{r['concurrency']}": r["output_tokens_per_s"] for r in m["throughput"]},
                     "batch1_tpot_ms": m["batch1"]["tpot_p50_ms"]})
    return rows


def report(result: dict) -> str:
    """docs/benchmarks.md's table (benchmarks/make_report.py) and the run's closing print."""
    levels = result["config"]["concurrency"]
    head = ["mode", "probe requests", "max distinct outputs per prompt (greedy / seeded)",
            "prompts with one output (greedy / seeded)", *(f"tok/s @{c}" for c in levels), "batch-1 TPOT ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, m in result["modes"].items():
        tput = {r["concurrency"]: r["output_tokens_per_s"] for r in m["throughput"]}
        tpot = m["batch1"]["tpot_p50_ms"]
        one = f"{m['greedy']['prompts_with_one_output']} / {m['seeded']['prompts_with_one_output']}"
        lines.append(f"| {mode} | {m['probe_requests']} | {m['greedy']['max_distinct']} / {m['seeded']['max_distinct']} "
                     f"| {one} | " + " | ".join(f"{tput.get(c, 0):,.0f}" for c in levels)
                     + f" | {'-' if tpot is None else f'{tpot:.2f}'} |")
    if r := result["ratios"]:
        tpot = "-" if r["batch1_tpot"] is None else f"{r['batch1_tpot']:.2f}x"
        lines += ["", "deterministic / default: throughput " + ", ".join(f"@{c}: {v:.2f}x" for c, v in r["throughput"].items())
                  + f" (target >= {TARGETS['throughput_ratio_min']}x); batch-1 TPOT {tpot} "
                  f"(target <= {TARGETS['tpot_ratio_max']}x)"]
    if result["criteria"]:
        lines += ["", f"criteria: {result['criteria']}"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.bench_determinism", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model-shape", choices=SHAPES, default=None, help="random checkpoint of this shape (default gpt2; with "
      "--quick embedded: the server's own model)")
    a("--model", default=None, help="serve this checkpoint directory instead")
    a("--modes", nargs="+", choices=["default", "deterministic"], default=["default", "deterministic"])
    a("--prompts", type=int, default=8, help="distinct probe prompts")
    a("--copies", type=int, default=128, help="probe requests per prompt, spread over the phases")
    a("--max-tokens", type=int, default=64, help="tokens per probe")
    a("--max-prompt-len", type=int, default=768, help="longest probe/background prompt (within the context)")
    a("--seeded-every", type=int, default=4, help="every k-th copy in a phase is sampled, seeded (0: none)")
    a("--background", type=int, nargs="+", default=[0, 8, 64, 256], help="background clients, one phase each")
    a("--background-max-tokens", type=int, default=128, help="background max_tokens uniform in [1, this]")
    a("--probe-concurrency", type=int, default=16, help="probes in flight at once (but for the alone phase)")
    a("--ramp-s", type=float, default=1.0, help="seconds the background runs before the first probe")
    a("--max-num-batched-tokens", type=int, default=512, help="the server's step budget: small, to chunk prompts")
    a("--concurrency", type=int, nargs="+", default=[64, 256], help="throughput levels (closed loop)")
    a("--input-len", type=int, default=512, help="throughput prompts, +- a quarter")
    a("--output-len", type=int, default=256, help="throughput outputs, +- a quarter")
    a("--min-requests", type=int, default=32, help="throughput requests per level: max(2 x C, this)")
    a("--duration", type=float, default=30.0, help="throughput level deadline (s)")
    a("--warmup", type=int, default=16, help="uncounted requests before the first throughput level")
    a("--tpot-requests", type=int, default=8, help="batch-1 requests (128-token prompts), one at a time")
    a("--tpot-output-len", type=int, default=256)
    a("--seed", type=int, default=0)
    a("--quick", action="store_true", help="tiny CPU smoke run (its sizes replace the defaults)")
    a("--merge", action="store_true", help="keep the other mode's results from this device's file")
    a("--out-dir", default=None, help="default: benchmarks/results (with --quick: a temp dir)")
    a("--server-args", nargs=argparse.REMAINDER, default=[], help="extra `python -m server` flags (put last)")
    return p


QUICK = dict(prompts=2, copies=4, max_prompt_len=48, background=[0, 4], max_tokens=4, seeded_every=2,
             background_max_tokens=8, probe_concurrency=4, ramp_s=0.1, concurrency=[4], input_len=32, output_len=8,
             min_requests=8, duration=10.0, warmup=1, tpot_requests=2, tpot_output_len=16)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg, defaults = build_parser().parse_args(argv), build_parser().parse_args([])
    for k, v in QUICK.items() if cfg.quick else ():  # quick sizes replace defaults, not what was given
        if getattr(cfg, k) == getattr(defaults, k):
            setattr(cfg, k, v)
    cfg.model_shape = cfg.model_shape or ("embedded" if cfg.quick else "gpt2")
    import torch

    cfg.on_gpu = torch.cuda.is_available() and "cpu" not in cfg.server_args
    out_dir = Path(cfg.out_dir or (Path(tempfile.gettempdir()) / "flashpage-determinism-quick" if cfg.quick
                                   else REPO_ROOT / "benchmarks" / "results"))
    tmp = Path(tempfile.mkdtemp(prefix="flashpage-determinism-"))  # checkpoint and server logs
    ok = False
    try:
        model_dir = Path(cfg.model) if cfg.model else build_checkpoint(cfg.model_shape, tmp, cfg.on_gpu)
        vocab, ctx = model_limits(model_dir or REPO_ROOT / "models" / "embedded")
        info = gpu_run_info("benchmarks.engine.bench_determinism", argv) if cfg.on_gpu else {
            "device": "cpu", "torch": torch.__version__.split("+")[0], "date": datetime.date.today().isoformat(),
            "command": "python -m benchmarks.engine.bench_determinism " + " ".join(argv)}
        result = {**info, "model": cfg.model or cfg.model_shape,
                  "random_weights": not cfg.model and model_dir is not None, "vocab_size": vocab,
                  "context": ctx, "targets": TARGETS, "modes": {},
                  "config": {k: v for k, v in vars(cfg).items() if k not in ("quick", "merge", "out_dir")}}
        # one file per model: determinism_<gpu>.json for GPT-2 small, determinism_<shape>_<gpu>.json else
        name = "determinism" if cfg.model else f"determinism_{cfg.model_shape}"
        path = out_dir / f"{name}_{gpu_slug(info['device'])}.json"
        if cfg.merge and path.exists():  # one mode per device call: the other's results come from the file
            old = json.loads(path.read_text())
            if old.get("model") != result["model"]:
                raise RuntimeError(f"--merge: {path} measured {old.get('model')}, not {result['model']}")
            result["modes"] = {m: v for m, v in old["modes"].items() if m not in cfg.modes}
            result["command"] = old["command"] + " && " + result["command"]
        for mode in cfg.modes:  # the file is written after each mode: a run cut off keeps what it finished
            result["modes"][mode] = run_mode(mode, model_dir, cfg, vocab, ctx, tmp)
            result["modes"] = {m: result["modes"][m] for m in ("default", "deterministic") if m in result["modes"]}
            result["ratios"], result["criteria"] = compare_modes(result["modes"])
            result["rows"] = summary_rows(result)
            print("wrote", write_result(result, out_dir, name), file=sys.stderr)
        print(report(result))
        ok = all(m["probe_errors"] == 0 for m in result["modes"].values())
    except RuntimeError as e:
        print(f"!! {e}", file=sys.stderr)
    finally:
        for d in tmp.iterdir():  # the checkpoint always goes (GBs); the logs stay if anything failed
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"server logs in {tmp}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    # A timeout's SIGTERM becomes SystemExit, so `finally` stops the server (its own process group)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
