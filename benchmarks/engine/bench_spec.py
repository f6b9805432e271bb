"""Speculative decoding's speed against its acceptance (issue 48): output tok/s and TPOT at 1 / 8 / 64
/ 256 clients on the Llama-3.1-8B shape, with and without speculation, in one process.

The acceptance is set, not hoped for: random weights accept nothing a real draft proposes, so an
oracle (benchmark-only, `Oracle`) judges every verification as if each proposal were the target's own
next token with probability p, independently, the first miss ending the run (vLLM's "synthetic"
rejection sampling does the same for its benchmarks). The proposers still run and cost what they cost:
`ngram` (the host lookup; where it finds nothing the oracle pads its k proposals), `draft_model` (a
Llama-3.2-1B-shaped draft, its own KV cache and CUDA graphs, k decode steps a round) and `eagle3` (a
random EAGLE-3 head of the published layout for the target, 32,000-token draft vocabulary: its
catch-up and k - 1 chained steps, and the target's three layers' states fused into the head's rows
at every step); the target verifies k + 1 tokens a sequence in its verification graphs, and the
run's tokens are the rows the target chose, so every step costs what a real one with that acceptance
costs. With k proposals and probability p the mean accepted length is (1 - p^(k+1)) / (1 - p)
(k = 4: p = 0.77 gives 3); the file records the measured one.

One engine serves ngram and draft_model (the 8B shape takes minutes to build and load): its
speculator is switched off (`engine.speculator = None`, the plain engine) or given the proposer and
oracle of the configuration. eagle3 needs a target that hands the head its states at every step,
which costs with speculation off too: a second engine, loaded once the first is closed, whose own
"off" row measures that cost; every speedup is against the plain engine's "off" (no head). Each
(configuration, clients) runs `--repeats` times in turn with the others; medians. C clients are C requests of `--prompt-len` random tokens and `--max-tokens` greedy
tokens (ignore_eos) admitted together. `--policy` configurations keep the default back-off
(server/config.py: no speculation above SPEC_DISABLE_BY_BATCH_SIZE running); `forced` ones lift the
batch limit, to show what it saves. `--floors` and `--policies` run a method at several back-off
floors or rules (server/engine/spec/policy.py: per_sequence, batch) side by side, rows of their own.

  python -m benchmarks.engine.bench_spec --out-dir benchmarks/results
  python -m benchmarks.engine.bench_spec --methods eagle3     # spec_eagle3_<gpu>.json
  python -m benchmarks.engine.bench_spec --policies per_sequence batch   # spec_policies_<gpu>.json
  python -m benchmarks.engine.bench_spec --tensor-parallel-size 2 --methods ngram   # spec_ngram_tp2_<gpu>.json
                                                              # (the draft whole on the first GPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.shared.common import gpu_run_info, write_result  # noqa: E402
from server.config import (SPEC_BACKOFF, SPEC_BACKOFFS, SPEC_DISABLE_BY_BATCH_SIZE,  # noqa: E402
                           SPEC_FLOORS, SPEC_ROUND_COST, EngineConfig, SpeculativeConfig)
from server.engine import LLMEngine  # noqa: E402
from server.engine.spec.policy import batch_rule  # noqa: E402
from server.engine.spec.ngram import NgramProposer  # noqa: E402
from server.sampling_params import SamplingParams  # noqa: E402


class Oracle:
    """A proposer whose proposals `judge` accepts as the target's own next tokens with probability
    `p` each (the first miss ends the run); `inner` proposes first and is paid for. Benchmark-only."""

    def __init__(self, inner, p: float, seed: int = 0) -> None:
        self.inner, self.p, self.rng = inner, p, random.Random(seed)

    def propose(self, items):
        out = []
        for (seq, _, k), d in zip(items, self.inner.propose(items)):
            out.append(None if d is None else (list(d) + [0] * k)[:k])  # a lookup that found nothing: padded
        return out

    def accepted(self, seq, start, proposed, accepted):
        self.inner.accepted(seq, start, proposed, accepted)

    def reset(self, seq):
        self.inner.reset(seq)

    def judge(self, draft, chosen) -> int:
        j = 0
        while j < len(draft) and self.rng.random() < self.p:
            j += 1
        return j


def expected_length(p: float, k: int) -> float:
    return float(k + 1) if p >= 1 else (1 - p ** (k + 1)) / (1 - p)


def configure(engine: LLMEngine, spec, method: str | None, p: float, max_batch: int, seed: int = 0,
              floor: float | None = None, backoff: str | None = None) -> None:
    """Point the engine at one configuration: None = no speculation; else `method`'s proposer
    (`spec.proposers[method]`) under an oracle of probability p (its draws seeded by `seed`),
    speculating up to `max_batch` running sequences, backing off by the rule `backoff` (the
    method's default if None), per_sequence below acceptance `floor` (the method's default
    min_acceptance if None); the speculator's counters from zero."""
    if method is None:
        engine.speculator = None
        return
    engine.speculator = spec
    spec.proposer = Oracle(spec.proposers[method], p, seed)
    spec.acceptance = spec.proposer.judge
    spec.max_batch = max_batch
    spec.floor = SPEC_FLOORS[method] if floor is None else floor
    rule = backoff or SPEC_BACKOFF[method]
    spec.batch = batch_rule(SPEC_ROUND_COST[method]) if rule == "batch" else None
    c = spec.counters
    c.drafts = c.draft_tokens = c.accepted_tokens = 0
    c.accepted_per_pos[:] = [0] * len(c.accepted_per_pos)


