"""Small helpers shared by the benchmarks (load_test.py, naive_server.py, compare.py, soak.py, the
bench_*.py result files) and by the tests that start real servers.

Standard library only (plus httpx for the health poll), so importing it costs nothing.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def gpu_slug(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; 'cpu' -> 'cpu' (same rule as bench_prefill.py)."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name.upper().replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")).lower()


def gpu_run_info(module: str, argv: list[str] | None, device: str = "cuda") -> dict:
    """device, torch, triton, date, command (`python -m <module> <argv>`): the head of an offline GPU
    benchmark's result file (device "cpu" where `device` is not CUDA: a benchmark's CPU path)."""
    import datetime

    import torch
    import triton

    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return dict(device=name, torch=torch.__version__.split("+")[0], triton=triton.__version__,
                date=datetime.date.today().isoformat(),
                command=f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]))


def write_result(result: dict, out_dir: str | os.PathLike, prefix: str) -> Path:
    """`result` as JSON to <out_dir>/<prefix>_<gpu slug of result["device"]>.json; returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{prefix}_{gpu_slug(result['device'])}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


_HANDED_OUT: set[int] = set()  # the ports free_port gave this process
PORT_BASE, PORTS_PER_WORKER = 20000, 1000  # free_port's ranges: one a pytest-xdist worker (a plain run: the first)


def free_port() -> int:
    """A loopback port nothing is bound to now, never one this process was given before, from a range
    of its own for each pytest-xdist worker (below Linux's ephemeral ports, where bind(0) and
    clients' sockets take theirs). Why: bind(0) once gave two servers started back to back the same
    port (a CI run, 2026-11-28); the second to load its model failed to bind, and until then the first
    answered its /health, so its tests ran on the other server."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    lo = PORT_BASE + PORTS_PER_WORKER * (int(worker) % 10 if worker.isdigit() else 0)
    for port in random.sample(range(lo, lo + PORTS_PER_WORKER), PORTS_PER_WORKER):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken (or lingering): another
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {lo}..{lo + PORTS_PER_WORKER - 1}")


def wait_for_report(ranks, out, timeout: float, poll: float = 1.0):
    """The next item a group of spawned ranks (multiprocessing Processes) puts on `out`;
    RuntimeError as soon as a rank has exited with an error (the others then wait in a collective
    that never completes; looked at every `poll` seconds) or after `timeout` seconds."""
    import queue

    deadline = time.monotonic() + timeout
    while True:
        try:
            return out.get(timeout=poll)
        except queue.Empty:
            codes = [p.exitcode for p in ranks]
            if any(codes) or time.monotonic() > deadline:
                raise RuntimeError(f"no report from the ranks (exit codes {codes})") from None


def replay_us(graph, ops: int, reps: int) -> float:
    """Median device microseconds of one of the `ops` operations a captured CUDA graph holds, over
    `reps` timed replays (CUDA events around each)."""
    import statistics

    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / ops)
    return statistics.median(times)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an already sorted list; q in [0, 100]."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p90, p99 of `values` times `scale` (None when there are no values)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(values)
    out = {"mean": sum(v) / len(v) * scale}
    for q in (50, 90, 99):
        out[f"p{q}"] = percentile(v, q) * scale
    return out


class ServerProcess:
    """A server subprocess on loopback; `wait_healthy` polls GET /health, `stop` signals and reaps it.

    Its output (stdout and stderr) goes to `log_path`, or, with no log_path, into `lines` (a list that
    a thread fills as the server writes, so a chatty server never blocks on a full pipe); with
    `stdout_path` only stderr goes to the log and stdout to that file (nginx: its access log).
    `env` is the whole environment (default: this process's), `extra_env` is added on top.

    Started in its own process group so that `stop` can signal the whole group (uvicorn and any
    worker it spawns) without touching anything else."""

    def __init__(self, cmd: list[str], port: int, log_path: str | os.PathLike | None = None, env: dict | None = None,
                 cwd: str | os.PathLike = REPO_ROOT, *, extra_env: dict | None = None,
                 stdout_path: str | os.PathLike | None = None) -> None:
        self.cmd, self.port = cmd, port
        self.log_path = None if log_path is None else Path(log_path)
        self.addr = f"127.0.0.1:{port}"
        self.url = f"http://{self.addr}"
        env = {**(os.environ if env is None else env), **(extra_env or {})}
        # `python -m server` and `benchmarks.*` are found from the repo root; keep whatever the caller
        # put on PYTHONPATH (e.g. carried fastapi/uvicorn wheels) after it.
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.lines: list[str] = []
        self._files = [open(path, "w") for path in (log_path, stdout_path) if path is not None]
        if log_path is None:
            out = err = subprocess.PIPE
        else:
            err = self._files[0]
            out = self._files[1] if stdout_path is not None else err
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out is err else err, text=True,
                                     cwd=str(cwd), env=env, start_new_session=True)
        self._drain = None
        if log_path is None:
            self._drain = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                           daemon=True)
            self._drain.start()

    @classmethod
    def python_server(cls, args: list[str], log_path: str | os.PathLike | None = None, **kw) -> "ServerProcess":
        """`python -m server --host 127.0.0.1` on a free port with `args` (and `--log-level warning`
        unless `args` give one); `kw` as for the constructor."""
        port = free_port()
        cmd = python_cmd("-m", "server", "--host", "127.0.0.1", "--port", str(port), *args)
        if "--log-level" not in args:
            cmd += ["--log-level", "warning"]
        return cls(cmd, port, log_path, **kw)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        """Everything the server wrote so far (to the log file, or into `lines`)."""
        if self.log_path is None:
            if self._drain is not None and self.proc.poll() is not None:
                self._drain.join(timeout=5)  # the rest of its output, now that it has exited
            return "".join(self.lines)
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def wait_healthy(self, timeout: float = 600.0) -> "ServerProcess":
        """Poll GET /health until it answers 200 (returns self); RuntimeError, the server stopped,
        if it exits first or `timeout` s pass."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 45.0, sig: int = signal.SIGTERM, must_exit: bool = False) -> int | None:
        """Send `sig` (SIGTERM: uvicorn shuts down gracefully) to the process group, wait up to
        `timeout` s, then SIGKILL it; returns the exit code. must_exit: raise subprocess.TimeoutExpired
        (after the kill) when `sig` alone did not end it."""
        timed_out = None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired as e:
                timed_out = e
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        for f in self._files:
            f.close()
        if timed_out is not None and must_exit:
            raise timed_out
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, *args]
