"""The API process's cost per streamed event, without a model (issue #20). CPU only.

    python -m benchmarks.profiling.bench_api_events [--clients 64 256] [--routes generate completions]
        [--max-tokens 256] [--duration 8] [--repeat 3] [--baseline DIR] [--py-spy] [--out-dir DIR]

Runs the real server (create_app of server/api/app.py, served by server/api/lifecycle.serve as
`python -m server` serves it: uvicorn, uvloop, the connection guards) in a subprocess, over an
AsyncEngine whose core is synthetic: each "step" gives every active request one new token, as fast
as the API process takes them: the core is the real EngineClient (server/bridge/engine_process.py:
the output pipe read by `add_reader`, msgspec decode, text accumulation, one message per step)
attached to a synthetic engine process in place of engine_main. Its next step comes once the
streams the last one woke have run (counted in shared memory), so each token is an event of its
own (no merging) however busy the machine is.

K clients (`--clients`) in a separate process (raw asyncio sockets, so that neither their CPU nor
an HTTP library's counts against the server) stream closed-loop on keep-alive connections. Over
each measured window (after `--warmup`) the client process counts SSE events (`data: ` lines, the
final event and [DONE] included) and tokens, and reads the server process's CPU time (user +
system, /proc): events/s, tokens/s, and server CPU-µs per event (the measure to compare: on a
shared machine events/s follows the neighbours' load). The engine process's CPU is reported apart.

`--baseline DIR` (another checkout, whose EngineClient takes (config, channel, process)) serves
the same synthetic engine from DIR's server code beside this one's, windows alternating between
the two so that both see the same neighbours; medians per tree and their ratio are printed.
`--py-spy` samples the server(s) for `--profile-s` more seconds after the last window of each
configuration (`pip install py-spy`) and prints the top frames by self and inclusive time and self
time by area. Results (CPU, versions, date, command, configs, rows, profiles) go to
<out-dir>/api_events_<label>.json, the raw profiles beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import fcntl
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from benchmarks.shared.common import REPO_ROOT, ServerProcess, free_port, python_cmd  # noqa: E402

MODEL = "synthetic"
VOCAB = 50000
WORD, TOKEN_ID = " qx", 4242  # every generated token; the client counts tokens as b"qx" in what it reads
ROUTES = {"generate": "/generate", "completions": "/v1/completions"}


# ------------------------------------------------------------------------------ server process
def _snapshot(running: int):
    from server.engine import EngineSnapshot

    return EngineSnapshot(running, 0, running, 0, 1 << 20, 1 << 20, 0, 0, 0, 0)


def _output(rid: str, state: list):
    """One step of request `rid` (state: [prompt tokens, max tokens, produced])."""
    from server.engine import RequestOutput

    state[2] += 1
    n = state[2]
    if n < state[1]:
        return RequestOutput(rid, WORD, [TOKEN_ID], False, None, state[0], n)
    return RequestOutput(rid, WORD, [TOKEN_ID], True, "length", state[0], n, text=WORD * n, token_ids=[TOKEN_ID] * n)


def _grow_pipe(conn) -> None:
    fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)  # as the engine's pipes are grown


def synthetic_engine(commands, out, acks) -> None:
    """The engine process of the pipe core: adds and aborts in, one StepOutputs per step out; the
    next step once the API process counted the last one taken (`acks`, in shared memory: a pipe
    write per step would cost the API process a wake-up of this one, no real engine asks for)."""
    from server.bridge.messages import AddRequest, EngineReady, StepOutputs, StopEngine, decode_down, encode

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _grow_pipe(out)
    from server.engine import RequestBounds

    out.send_bytes(encode(EngineReady(MODEL, 1 << 20, RequestBounds(VOCAB, 1 << 20, 16, 1 << 20, (0,)), _snapshot(0))))
    active: dict[str, list] = {}
    sent = 0  # steps sent
    try:
        while True:
            batches = [] if active else [commands.recv_bytes()]  # idle: sleep until a command comes
            if active and acks.value < sent:
                commands.poll(0.0001)  # the API process has not taken the last step yet
            while commands.poll():
                batches.append(commands.recv_bytes())
            for cmd in (c for b in batches for c in decode_down(b)):
                if isinstance(cmd, StopEngine):
                    return
                if isinstance(cmd, AddRequest):
                    active[cmd.request_id] = [len(cmd.prompt_token_ids), cmd.params.max_tokens, 0]
                else:
                    active.pop(cmd.request_id, None)
            if active and acks.value >= sent:
                outputs = [_output(rid, st) for rid, st in active.items()]
                for o in outputs:
                    if o.finished:
                        del active[o.request_id]
                out.send_bytes(encode(StepOutputs(outputs, [], [], _snapshot(len(active)))))
                sent += 1
    except (EOFError, OSError):
        return


def _ack(acks) -> None:
    acks.value += 1


def _pipe_core():
    """The real EngineClient (its API side: the output pipe read by `add_reader`, msgspec decode,
    text accumulation), attached to synthetic_engine in place of engine_main."""
    import server.bridge.engine_process as ep

    ctx = mp.get_context("spawn")
    cmd_reader, cmd_writer = ctx.Pipe(duplex=False)
    out_reader, out_writer = ctx.Pipe(duplex=False)
    acks = ctx.RawValue("q", 0)  # steps the API process has taken
    process = ctx.Process(target=synthetic_engine, args=(cmd_reader, out_writer, acks), daemon=True)
    process.start()
    for conn in (cmd_reader, out_writer):
        conn.close()

    class PipeCore(ep.EngineClient):
        def start(self, loop, deliver, die) -> None:
            super().start(loop, deliver, die)
            # uvloop's add_reader (libuv's uv_poll_init) makes the pipe non-blocking; recv_bytes then
            # raises EAGAIN (and the client declares the engine lost) when it catches a message over
            # 16 KiB, which multiprocessing writes as two writes, between them. Blocking again, the
            # read waits out the second write.
            os.set_blocking(self._out.fileno(), True)

        def _on_step(self, msg) -> None:
            super()._on_step(msg)
            # Taken once the streams woken by this step have run (they were scheduled first): each
            # step's token is then one event of its own, whatever else runs on this machine.
            asyncio.get_running_loop().call_soon(_ack, acks)

    saved = ep.load_tokenizer, ep.resolve_model_path
    ep.load_tokenizer = ep.resolve_model_path = lambda *a, **k: None  # no model: prompts are token ids
    try:
        return PipeCore(SimpleNamespace(model=None, log_stats_interval=0.0),
                        SimpleNamespace(commands=cmd_writer, out=out_reader), process)
    finally:
        ep.load_tokenizer, ep.resolve_model_path = saved


def serve_main(port: int, root: str | None) -> None:
    import gc

    if root:  # serve another checkout's server code (--baseline)
        sys.path.insert(0, str(Path(root).resolve()))

    from server.api.app import create_app
    from server.api.guards import ServerLimits
    from server.api.lifecycle import serve
    from server.bridge.async_engine import AsyncEngine
    from server.logs import setup_logging

    setup_logging("warning")
    limits = ServerLimits(shutdown_grace=0.5, max_waiting_requests=None)
    aengine = AsyncEngine(_pipe_core())
    app = create_app(aengine, limits)
    gc.collect()
    gc.freeze()  # as server/cli.py does
    try:
        code = serve(app, aengine, limits, host="127.0.0.1", port=port, log_level="warning", log_config=None,
                     access_log=False)
    finally:
        gc.unfreeze()
    sys.exit(code)


# ------------------------------------------------------------------------------ client process
def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class Tally:
    events = tokens = requests = errors = 0

    def snap(self) -> tuple:
        return self.events, self.tokens, self.requests, self.errors


async def _client(host: str, port: int, path: str, body: dict, first_tokens: int, tally: Tally, stop_at: float):
    reader, writer = await asyncio.open_connection(host, port)
    head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: "
    tokens = first_tokens  # the first request is shorter, so the clients do not run in lockstep
    try:
        while time.monotonic() < stop_at:
            data = json.dumps({**body, "max_tokens": tokens}).encode()
            writer.write(f"{head}{len(data)}\r\n\r\n".encode() + data)
            tokens = body["max_tokens"]
            status = await reader.readuntil(b"\r\n\r\n")
            if not status.startswith(b"HTTP/1.1 200"):
                tally.errors += 1
                print(status.decode(errors="replace"), file=sys.stderr)
                await asyncio.sleep(0.1)
                return
            while True:  # chunked transfer encoding: one chunk per body message the server sent
                size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                tally.events += chunk.count(b"data: ")
                tally.tokens += chunk.count(b"qx")
            tally.requests += 1
    finally:
        writer.close()


async def client_main(cfg: dict) -> dict:
    host, port, pid, engine_pid = "127.0.0.1", cfg["port"], cfg["server_pid"], cfg["engine_pid"]
    k, m = cfg["clients"], cfg["max_tokens"]
    body = ({"model": MODEL, "prompt": list(range(1, 33))} if cfg["route"] == "completions" else
            {"prompt_token_ids": list(range(1, 33))}) | {"stream": True, "ignore_eos": True, "max_tokens": m}
    tally = Tally()
    stop_at = time.monotonic() + cfg["warmup"] + cfg["duration"] + cfg["profile_s"]
    tasks = [asyncio.ensure_future(_client(host, port, ROUTES[cfg["route"]], body, 1 + (i * m) // k, tally, stop_at))
             for i in range(k)]
    await asyncio.sleep(cfg["warmup"])
    a, ca, ea, ra = tally.snap(), _cpu_s(pid), engine_pid and _cpu_s(engine_pid), time.process_time()
    ta = time.monotonic()
    await asyncio.sleep(cfg["duration"])
    b, cb, eb, rb = tally.snap(), _cpu_s(pid), engine_pid and _cpu_s(engine_pid), time.process_time()
    wall = time.monotonic() - ta
    events, tokens, requests, errors = (y - x for x, y in zip(a, b))
    row = {"route": cfg["route"], "clients": k, "max_tokens": m, "window_s": round(wall, 3),
           "events": events, "tokens": tokens, "requests": requests, "errors": errors,
           "events_per_s": events / wall, "tokens_per_s": tokens / wall, "tokens_per_event": tokens / max(events, 1),
           "server_cpu_s": cb - ca, "server_cpu_util": (cb - ca) / wall,
           "server_cpu_us_per_event": (cb - ca) / max(events, 1) * 1e6,
           "server_cpu_us_per_token": (cb - ca) / max(tokens, 1) * 1e6,
           "client_cpu_util": (rb - ra) / wall}
    if engine_pid:
        row["engine_cpu_util"] = (eb - ea) / wall
    if cfg["profile_s"]:
        await asyncio.to_thread(subprocess.run, [cfg["py_spy"], "record", "-p", str(pid), "-d", str(cfg["profile_s"]),
                                "-r", str(cfg["rate"]), "-f", "raw", "-o", cfg["profile_path"]],
                                stdout=subprocess.DEVNULL, check=False)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return row


def _run_client(cfg: dict) -> dict:
    import uvloop  # as the server's loop: the client's share of the machine stays small

    return uvloop.run(client_main(cfg))


# ------------------------------------------------------------------------------ profiles
_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>.*?)(?::\d+)?\)$")  # py-spy's "function (file:line)"
AREAS = ("starlette", "fastapi", "uvicorn", "anyio", "pydantic", "server/api", "server/bridge", "server/engine",
         "asyncio", "json", "msgspec", "multiprocessing", "logging")


def _frame(text: str) -> tuple[str, str]:
    m = _FRAME.match(text)
    fn, file = (m["fn"], m["file"]) if m else (text, "")
    file = re.sub(r"^.*?(site-packages/|lib/python3\.\d+/)", "", file)
    return fn, file.replace(str(REPO_ROOT) + "/", "")


def summarize_profile(path: Path, top: int = 20) -> dict:
    """Shares of samples by function (self and inclusive) and of self time by area, from py-spy's raw output."""
    self_c, incl_c, areas, total = Counter(), Counter(), Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            n, frames = int(count), [_frame(f) for f in stack.split(";")]
            total += n
            self_c[frames[-1]] += n
            areas[next((a for a in AREAS if a in frames[-1][1]), "other")] += n
            for f in set(frames):
                incl_c[f] += n

    def rows(c: Counter) -> list:
        return [{"function": fn, "file": file, "share": round(v / total, 4)} for (fn, file), v in c.most_common(top)]

    return {"samples": total, "self": rows(self_c), "inclusive": rows(incl_c),
            "areas": {k: round(v / total, 4) for k, v in areas.most_common()}}