def run_clients(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """The prompts as concurrent requests to the end: output tok/s and per-request TPOT (median)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    first, done = {}, {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{t0}", p, params)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = (now, o.completion_tokens)
    wall = time.perf_counter() - t0
    tokens = sum(n for _, n in done.values())
    tpot = statistics.median((t - first[r]) / max(n - 1, 1) for r, (t, n) in done.items())
    return {"output_tok_s": tokens / wall, "tpot_ms": 1e3 * tpot, "wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--target-shape", default="llama-3.1-8b")
    ap.add_argument("--draft-shape", default="llama-3.2-1b")
    ap.add_argument("--methods", nargs="+", default=["ngram", "draft_model"], choices=["ngram", "draft_model", "eagle3"],
                    help="proposers to run (eagle3 in a second engine; the file: spec_<gpu>.json for the default, "
                         "spec_<methods>_<gpu>.json otherwise)")
    ap.add_argument("--draft-quantization", default=None, choices=["fp8"],
                    help="the draft model quantized at load (the speculative config's `quantization`)")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="the random EAGLE-3 head's (the published heads')")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--probabilities", type=float, nargs="+", default=[0.0, 0.5, 0.7, 0.8, 0.9])
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repeats-256", type=int, default=3, help="repeats at 256 clients (seconds a run; 3: a median that one stalled run does not set)")
    ap.add_argument("--sweep-clients", type=int, nargs="*", default=[1, 8],
                    help="client counts run at every probability (the others at --probability only)")
    ap.add_argument("--probability", type=float, default=0.8, help="(k = 4: mean accepted length 3.4)")
    ap.add_argument("--forced-clients", type=int, nargs="*", default=[64],
                    help="client counts also run with the batch-size back-off lifted")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="the engines' (with and without speculation)")
    ap.add_argument("--deadline", type=float, default=None, help="stop adding runs after this many seconds")
    ap.add_argument("--floors", nargs="*", default=[], metavar="METHOD=MIN_ACCEPTANCE",
                    help="run METHOD at each of these back-off floors (repeat it: draft_model=0.25 draft_model=0.4), "
                         "side by side in the same process; without it, the method's default (server/config.py)")
    ap.add_argument("--policies", nargs="*", default=[], choices=SPEC_BACKOFFS,
                    help="run each method under each of these back-off rules side by side in the same process; "
                         "without it, each method's default (server/config.py)")
    args = ap.parse_args(argv)
    args.floors = parse_floors(ap, args.floors)
    t_start = time.monotonic()
    from benchmarks.shared.checkpoint import make_random_eagle3, make_random_llama

    tmp = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    t0 = time.monotonic()
    target = make_random_llama(tmp / "target", args.target_shape, device="cuda")
    draft = make_random_llama(tmp / "draft", args.draft_shape, seed=1, device="cuda") if "draft_model" in args.methods else None
    head = (make_random_eagle3(tmp / "eagle3", target, draft_vocab_size=args.draft_vocab, seed=2, device="cuda")
            if "eagle3" in args.methods else None)
    build_s = time.monotonic() - t0
    k = args.num_speculative_tokens
    # graphs captured for as many speculating sequences as the forced runs have (the policy's limit,
    # SPEC_DISABLE_BY_BATCH_SIZE, is set back on the speculator below)
    most = min(max([SPEC_DISABLE_BY_BATCH_SIZE, *args.forced_clients]), 64)
    first = [m for m in ("ngram", "draft_model") if m in args.methods]
    draft_json = {"method": "draft_model", "model": str(draft)} | (
        {"quantization": args.draft_quantization} if args.draft_quantization else {})
    phases = [("plain", draft_json if draft else
               {"method": "ngram"} if first else None, first)]
    if head is not None:  # the target hands the head its states at every step: an engine of its own
        phases.append(("eagle3", {"method": "eagle3", "model": str(head)}, ["eagle3"]))
    default_batch = SPEC_DISABLE_BY_BATCH_SIZE
    rng = random.Random(0)
    prompts = None
    suffix = "" if args.methods == ["ngram", "draft_model"] else "_" + "_".join(args.methods)
    suffix += "_floors" if args.floors else ""  # an A/B of back-off floors: a file of its own
    suffix += "_policies" if args.policies else ""  # and of back-off rules
    suffix += f"_tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    suffix += f"_draft-{args.draft_quantization}" if args.draft_quantization and draft else ""
    result = dict(gpu_run_info("benchmarks.engine.bench_spec", argv), target=args.target_shape,
                  draft=args.draft_shape if draft else None,
                  draft_quantization=args.draft_quantization if draft else None, eagle3_draft_vocab=args.draft_vocab if head else None,
                  k=k, tensor_parallel_size=args.tensor_parallel_size, prompt_len=args.prompt_len,
                  max_tokens=args.max_tokens, repeats=args.repeats,
                  disable_by_batch_size=default_batch, build_s=round(build_s, 1), load_s=[], rows=[])
    plain_off: dict[int, float] = {}  # clients -> the plain engine's output tok/s, TPOT without speculation
    path = None
    for phase, spec_json, methods in phases:
        t0 = time.monotonic()
        cfg = (SpeculativeConfig.parse(json.dumps({**spec_json, "num_speculative_tokens": k, "disable_by_batch_size": most}))
               if spec_json else None)
        engine = LLMEngine(EngineConfig(model=str(target), speculative_config=cfg, max_num_seqs=256,
                                        max_num_batched_tokens=8192, max_model_len=args.max_model_len,
                                        enable_prefix_caching=False, log_stats_interval=0,
                                        tensor_parallel_size=args.tensor_parallel_size))
        result["load_s"].append(round(time.monotonic() - t0, 1))
        result.setdefault("num_blocks", {})[phase] = engine.block_manager.num_blocks
        spec = engine.speculator
        if spec is not None:
            spec.proposers = {m: spec.proposer for m in methods if m != "ngram"}
            spec.proposers["ngram"] = NgramProposer(1, 3)
        if prompts is None:
            vocab = min(engine.spec.vocab_size, len(engine.tokenizer))
            prompts = {c: [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(c)] for c in args.clients}
        print(f"{phase}: built in {build_s:.0f} s, loaded in {result['load_s'][-1]:.0f} s; "
              f"{engine.block_manager.num_blocks} blocks", flush=True)
        configure(engine, spec, None, 0.0, default_batch)
        run_clients(engine, prompts[args.clients[0]][:1], 8)  # warm: the first steps of a process are slow
        for clients in args.clients:
            if args.deadline and time.monotonic() - t_start > args.deadline:
                break
            result["rows"] += measure(engine, spec, phase, methods, clients, prompts[clients], args, plain_off, t_start)
            path = write_result(result, args.out_dir, "spec" + suffix)  # after each client count: a deadline keeps what ran
        engine.close()
        del engine, spec
        gc.collect()
        torch.cuda.empty_cache()
    print(f"wrote {path}")
    print(f"{'clients':>7} {'config':<26} {'tok/s':>9} {'x':>6} {'TPOT ms':>8} {'xTPOT':>6} {'acc len':>7}")
    for r in result["rows"]:
        print(f"{r['clients']:>7} {r['config']:<26} {r['output_tok_s']:>9.0f} {r['speedup'] or 0:>6.2f} "
              f"{r['tpot_ms']:>8.2f} {r['tpot_speedup'] or 0:>6.2f} {r['mean_accepted_length'] or 0:>7.2f}")


def parse_floors(ap: argparse.ArgumentParser, items: list[str]) -> dict[str, list[float]]:
    """--floors' METHOD=VALUE items as {method: [floors, in order]}; the parser's error for a bad one."""
    floors: dict[str, list[float]] = {}
    for item in items:
        method, _, value = item.partition("=")
        try:
            f = float(value)
        except ValueError:
            f = -1.0
        if method not in SPEC_FLOORS or not 0.0 <= f <= 1.0:
            ap.error(f"--floors {item!r}: METHOD=MIN_ACCEPTANCE, a method of {sorted(SPEC_FLOORS)} and a value in [0, 1]")
        floors.setdefault(method, []).append(f)
    return floors


def measure(engine: LLMEngine, spec, phase: str, methods: list[str], clients: int, prompts: list[list[int]], args,
            plain_off: dict, t_start: float) -> list[dict]:
    """One client count's rows on one engine: its "off" runs and each method's at each probability
    (and forced), `--repeats` times in turn; speedups against the plain engine's "off" (recorded in
    `plain_off` by the first phase; a later phase's own "off" row shows what its engine costs)."""
    default_batch, k = SPEC_DISABLE_BY_BATCH_SIZE, args.num_speculative_tokens
    ps = args.probabilities if clients in args.sweep_clients else [args.probability]
    off = "off" if phase == "plain" else f"off, target feeding {phase}"
    todo = [(off, None, 0.0, default_batch, None, None)]
    todo += [(f"{m} p={p}" + (f" floor={f}" if f is not None else "") + (f" backoff={b}" if b else ""),
              m, p, default_batch, f, b)
             for m in methods for p in ps for f in args.floors.get(m, [None])
             for b in args.policies or [None]]
    if clients in args.forced_clients:
        todo += [(f"{m} p={args.probability} forced", m, args.probability, 1 << 20, None, None) for m in methods]
    runs = {name: [] for name, *_ in todo}
    counters = {}
    for rep in range(args.repeats if clients < 256 else args.repeats_256):
        for name, method, p, max_batch, floor, backoff in todo:
            if args.deadline and time.monotonic() - t_start > args.deadline:
                break
            configure(engine, spec, method, p, max_batch, seed=rep, floor=floor, backoff=backoff)
            runs[name].append(run_clients(engine, prompts, args.max_tokens))
            if method is not None:  # summed over the repeats (each draws its own acceptances)
                c, (d, t, a) = spec.counters, counters.get(name, (0, 0, 0))
                counters[name] = (d + c.drafts, t + c.draft_tokens, a + c.accepted_tokens)
    if runs[off] and clients not in plain_off:
        plain_off[clients] = (statistics.median(r["output_tok_s"] for r in runs[off]),
                              statistics.median(r["tpot_ms"] for r in runs[off]))
    base, base_tpot = plain_off.get(clients, (None, None))
    rows = []
    for name, method, p, max_batch, floor, backoff in todo:
        if not runs[name]:
            continue
        tok_s = statistics.median(r["output_tok_s"] for r in runs[name])
        tpot = statistics.median(r["tpot_ms"] for r in runs[name])
        drafts, proposed, accepted = counters.get(name, (0, 0, 0))
        row = dict(impl="flashpage", clients=clients, config=name, method=method, p=p, forced=max_batch != default_batch,
                   min_acceptance=(SPEC_FLOORS[method] if floor is None else floor) if method is not None else None,
                   backoff=(backoff or SPEC_BACKOFF[method]) if method is not None else None,
                   output_tok_s=round(tok_s, 1), tpot_ms=round(tpot, 3), runs=len(runs[name]),
                   # each run's, in order: a median of few hides whether one run stalled
                   runs_tok_s=[round(r["output_tok_s"], 1) for r in runs[name]],
                   speedup=round(tok_s / base, 3) if base else None,
                   tpot_speedup=round(base_tpot / tpot, 3) if base_tpot else None,
                   verifications=drafts, expected_accepted_length=round(expected_length(p, k), 3),
                   mean_accepted_length=round(1 + accepted / drafts, 3) if drafts else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def report(result: dict) -> str:
    """docs/benchmarks.md's table of a result file (benchmarks/make_report.py)."""
    drafts = [f"{result['draft']}-shaped draft"] if result.get("draft") else []
    if result.get("eagle3_draft_vocab"):
        drafts.append(f"a random EAGLE-3 head ({result['eagle3_draft_vocab']:,}-token draft vocabulary; the target "
                      f"feeding it runs in an engine of its own, whose 'off' row is that engine without speculation)")
    lines = [f"{result['target']} target, {' and '.join(drafts) or 'n-gram'}, k = {result['k']}, prompts of "
             f"{result['prompt_len']} random tokens, {result['max_tokens']} greedy tokens each; the oracle sets "
             f"the acceptance (p: each proposal the target's own token with that probability); speedups against "
             f"no speculation in the same process; 'forced' lifts the batch-size back-off "
             f"(disable_by_batch_size {result['disable_by_batch_size']}).", "",
             "| clients | configuration | mean accepted length | output tok/s | speedup | TPOT ms | TPOT speedup |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        length = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "-"
        lines.append(f"| {r['clients']} | {r['config']} | {length} | {r['output_tok_s']:,.0f} | {r['speedup']:.2f}x | "
                     f"{r['tpot_ms']:.2f} | {r['tpot_speedup']:.2f}x |")
    return "\n".join(lines)


def acceptance_report(result: dict) -> str:
    """embedded_draft_acceptance.json (tools/embedded/measure_acceptance.py): what each proposer's
    proposals are worth on the embedded model's held-out documents, real acceptance, no oracle."""
    lines = [f"{result['documents']} held-out documents, prompts of {result['prompt_tokens']} tokens, "
             f"{result['max_tokens']} greedy tokens each, k = {result['k']}, the embedded model as the target:", "",
             "| method | acceptance rate | mean accepted length | accepted by position | same tokens as without | wall s |",
             "|---|---:|---:|---|---|---:|"]
    for r in result["rows"]:
        by_pos = " / ".join(f"{x:.2f}" for x in r.get("accepted_by_position", []))
        same = {True: "yes", False: "**no**"}.get(r.get("identical_to_no_speculation"), "")
        rate = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else ""
        length = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else ""
        wall = f"{r['wall_s']:.0f}"
        if "wall_s_without_speculation" in r:  # a row measured later (--merge), beside its own run without
            wall += f" (without: {r['wall_s_without_speculation']:.0f}; {r['date']})"
        lines.append(f"| {r['method']} | {rate} | {length} | {by_pos} | {same} | {wall} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
