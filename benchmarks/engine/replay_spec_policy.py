"""The speculative back-off rules (server/engine/spec/policy.py) replayed against bench_spec's oracle,
priced by a cost model fitted to the H100 measurements: an ESTIMATE, a model, not a measurement.

The replay is the real engine (scheduler, block manager, speculator, back-off, asynchronous
scheduling) over a device that computes nothing (`FakeRunner`: every row samples token 0) and a
draft that proposes k zeros a round (`FakeDraft`, which counts its catch-up tokens); bench_spec's
`Oracle` (same seeds) decides each verification. It reproduces the verification count of every row
of benchmarks/results/spec_h100.json and spec_eagle3_h100.json (the script checks it), so its steps
are the H100 run's steps.

Each step is priced: the plain step of its rows (the "off" rows' TPOT, interpolated in the batch
size; EAGLE-3: its target feeding the head), prompt tokens, and for a speculating step a fixed cost
plus one a verified proposal, plus the draft's round (fixed, a row, a catch-up token). Those
constants are fitted (least squares, non-negative, on relative errors) to the measured wall times
(clients x 128 tokens / output tok/s); the file records them, each row's fit error, and the replay
of both rules at 1 / 8 / 64 clients (and the 256-client goal point) with the fitted prices.

  python -m benchmarks.engine.replay_spec_policy     # benchmarks/results/experiments/spec_policy_replay_estimate_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.engine.bench_spec import configure
from benchmarks.shared.checkpoint import make_random_llama
from server.config import SPEC_FLOORS, EngineConfig, SpeculativeConfig
from server.engine import LLMEngine
from server.engine.spec.draft import DraftProposer
from server.engine.spec.ngram import NgramProposer
from server.sampling_params import SamplingParams
from server.worker.spec.verify import verify_rows
from server.worker.steps import StepHandle, StepResult

RESULTS = Path("benchmarks/results")
TINY = dict(model_type="llama", num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=4096)


class FakeRunner:
    """A device that computes nothing: each step's rows (the runner's order) sample token 0; each
    step's shape is logged: (plain decodes, verifications, verified tokens, prompt tokens)."""

    def __init__(self, real) -> None:
        self.real, self.stop_ids, self.counts, self.log = real, frozenset(), real.counts, []

    def launch(self, prefills, decodes, verifies=None) -> StepHandle:
        verifies = verifies or []
        self.log.append((len(decodes), len(verifies), sum(v.num_tokens for v in verifies),
                         sum(p.num_tokens for p in prefills)))
        return StepHandle(verify_rows(decodes, verifies, prefills)[0])

    def collect(self, handle: StepHandle) -> StepResult:
        return StepResult([0] * len(handle.rows))

    def release(self, request_id: str) -> None:
        pass

    def complete(self, handle: StepHandle) -> StepHandle:
        return handle

    def close(self) -> None:
        self.real.close()


class FakeDraft:
    """A draft (or head) that proposes k zeros a row and counts the tokens its rounds catch up."""

    catch_up = 0

    def propose(self, chunks, ks) -> list[list[int]]:
        self.catch_up += sum(c.num_tokens for c in chunks)
        return [[0] * k for k in ks]

    def close(self) -> None:
        pass


def replay_engine(tmp: Path) -> LLMEngine:
    """bench_spec's engine (its limits and budget) over the fake device; proposers for each method."""
    path = make_random_llama(tmp / "tiny", TINY)
    cfg = SpeculativeConfig.parse(json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                              "disable_by_batch_size": 64}))
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", attention="eager", speculative_config=cfg,
                                    max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096,
                                    enable_prefix_caching=False, log_stats_interval=0, num_blocks=6800))
    engine.runner = FakeRunner(engine.runner)
    draft = FakeDraft()
    engine.speculator.proposers = {"ngram": NgramProposer(1, 3), "draft_model": DraftProposer(draft, 4, 8192),
                                   "eagle3": DraftProposer(draft, 4, 8192, lag=1)}
    engine.draft, engine.speculating = draft, engine.speculator  # (bench_spec's configure swaps it in and out)
    return engine


