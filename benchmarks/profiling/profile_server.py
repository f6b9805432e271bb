"""Where a served request's time goes: py-spy on every process of a real server under load (issue 20).

    python -m benchmarks.profiling.profile_server --out-dir /tmp/prof                          # GPU, GPT-2 small
    python -m benchmarks.profiling.profile_server --server-args="--api-server-count 4" --out-dir /tmp/prof

Starts `python -m server` (random GPT-2 small unless --model), drives --concurrency closed-loop
streaming clients with benchmarks/serving/load_test.py (prompts 512 +- 128, outputs 256 +- 64, as the load
test), and once --warmup-s have passed samples each server process (the API processes and the
engine process) for --profile-s with `py-spy record --format raw --nonblocking` (needs py-spy:
`pip install py-spy`). For each process it reports the share of the time it was busy (py-spy
drops the samples of a thread waiting in a system call: epoll, a pipe, the device), and of that busy
time the top frames by self time and the share by area (uvicorn, starlette, fastapi, pydantic,
msgspec, server/api, server/bridge, server/engine, server/worker, torch, ...; "uvloop (C)" is the
event loop's own C code: socket I/O and scheduling callbacks). Writes <out-dir>/profile_<label>.json (a row per process) with the raw
profiles beside it, and prints a short table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from benchmarks.shared.common import ServerProcess  # noqa: E402

AREAS = ("uvicorn", "starlette", "fastapi", "pydantic", "msgspec", "httptools", "uvloop", "asyncio",
         "server/api", "server/bridge", "server/engine", "server/worker", "models", "kernels", "kvcache",
         "transformers", "tokenizers", "torch", "triton", "json", "multiprocessing")


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (no psutil on every machine)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def area(frame: str) -> str:
    if frame.startswith("Runner.run (asyncio/runners.py"):  # uvloop's loop in C: its own I/O and callbacks
        return "uvloop (C)"
    for a in AREAS:
        if f"{a}/" in frame or f"({a}" in frame or f"/{a}." in frame:
            return a
    return "other"


def summarize(raw: Path, expected: float, top: int = 15) -> dict:
    """Collapsed stacks ("f1;f2;...;leaf count" per line; py-spy keeps only samples where the
    thread was not waiting) -> busy share of `expected` samples, top self frames, areas."""
    self_time, by_area, total = Counter(), Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        leaf = stack.split(";")[-1]
        total += n
        self_time[leaf] += n
        by_area[area(leaf)] += n
    busy = max(total, 1)
    return {"samples": total, "busy_share": round(total / expected, 3),
            "top_self": [(f, round(c / busy, 4)) for f, c in self_time.most_common(top)],
            "areas": {a: round(c / busy, 4) for a, c in by_area.most_common()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: random GPT-2 small)")
    p.add_argument("--server-args", default="", help="extra `python -m server` arguments, one string")
    p.add_argument("--label", default=None, help="result file label (default: from --server-args)")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--warmup-s", type=float, default=6.0)
    p.add_argument("--profile-s", type=float, default=8.0)
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        p.error("py-spy is not installed (pip install py-spy)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = args.label or ("".join(c if c.isalnum() else "_" for c in args.server_args).strip("_") or "default")
    tmp = Path(tempfile.mkdtemp(prefix="flashpage-profile-"))
    model = args.model
    if model is None:
        from benchmarks.serving.compare import make_random_gpt2

        model = str(make_random_gpt2(tmp / "gpt2-small")[0])
    srv = ServerProcess.python_server(["--model", model, *args.server_args.split()], log_path=tmp / "server.log")
    result = {"date": datetime.date.today().isoformat(), "command": "python -m benchmarks.profiling.profile_server "
              + " ".join(argv if argv is not None else sys.argv[1:]), "concurrency": args.concurrency,
              "server_args": args.server_args, "processes": {}}
    try:
        srv.wait_healthy(600)
        from benchmarks.serving.compare import read_model_config
        from benchmarks.serving.load_test import run_load

        row = {}
        load = threading.Thread(target=lambda: row.update(run_load(
            srv.url, concurrency=args.concurrency, duration=args.warmup_s + args.profile_s + 2, grace=2,
            input_len=512, input_jitter=128, output_len=256, output_jitter=64, warmup=8, progress=False,
            vocab_size=read_model_config(model)["vocab_size"])))
        load.start()
        time.sleep(args.warmup_s)
        procs = {"server": srv.pid, **{f"pid{k}": k for k in children(srv.pid)}}
        spies = {name: subprocess.Popen([py_spy, "record", "-p", str(pid), "-d", str(int(args.profile_s)), "-r",
                                         str(args.rate), "-f", "raw", "--nonblocking", "-o",
                                         str(out / f"profile_{label}_{name}.txt")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for name, pid in procs.items()}
        for name, spy in spies.items():
            _, err = spy.communicate(timeout=args.profile_s + 60)
            raw = out / f"profile_{label}_{name}.txt"
            cmd = Path(f"/proc/{procs[name]}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            expected = args.rate * int(args.profile_s)
            result["processes"][name] = ({"cmdline": cmd[:200], **summarize(raw, expected)} if raw.exists() else
                                         {"cmdline": cmd[:200], "error": err.decode(errors="replace")[-500:]})
        load.join()
        result["load"] = {k: row.get(k) for k in ("output_tokens_per_s", "ttft_p50_ms", "itl_p99_ms", "tpot_p50_ms",
                                                  "errors", "completed")}
    finally:
        srv.stop(60)
        shutil.rmtree(tmp, ignore_errors=True)
    import torch
    import triton

    result.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  torch=torch.__version__.split("+")[0], triton=triton.__version__)
    # the shared shape of a result file (tests/benchmarks/test_report.py): one row per process
    result["rows"] = [{"impl": "flashpage", "server_args": args.server_args, "process": name, **info}
                      for name, info in result.pop("processes").items()]
    path = out / f"profile_{label}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{label}: load {result.get('load')}")
    for info in result["rows"]:
        name = info["process"]
        if "error" in info:
            print(f"  {name}: py-spy failed: {info['error'][-200:]}")
            continue
        areas = ", ".join(f"{a} {100 * s:.0f}%" for a, s in list(info["areas"].items())[:6])
        print(f"  {name} ({info['cmdline'][-40:]}): busy {100 * info['busy_share']:.0f}% of the time; by area: {areas}")
        for frame, share in info["top_self"][:6]:
            print(f"      {100 * share:5.1f}%  {frame[:110]}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