def print_profile(name: str, prof: dict) -> None:
    print(f"\n-- py-spy: {name} ({prof['samples']} samples)\n   self by area: "
          + ", ".join(f"{k} {v:.0%}" for k, v in prof["areas"].items()))
    for kind in ("self", "inclusive"):
        print(f"   top {kind}:\n" + "\n".join(f"     {r['share']:6.1%}  {r['function']}  ({r['file']})"
                                          for r in prof[kind][:15 if kind == "self" else 25]))


# ------------------------------------------------------------------------------ driver
def _run_info(argv: list[str] | None) -> dict:
    from importlib.metadata import version

    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "cpu"
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    return {"device": cpu, "cpus": os.cpu_count(), "git": git.stdout.strip() or None,
            "torch": version("torch"), "triton": version("triton"),
            "versions": {"python": platform.python_version(), **{p: version(p) for p in (
                "fastapi", "starlette", "uvicorn", "uvloop", "httptools", "pydantic", "msgspec")}},
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "python -m benchmarks.profiling.bench_api_events " + " ".join(sys.argv[1:] if argv is None else argv)}


def _engine_pid(pid: int) -> int | None:
    """The synthetic engine process: the server's spawned child (not multiprocessing's resource tracker)."""
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    return None


def _line(row: dict) -> str:
    return (f"{row['tree']:8s} {row['route']:11s} K={row['clients']:3d}: {row['events_per_s']:6.0f} events/s "
            f"{row['tokens_per_s']:6.0f} tok/s, server {row['server_cpu_us_per_event']:5.1f} CPU-µs/event "
            f"(cpu {row['server_cpu_util']:.0%}, client {row['client_cpu_util']:.0%}"
            + (f", engine {row['engine_cpu_util']:.0%}" if "engine_cpu_util" in row else "")
            + f"), errors {row['errors']}")