def replay(engine: LLMEngine, clients: int, method: str | None, p: float, max_batch: int, repeats: int,
           floor: float | None = None, backoff: str | None = None) -> list[dict]:
    """bench_spec's runs of one configuration (seed = repeat): per repeat, its steps' features."""
    spec, params = engine.speculating, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    out = []
    for rep in range(repeats):
        engine.runner.log.clear()
        engine.draft.catch_up = 0
        configure(engine, spec, method, p, max_batch, seed=rep, floor=floor, backoff=backoff)
        for i in range(clients):
            engine.add_request(f"{clients}-{method}-{p}-{floor}-{backoff}-{rep}-{i}-{time.monotonic()}", [7] * 256, params)
        while engine.has_unfinished():
            engine.step()
        log = engine.runner.log
        out.append(dict(steps=[(d + v, pf) for d, v, _, pf in log], spec_steps=sum(1 for s in log if s[1]),
                        extra=sum(s[2] - s[1] for s in log), rows=sum(s[1] for s in log),
                        catch_up=engine.draft.catch_up if method in ("draft_model", "eagle3") else 0,
                        verifications=spec.counters.drafts if method else 0))
    return out


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients, for a few columns: a coefficient that comes out
    negative is dropped (0) and the rest fitted again."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (x[active] >= 0).all():
            return x
        active.remove(min(active, key=lambda i: x[i]))


def plain_ms(run: dict, tpot: dict[int, float]) -> float:
    """The plain steps of a run at the "off" rows' TPOT (interpolated in the batch size)."""
    xs = sorted(tpot)
    return float(sum(np.interp(n, xs, [tpot[x] for x in xs]) for n, _ in run["steps"] if n))


def features(run: dict, tpot: dict[int, float]) -> list[float]:
    """[plain steps ms, prompt tokens, speculating steps, verified proposals, round rows, catch-up tokens]."""
    return [plain_ms(run, tpot), sum(pf for _, pf in run["steps"]), run["spec_steps"], run["extra"], run["rows"],
            run["catch_up"]]


def off_tpot(result: dict, feeding: bool) -> dict[int, float]:
    return {r["clients"]: r["tpot_ms"] for r in result["rows"]
            if r["method"] is None and ("feeding" in r["config"]) == feeding}


def fit(engine: LLMEngine, files: list[Path]) -> tuple[dict, list[dict]]:
    """The cost constants (ms) from every measured row of `files`, and each row's fit."""
    measured = []
    for f in files:
        result = json.loads(f.read_text())
        for r in result["rows"]:
            repeats = result["repeats"] if r["clients"] < 256 else 2
            runs = replay(engine, r["clients"], r["method"], r["p"], 1 << 20 if r["forced"] else 32, repeats,
                          floor=r["min_acceptance"], backoff=r.get("backoff", "per_sequence"))  # (before the batch rule)
            got = sum(x["verifications"] for x in runs)
            assert got == r["verifications"], f"{f.name} {r['clients']} {r['config']}: replay {got}, measured {r['verifications']}"
            tpot = off_tpot(result, feeding=r["method"] == "eagle3" or "feeding" in r["config"])
            x = np.mean([features(run, tpot) for run in runs], axis=0)
            measured.append(dict(file=f.name, clients=r["clients"], config=r["config"], method=r["method"],
                                 verifications=got, wall_ms=r["clients"] * 128 / r["output_tok_s"] * 1e3, x=x))

    def solve(rows, cols, rest):
        a = np.array([[m["x"][c] for c in cols] for m in rows]) / np.array([[m["wall_ms"]] for m in rows])
        b = np.array([(m["wall_ms"] - rest(m)) / m["wall_ms"] for m in rows])
        return nnls(a, b)

    plain = [m for m in measured if m["method"] in (None, "ngram")]  # the verification's costs: no draft
    prompt, step, proposal = solve(plain, [1, 2, 3], lambda m: m["x"][0])
    costs = dict(prompt_token=float(prompt), spec_step=float(step), verified_proposal=float(proposal))

    def base(m):
        return m["x"][0] + prompt * m["x"][1] + step * m["x"][2] + proposal * m["x"][3]

    for method in ("draft_model", "eagle3"):
        rows = [m for m in measured if m["method"] == method]
        if rows:
            costs[method] = dict(zip(("round", "row", "catch_up_token"), map(float, solve(rows, [2, 4, 5], base))))
    for m in measured:
        m["fitted_wall_ms"] = price(m["x"], m["method"], costs)
        m["error"] = round(m["fitted_wall_ms"] / m["wall_ms"] - 1, 4)
        m["wall_ms"], m["fitted_wall_ms"] = round(m["wall_ms"], 1), round(m["fitted_wall_ms"], 1)
        del m["x"]
    return costs, measured


