"""Bookkeeping of benchmarks/serving/compare.py's runs: which server runs at which client counts (`plan`,
`server_command`), the server limits those counts need, the result file several runs add up to
(`merge`, `add_row`), and the offline reference (`read_offline`).

Two kinds of run share one result file (load_<gpu>.json):
- the impl sweep (the default): each of --impls at each --concurrency level, as many levels as the
  impl's cap allows (`--impl-max-concurrency`: the peers sdpa, eager and naive_hf are about ten
  times slower than triton and are cut at --duration anyway, so by default they stop at 256
  clients, where triton goes on to 512 and 1024). Its rows have no `api_server_count`.
- the API-process sweep (`--api-server-counts 1 2 4`): the triton server once per N, started with
  `--api-server-count N` (N API processes sharing one listening socket in front of one engine
  process), at --concurrency (default 256). Its rows carry `api_server_count: N`; its settings and
  command are kept under the file's `api_sweep`.

A GPU command may run for 10 minutes at most, so the parts are usually run one after another with
`--merge` (on by default for the API sweep): the file's rows are kept, a row measured again
replaces the old one with the same (impl, api_server_count, concurrency), and `command` becomes the
commands joined by ` && `, a recipe for the whole file.

More clients than `--max-num-seqs` (256) wait in the engine's queue, which answers 503 past
`--max-waiting-requests` (512) and past `--max-connections` (2048) open connections: so that the
1024 level measures that wait rather than 503s, a flashpage server whose largest level exceeds those
defaults is started with room for every client (`server_room_args`), unless --server-args set them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


# `python -m server` defaults (server/config.py EngineConfig, server/api/guards.py ServerLimits);
# tests/benchmarks/test_load_test.py checks them against the server's.
SERVER_MAX_NUM_SEQS = 256
SERVER_MAX_WAITING = 4096
SERVER_MAX_CONNECTIONS = 2048
CONNECTION_HEADROOM = 256  # warm-up client, health polls, connections still closing after a cancel

API_SWEEP_CONCURRENCY = [256]
DEFAULT_IMPL_MAX_CONCURRENCY = {"sdpa": 256, "eager": 256, "naive_hf": 256}
# Settings that must agree for rows of several impl-sweep runs to share one table.
SHAPE_KEYS = ("input_len", "input_jitter", "output_len", "output_jitter", "num_requests", "requests_factor",
              "min_requests", "duration_s", "grace_s", "temperature", "ignore_eos")


def resolve_args(args, impls: tuple[str, ...], default_levels: list[int]) -> None:
    """compare.py's defaults that depend on the mode (impl sweep or API-process sweep), checked
    (ValueError says what is wrong)."""
    api = args.api_server_counts is not None
    if args.impls is None:
        args.impls = ["triton"] if api else list(impls)
    if args.concurrency is None:
        args.concurrency = list(API_SWEEP_CONCURRENCY if api else default_levels)
    if args.merge is None:
        args.merge = api
    args.impl_caps = parse_impl_caps(args.impl_max_concurrency, impls)
    if min(args.concurrency) < 1:
        raise ValueError("--concurrency levels must be >= 1")
    if api:
        if "naive_hf" in args.impls:
            raise ValueError("--api-server-counts runs flashpage servers: leave naive_hf out of --impls")
        if min(args.api_server_counts) < 1 or len(set(args.api_server_counts)) != len(args.api_server_counts):
            raise ValueError("--api-server-counts takes distinct counts >= 1")
        if _flag_value(args.server_args, "--api-server-count") is not None:
            raise ValueError("--api-server-counts sets --api-server-count itself: leave it out of --server-args")


def parse_impl_caps(items: list[str] | None, impls) -> dict[str, int]:
    """`["sdpa=256", "naive_hf=128"]` -> {"sdpa": 256, "naive_hf": 128}; None -> the defaults."""
    if items is None:
        return dict(DEFAULT_IMPL_MAX_CONCURRENCY)
    caps = {}
    for item in items:
        impl, sep, value = item.partition("=")
        if not sep or impl not in impls or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--impl-max-concurrency takes IMPL=C with IMPL in {', '.join(impls)} and C >= 1, "
                             f"not {item!r}")
        caps[impl] = int(value)
    return caps


def levels_for(impl: str, levels: list[int], caps: dict[str, int]) -> list[int]:
    cap = caps.get(impl)
    return [c for c in levels if cap is None or c <= cap]


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def server_room_args(max_level: int, server_args: list[str]) -> list[str]:
    """Flags that let a flashpage server hold `max_level` closed-loop clients without 503s: every
    client may wait (--max-waiting-requests >= clients) and keep its connection (--max-connections
    >= clients + headroom). Only what the defaults lack, and nothing --server-args already sets."""
    out = []
    if max_level > SERVER_MAX_WAITING and _flag_value(server_args, "--max-waiting-requests") is None:
        out += ["--max-waiting-requests", str(max_level)]
    if max_level + CONNECTION_HEADROOM > SERVER_MAX_CONNECTIONS and _flag_value(server_args, "--max-connections") is None:
        out += ["--max-connections", str(max_level + CONNECTION_HEADROOM)]
    return out


def max_num_seqs(server_args: list[str]) -> int:
    v = _flag_value(server_args, "--max-num-seqs")
    return int(v) if v and v.isdigit() else SERVER_MAX_NUM_SEQS


def server_command(impl: str, model: str, port: int, device: str | None, extra: list[str],
                   naive_max_batch: int = 256, naive_batch_wait_ms: float = 5.0) -> list[str]:
    dev = ["--device", device] if device else []
    if impl == "naive_hf":
        return [sys.executable, "-m", "benchmarks.serving.naive_server", "--model", str(model),
                "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(naive_max_batch),
                "--batch-wait-ms", str(naive_batch_wait_ms), "--log-level", "warning", *dev]
    if impl == "triton" and (device or "").startswith("cpu") and "--dtype" not in extra:
        dev += ["--dtype", "bfloat16"]  # the Triton kernels take fp16/bf16 only; CPU default is fp32
    return [sys.executable, "-m", "server", "--model", str(model), "--attention", impl, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *dev, *extra]


def level_seed(seed: int, level: int) -> int:
    """Each concurrency level draws its own prompts: repeating the last level's would turn them into
    prefix-cache hits for the configurations that have one and skip their prefill."""
    return seed + 10_007 * level


def requests_for(concurrency: int, args) -> int:
    if args.num_requests is not None:
        return args.num_requests
    return max(args.requests_factor * concurrency, args.min_requests)


def plan(impls: list[str], levels: list[int], caps: dict[str, int],
         api_server_counts: list[int] | None) -> list[tuple[str, int | None, list[int]]]:
    """The servers to start, in order: (impl, api_server_count or None, client counts)."""
    if api_server_counts:
        return [(impl, n, list(levels)) for impl in impls for n in api_server_counts]
    return [(impl, None, lv) for impl in impls if (lv := levels_for(impl, levels, caps))]


# ------------------------------------------------------------------------------- the result file
def row_key(row: dict) -> tuple:
    return row.get("impl"), row.get("api_server_count"), row.get("concurrency"), row.get("request_rate")


def add_row(result: dict, row: dict) -> None:
    """Append `row`, dropping an earlier row of the same (impl, api_server_count, concurrency)."""
    key = row_key(row)
    result["rows"] = [r for r in result["rows"] if row_key(r) != key] + [row]


def _ordered(items, order=None) -> list:
    items = list(dict.fromkeys(items))
    return sorted(items, key=lambda x: (order.index(x) if x in order else len(order), x)) if order else sorted(items)


def merge(old: dict, new: dict, runs: list[tuple[str, int | None, list[int]]], impl_order=None) -> dict:
    """`new` (this run's fresh result, no rows yet) on top of `old` (the file's): old rows kept, old
    failures of the servers this run starts again dropped. ValueError when they cannot share a file."""
    if old.get("device") != new["device"]:
        raise ValueError(f"the file is for {old.get('device')!r}, this run is on {new['device']!r}")
    if old.get("model") and old.get("model") != new.get("model"):
        raise ValueError(f"the file's model is {old.get('model')!r}, this run's {new.get('model')!r}")
    api = runs and runs[0][1] is not None
    out = dict(old)
    out["rows"] = list(old.get("rows", []))
    rerun = {(impl, n) for impl, n, _ in runs}
    out["failures"] = [f for f in old.get("failures", []) if (f.get("impl"), f.get("api_server_count")) not in rerun]
    out["command"] = " && ".join(c for c in (old.get("command"), new["command"]) if c)
    # When each server's rows were measured: a merged file holds runs of different days (and code).
    dates = dict(old.get("impl_dates") or
                 {r["impl"]: old.get("date") for r in old.get("rows", []) if not r.get("api_server_count")})
    if not api:
        dates.update({impl: new.get("date") for impl, _, _ in runs})
    out["impl_dates"] = dates
    if api:
        out["api_sweep"] = new["api_sweep"]
    else:
        s_old, s_new = old.get("settings") or {}, new["settings"]
        if s_old:
            differ = [k for k in SHAPE_KEYS if s_old.get(k) != s_new.get(k)]
            if differ:
                raise ValueError("settings differ from the file's: " + ", ".join(
                    f"{k} {s_old.get(k)!r} there, {s_new.get(k)!r} here" for k in differ))
        merged = {**s_old, **s_new}
        merged["concurrency"] = _ordered(s_old.get("concurrency", []) + s_new["concurrency"])
        merged["impls"] = _ordered(s_old.get("impls", []) + s_new["impls"], list(impl_order or []))
        out["settings"] = merged
    for k in ("offline",):
        if new.get(k):
            out[k] = new[k]
    return out


def read_offline(path: str | Path, device: str | None = None) -> dict:
    """The offline reference from a benchmarks/engine/bench_throughput.py result: our engine's (`flashpage`
    row) output tokens/s, with where it came from and its workload."""
    path = Path(path)
    res = json.loads(path.read_text())
    rows = [r for r in res.get("rows", []) if r.get("impl") == "flashpage" and r.get("output_tokens_per_s")]
    if not rows:
        raise ValueError(f"{path} has no flashpage output_tokens_per_s row (a bench_throughput.py result?)")
    if device and res.get("device") and res["device"] != device:
        raise ValueError(f"{path} was measured on {res['device']!r}, this run is on {device!r}")
    return {"output_tokens_per_s": rows[0]["output_tokens_per_s"], "source": path.name,
            "command": res.get("command"), "date": res.get("date"), "device": res.get("device"),
            "workload": res.get("workload")}