def _summary(rows: list[dict]) -> list[dict]:
    """Per (tree, route, clients): the median of each measure over the repeats."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["tree"], r["route"], r["clients"]), []).append(r)
    return [{"tree": tree, "route": route, "clients": k, "repeats": len(rs),
             **{key: statistics.median(r[key] for r in rs) for key, v in rs[0].items()
                if isinstance(v, (int, float)) and key not in ("repeat", "clients", "max_tokens")}}
            for (tree, route, k), rs in groups.items()]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--routes", nargs="+", choices=list(ROUTES), default=list(ROUTES))
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of each measured window")
    ap.add_argument("--repeat", type=int, default=3, help="measured windows per configuration (medians reported)")
    ap.add_argument("--baseline", metavar="DIR", help="another checkout to compare with, windows alternating")
    ap.add_argument("--py-spy", action="store_true", help="profile each configuration after its last window")
    ap.add_argument("--profile-s", type=int, default=8)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--label", default="cpu", help="the result file is api_events_<label>.json")
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    ap.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # a server subprocess
    ap.add_argument("--root", help=argparse.SUPPRESS)  # its checkout
    args = ap.parse_args(argv)
    if args.serve:
        serve_main(args.serve, args.root)
        return {}
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if args.py_spy and not py_spy:
        ap.error("--py-spy: py-spy is not installed (pip install py-spy)")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {**_run_info(argv), "config": {k: v for k, v in vars(args).items() if k not in ("serve", "root")},
              "rows": [], "profiles": {}}
    servers = {}
    for tree, root in [("baseline", args.baseline)] * bool(args.baseline) + [("current", None)]:
        port = free_port()
        cmd = python_cmd("-m", "benchmarks.profiling.bench_api_events", "--serve", str(port))
        servers[tree] = ServerProcess(cmd + (["--root", root] if root else []), port)
    ctx = mp.get_context("spawn")
    try:
        for server in servers.values():
            server.wait_healthy(120)
        for route in args.routes:
            for k in args.clients:
                for rep in range(args.repeat):
                    for tree, server in servers.items():
                        name = f"{tree}_{route}_k{k}"
                        profile = args.py_spy and rep == args.repeat - 1
                        cfg = {"port": server.port, "server_pid": server.pid, "route": route, "clients": k,
                               "engine_pid": _engine_pid(server.pid), "max_tokens": args.max_tokens,
                               "warmup": args.warmup,
                               "duration": args.duration, "profile_s": args.profile_s if profile else 0,
                               "py_spy": py_spy, "rate": args.rate,
                               "profile_path": str(out_dir / f"api_events_{args.label}_{name}.txt")}
                        with ctx.Pool(1) as pool:
                            row = {"impl": "flashpage", "tree": tree, "repeat": rep, **pool.apply(_run_client, (cfg,))}
                        result["rows"].append(row)
                        print(_line(row), flush=True)
                        if profile and Path(cfg["profile_path"]).exists():
                            prof = result["profiles"][name] = summarize_profile(Path(cfg["profile_path"]))
                            print_profile(name, prof)
        result["summary"] = _summary(result["rows"])
        print("\nmedians over repeats:")
        for row in result["summary"]:
            base = next((b for b in result["summary"] if b["tree"] == "baseline" and row["tree"] == "current"
                         and (b["route"], b["clients"]) == (row["route"], row["clients"])), None)
            print(_line(row) + (f"  [{row['server_cpu_us_per_event'] / base['server_cpu_us_per_event'] - 1:+.0%} "
                                "CPU-µs/event vs baseline]" if base else ""))
    finally:
        for tree, server in servers.items():
            server.stop(timeout=10)
            tail = [line for line in server.log_text().splitlines() if "leaked" not in line and "nanobind" not in line]
            if tail:
                print(f"{tree} server log:\n" + "\n".join(tail[-30:]))
    path = out_dir / f"api_events_{args.label}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