def price(x, method: str | None, costs: dict) -> float:
    """A run's wall ms by the cost model (features as `features` gives them)."""
    ms = x[0] + costs["prompt_token"] * x[1] + costs["spec_step"] * x[2] + costs["verified_proposal"] * x[3]
    if method in ("draft_model", "eagle3"):
        c = costs[method]
        ms += c["round"] * x[2] + c["row"] * x[4] + c["catch_up_token"] * x[5]
    return float(ms)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="benchmarks/results/experiments")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--probabilities", type=float, nargs="+", default=[0.0, 0.5, 0.7, 0.8, 0.9])
    ap.add_argument("--methods", nargs="+", default=["draft_model", "eagle3", "ngram"])
    ap.add_argument("--seeds", type=int, default=20,
                    help="oracle seeds a configuration (the H100 runs had 0-2, at 256 clients 0-1: those rows too)")
    args = ap.parse_args(argv)
    files = [RESULTS / "spec_h100.json", RESULTS / "spec_eagle3_h100.json"]
    with tempfile.TemporaryDirectory(prefix="replay-spec-") as tmp:
        engine = replay_engine(Path(tmp))
        costs, measured = fit(engine, files)
        tpot = {False: off_tpot(json.loads(files[0].read_text()), False),
                True: off_tpot(json.loads(files[1].read_text()), True)}
        rows = []
        for clients in args.clients:
            measured_seeds, repeats = (3, args.seeds) if clients < 256 else (2, max(2, args.seeds // 4))
            off = statistics.median(price(features(r, tpot[False]), None, costs)
                                    for r in replay(engine, clients, None, 0.0, 32, measured_seeds))
            ps = args.probabilities if clients < 256 else [0.8]
            for method in args.methods:
                rules = [("per_sequence", SPEC_FLOORS[method]), ("batch", None)]  # (floor: per_sequence only)
                if method == "draft_model":
                    rules.insert(1, ("per_sequence", 0.25))  # the earlier run's floor
                for p in ps:
                    for backoff, floor in rules:
                        runs = replay(engine, clients, method, p, 32, repeats, floor=floor, backoff=backoff)
                        ms = [price(features(r, tpot[method == "eagle3"]), method, costs) for r in runs]
                        first = runs[:measured_seeds]  # bench_spec's seeds: its median of their runs
                        rows.append(dict(clients=clients, method=method, p=p, backoff=backoff, min_acceptance=floor,
                                         verifications=sum(r["verifications"] for r in first),
                                         rounds=sum(r["spec_steps"] for r in first),
                                         estimated_speedup=round(off / statistics.median(ms[:measured_seeds]), 3),
                                         seeds=len(runs), estimated_speedup_all_seeds=round(statistics.mean(off / m for m in ms), 3)))
                        print(json.dumps(rows[-1]), flush=True)
        engine.close()
    result = dict(kind="estimate: a cost model replayed over the oracle's draws, not a measurement",
                  command=" ".join(["python -m benchmarks.engine.replay_spec_policy", *(argv or [])]),
                  date=datetime.date.today().isoformat(), fitted_to=[str(f) for f in files], device_priced="NVIDIA H100 80GB HBM3",
                  target="llama-3.1-8b", draft="llama-3.2-1b", k=4, prompt_len=256, max_tokens=128,
                  costs_ms=costs, off_tpot_ms={"plain": tpot[False], "target feeding eagle3": tpot[True]},
                  fit=measured, rows=rows)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "spec_policy_replay_estimate_h100.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    worst = max(measured, key=lambda m: abs(m["error"]))
    print(f"wrote {path}; fit: {len(measured)} rows, worst {worst['error']:+.1%} ({worst['file']} {worst['clients']} "
          f"{worst['config']}); costs {json.dumps(costs)}")


if __name__ == "__main__":
    main()
