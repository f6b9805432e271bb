#!/usr/bin/env python3
"""Run a few train.py configurations side by side on one GPU and keep the one
with the lowest final validation loss.

The corpus is small (~0.65M training tokens), so the useful knobs are how many
epochs to train and how much dropout to use; each run is fully described by its
train.py arguments (recorded in its train_log.json), so the chosen model can be
reproduced alone with `python tools/embedded/train.py <its args>`.

    PYTHONUNBUFFERED=1 python tools/embedded/sweep.py --out-dir models/embedded
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Two rounds were run, one GPU call each. Round 1 showed the longest run winning
# with validation loss still falling, so round 2 trains longer with more dropout.
# name -> extra train.py arguments
ROUNDS = {
    "round1": {
        "e6_d0.1": ["--epochs", "6", "--dropout", "0.1"],
        "e12_d0.1": ["--epochs", "12", "--dropout", "0.1"],
        "e20_d0.1": ["--epochs", "20", "--dropout", "0.1"],
        "e20_d0.2": ["--epochs", "20", "--dropout", "0.2"],
        "e40_d0.2": ["--epochs", "40", "--dropout", "0.2"],
        "e40_d0.3": ["--epochs", "40", "--dropout", "0.3"],
    },
    "round2": {
        "e60_d0.2": ["--epochs", "60", "--dropout", "0.2", "--eval-every", "100"],
        "e80_d0.25": ["--epochs", "80", "--dropout", "0.25", "--eval-every", "100"],
        "e100_d0.3": ["--epochs", "100", "--dropout", "0.3", "--eval-every", "100"],
    },
}
FILES = ["config.json", "model.safetensors", "generation_config.json", "train_log.json"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(HERE), help="where the chosen run's files are copied")
    ap.add_argument("--work-dir", default=".corpus/sweep")
    ap.add_argument("--max-seconds", type=float, default=270.0, help="per-run safety deadline")
    ap.add_argument("--round", default="round2", choices=sorted(ROUNDS))
    ap.add_argument("--only", nargs="*", default=None, help="run only these configs")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments passed to every run")
    args = ap.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    CONFIGS = ROUNDS[args.round]
    names = args.only or list(CONFIGS)
    procs = {}
    t0 = time.time()
    for name in names:
        run_dir = work / name
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-u", str(HERE / "train.py"), "--out-dir", str(run_dir),
               "--max-seconds", str(args.max_seconds), *CONFIGS[name], *extra]
        logf = open(run_dir / "stdout.log", "w")
        procs[name] = (subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT), logf, cmd)
        print(f"started {name}: {' '.join(cmd)}", flush=True)

    # Echo progress lines of every run while they train.
    offsets = {n: 0 for n in names}
    while any(p.poll() is None for p, _, _ in procs.values()):
        time.sleep(10)
        for n in names:
            text = (work / n / "stdout.log").read_text(errors="replace")
            new = text[offsets[n]:]
            offsets[n] = len(text)
            for line in new.splitlines():
                if line.startswith(("step", "device", "stopping")) or "Error" in line:
                    print(f"[{n}] {line}", flush=True)
    for n, (p, logf, _) in procs.items():
        logf.close()
        print(f"{n} exited with {p.returncode}", flush=True)

    results = []
    for n in names:
        log_path = work / n / "train_log.json"
        if procs[n][0].returncode != 0 or not log_path.exists():
            print(f"--- {n} failed; tail of its log:\n" + (work / n / "stdout.log").read_text()[-3000:])
            continue
        log = json.loads(log_path.read_text())
        results.append({
            "name": n,
            "args": CONFIGS[n] + extra,
            "val_loss": log["final"]["val_loss"],
            "train_loss": log["final"]["train_loss"],
            "best_val_loss": log["best_val_loss"],
            "best_val_step": log["best_val_step"],
            "steps": log["steps"],
            "stopped_early": log["stopped_early"],
            "train_wall_time_s": log["train_wall_time_s"],
            "samples": log["samples"],
            "curve": [{k: e[k] for k in ("step", "epoch", "lr", "train_loss", "val_loss", "elapsed_s")}
                      for e in log["curve"]],
        })
    if not results:
        sys.exit("no run finished")
    completed = [r for r in results if not r["stopped_early"]] or results
    best = min(completed, key=lambda r: r["val_loss"])
    summary = {"round": args.round, "chosen": best["name"], "criterion": "lowest final val_loss among completed runs",
               "runs_in_parallel": len(names), "sweep_wall_time_s": round(time.time() - t0, 1),
               "results": results}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        src = work / best["name"] / f
        if src.exists():
            shutil.copy2(src, out / f)
    (out / "sweep.json").write_text(json.dumps(summary, indent=2) + "\n")
    for r in results:
        print(f"{r['name']:>10}: final train {r['train_loss']:.4f} val {r['val_loss']:.4f} | best val "
              f"{r['best_val_loss']:.4f} @ step {r['best_val_step']} | {r['steps']} steps, "
              f"{r['train_wall_time_s']:.0f}s{' (stopped early)' if r['stopped_early'] else ''}")
    print(f"chosen: {best['name']} ({' '.join(best['args'])})")
    # Show the chosen run's samples.
    print((work / best["name"] / "stdout.log").read_text().split("Writing model")[0][-2500:])


if __name__ == "__main__":
    main()
