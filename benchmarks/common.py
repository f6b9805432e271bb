"""Small helpers shared by the HTTP benchmarks (load_test.py, naive_server.py, compare.py).

Standard library only (plus httpx for the health poll), so importing it costs nothing.
"""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def gpu_slug(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; 'cpu' -> 'cpu' (same rule as bench_prefill.py)."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name.upper().replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")).lower()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """A server subprocess whose output goes to a log file; `wait_healthy` polls GET /health.

    Started in its own process group so that `stop` can signal the whole group (uvicorn and any
    worker it spawns) without touching anything else."""

    def __init__(self, cmd: list[str], port: int, log_path: str | os.PathLike, env: dict | None = None,
                 cwd: str | os.PathLike = REPO_ROOT) -> None:
        self.cmd, self.port, self.log_path = cmd, port, Path(log_path)
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ if env is None else env)
        # `python -m server` and `benchmarks.*` are found from the repo root; keep whatever the caller
        # put on PYTHONPATH (e.g. carried fastapi/uvicorn wheels) after it.
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(cwd), env=env,
                                     start_new_session=True)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 45.0) -> int | None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)  # SIGTERM: uvicorn shuts down gracefully
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, 9)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, *args]
