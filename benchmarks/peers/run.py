"""vLLM and flashpage side by side on one GPU (or on N, --tensor-parallel-size): the same checkpoints, flags, prompts and clients.

  python benchmarks/peers/run.py --workloads offline batch1 --out-dir $OUT
  python benchmarks/peers/run.py --workloads offline:llama-3.1-8b.fp8-dynamic batch1:llama-3.1-8b.awq --out-dir $OUT
  python benchmarks/peers/run.py --workloads offline:llama-3.1-8b long http prefix structured --out-dir $OUT
  python benchmarks/peers/run.py --workloads offline batch1 http --estimate      # minutes, nothing run
  python benchmarks/peers/run.py --workloads offline:llama-3.1-8b --profile --out-dir $OUT  # where each one's time goes
  python benchmarks/peers/run.py --workloads batch1:llama-3.1-70b offline:llama-3.1-70b --tensor-parallel-size 4 \
      --load-format dummy --out-dir $OUT                                          # four GPUs, no weight files

A workload may name its shapes (`offline:qwen3-0.6b,llama-3.2-1b`); without, it runs its default
ones (benchmarks/peers/workloads.py). Needs vLLM's site unpacked (benchmarks/peers/fetch/unpack_vllm.sh,
VLLM_SITE=/tmp/vllm-site) and the flashpage server's wheels on PYTHONPATH. Random checkpoints at
the shapes' real sizes are made once under --ckpt-root (both engines load the same directory).
For each merged job, flashpage runs first, then vLLM, each in its own process(es); a failure of one
engine is recorded in its rows (with the end of its log) and the other still runs.

Writes `<out-dir>/peers_<workload>_<shape>_<gpu>.json` after every job; the engines' logs, vLLM's
client's own result files and the jobs' rows go to --log-dir, and with --logs-tar into one archive
(a device call brings back at most 8 files). `python -m benchmarks.make_report` renders the committed
files into docs/benchmarks.md. `--checkpoints-only` makes the selection's checkpoints and stops (a call that
carries the first part of vLLM has nothing else to run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

# not this file's folder first (its modules are named run, report, engines...): the repository root
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.shared.common import gpu_slug, write_result  # noqa: E402
from benchmarks.peers.engines import ENGINES, REPO_ROOT, engine_env, versions  # noqa: E402
from benchmarks.peers.workloads import (DEFAULT_SHAPES, DUMMY_SHAPES, HTTP_CLIENTS, WORKLOADS, Job,  # noqa: E402
                                        estimate_minutes, jobs_for, merge_jobs, split_shape)


def parse_selection(items: list[str]) -> list[tuple[str, str]]:
    """["offline:a,b", "http"] -> [("offline", "a"), ("offline", "b"), ("http", <its default shape>)]."""
    out = []
    for item in items:
        workload, _, shapes = item.partition(":")
        if workload not in WORKLOADS:
            raise SystemExit(f"unknown workload {workload!r} (choose from {', '.join(WORKLOADS)})")
        for shape in shapes.split(",") if shapes else DEFAULT_SHAPES[workload]:
            try:
                split_shape(shape)
            except ValueError as e:
                raise SystemExit(str(e)) from None
            out.append((workload, shape))
    return out


def device_name() -> str:
    """The GPU's name from nvidia-smi (this process never initialises CUDA: the engines need it all)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        return out[0] if out else "cpu"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def ensure_checkpoint(shape: str, root: Path, log_dir: Path, dummy: bool = False) -> Path:
    """A random checkpoint of `shape` under root/shape (made on the GPU in a process of its own, once);
    a quantized shape's (`<shape>.<format>`) is benchmarks/quant/quant_checkpoint.py's copy of the 16-bit
    one (its quantization_config written by compressed-tensors: the server's wheels on PYTHONPATH, as
    benchmarks/gpu_session.sh or unpack_vllm.sh leave them in /tmp/site); `dummy`: config.json and the
    tokenizer alone (--load-format dummy), under root/<shape>-config."""
    base, fmt = split_shape(shape)
    if dummy:
        if fmt:
            raise SystemExit(f"{shape}: --load-format dummy makes 16-bit weights; a quantized shape needs its files")
        from benchmarks.shared.checkpoint import make_config_only_llama

        return make_config_only_llama(root / f"{shape}-config", shape)
    if shape in DUMMY_SHAPES:
        raise SystemExit(f"{shape}: served with --load-format dummy only (no weight files are written for it)")
    path = root / shape
    if (path / ".complete").exists():
        return path
    if fmt:
        code = ("import sys; from benchmarks.quant.quant_checkpoint import quantize_checkpoint; "
                "quantize_checkpoint(sys.argv[3], sys.argv[1], sys.argv[2], device='cuda', dequantized=False)")
        args = [fmt, str(ensure_checkpoint(base, root, log_dir))]
    else:
        code = ("import sys; from benchmarks.shared.checkpoint import make_random_llama; "
                "make_random_llama(sys.argv[1], sys.argv[2], device='cuda')")
        args = [shape]
    log_path = log_dir / f"checkpoint_{shape}.log"
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, "-c", code, str(path), *args], cwd=REPO_ROOT,
                              env=engine_env("flashpage"), stdout=log, stderr=subprocess.STDOUT, timeout=900)
    if done.returncode:
        raise SystemExit(f"making the {shape} checkpoint failed (exit {done.returncode}):\n{log_tail(log_path)}")
    (path / ".complete").write_text("")
    return path


def wait_gpu_free(limit_mib: int = 2048, timeout: float = 60.0) -> None:
    """Until every GPU this process may use has less than `limit_mib` in use: the engine before may
    still be exiting. nvidia-smi ignores CUDA_VISIBLE_DEVICES, so it is asked for those GPUs by id
    (runs side by side on one host's GPUs must not wait on each other's engines)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
           *(["--id=" + visible] if visible else [])]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.split()
        except (OSError, subprocess.SubprocessError):
            return
        try:
            if not out or max(int(x) for x in out) < limit_mib:
                return
        except ValueError:  # not a reading ([N/A], an error message): nothing to wait on
            return
        time.sleep(1)


def kill_tree(p: subprocess.Popen) -> None:
    """End `p` and every process under it, if any are left."""
    import psutil

    try:
        children = psutil.Process(p.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for proc in [*children, p]:
        try:
            proc.kill()
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    p.wait()


def log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def rows_path(log_dir: Path, job: Job, engine: str) -> Path:
    """Where one engine's offline process writes its rows for `job` (kept in the log dir)."""
    return log_dir / f"rows_{job.shape}_{job.flags.max_model_len}_{engine}.json"


EXIT_GRACE_S = 30.0  # how long an offline process that has written every row may take to exit


def wait_offline(p: subprocess.Popen, rows: Path, tasks: int, timeout: float) -> tuple[int | str, bool]:
    """(exit code or why there is none, whether it was still exiting EXIT_GRACE_S after its last row):
    a process whose rows are all written is not waited on for long, whatever hangs in its exit."""
    deadline, done_at = time.monotonic() + timeout, None
    while True:
        try:
            return p.wait(timeout=1.0), False
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if done_at is None and rows.exists():
            try:
                if len(json.loads(rows.read_text())["rows"]) >= tasks:
                    done_at = now
            except (ValueError, KeyError):
                pass  # being written
        if done_at is not None and now - done_at > EXIT_GRACE_S:
            return 0, True
        if now > deadline:
            return f"timeout after {timeout:.0f} s", False


def profile_env(engine: str) -> dict:
    """--profile: the offline process profiles one more run of each throughput task
    (benchmarks/peers/offline.py), and vLLM runs its engine core in that process, where the profiler
    sees its kernels (its default is a process of its own)."""
    from benchmarks.peers.offline import PROFILE_ENV

    return {PROFILE_ENV: "1", **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if engine == "vllm" else {})}


def run_offline(job: Job, engine: str, model: Path, out_dir: Path, timeout: float, profile: bool = False) -> dict:
    """One engine's offline tasks in its own process; {"rows", "versions", "device", "init_s"} (or an error row)."""
    tag = f"{job.shape}_{job.flags.max_model_len}_{engine}"
    spec = out_dir / f"job_{tag}.json"
    out = rows_path(out_dir, job, engine)
    spec.write_text(json.dumps(dict(engine=engine, model=str(model), flags=job.flags.record(), tasks=job.tasks)))
    log = out_dir / f"offline_{tag}.log"
    with open(log, "w") as f:
        # in this process's group (a device call that is cut short ends it too), ended with its children
        # (vLLM's engine core) on a timeout or a SIGTERM of this process
        p = subprocess.Popen([sys.executable, "-m", "benchmarks.peers.offline", str(spec), str(out)], cwd=REPO_ROOT,
                             env=engine_env(engine) | (profile_env(engine) if profile else {}),
                             stdout=f, stderr=subprocess.STDOUT)
        try:
            code, exit_hung = wait_offline(p, out, len(job.tasks), timeout)
        finally:
            kill_tree(p)
    spec.unlink()  # the prompts: large, and drawn again from their seeds
    got = json.loads(out.read_text()) if out.exists() else {"rows": []}
    if exit_hung:  # every row is in: recorded, not an error (the 70B TP=4 run of 2026-11-28 waited 6 min)
        got["exit_hung_s"] = EXIT_GRACE_S
    done = {r["task"] for r in got["rows"]}
    if code != 0:  # the tasks it did not finish get an error row each
        got["rows"] += [dict(engine=engine, task=t["name"], workload=t["workload"],
                             error=f"exit {code}:\n{log_tail(log)}") for t in job.tasks if t["name"] not in done]
    return got


def run_job(job: Job, engines: list[str], model: Path, out_dir: Path, timeout: float,
            profile: bool = False) -> dict[str, dict]:
    """Both engines on one job: {engine: {"rows", "versions", ...}}."""
    from benchmarks.peers.serving import serve_and_measure

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]  # our client's prompt ids
    got = {}
    for engine in engines:
        t0 = time.perf_counter()
        try:
            if job.kind == "offline":
                got[engine] = run_offline(job, engine, model, out_dir, timeout, profile)
            else:
                got[engine] = serve_and_measure(engine, str(model), job.flags, job.levels, out_dir, vocab,
                                                tag=f"{job.shape}_{engine}")
                got[engine]["versions"] = versions(engine)
                for r in got[engine]["rows"]:
                    r["workload"] = job.level_workload[r["level"]]
        except Exception as e:  # noqa: BLE001 -- the other engine still runs; the error is the result
            log = out_dir / f"{job.shape}_{engine}_server.log"
            got[engine] = {"rows": [dict(engine=engine, workload=w, error=f"{type(e).__name__}: {e}\n{log_tail(log)}")
                                    for w in job_workloads(job)],
                           "versions": versions(engine)}
        print(f"== {job.kind} {job.shape} {engine}: {time.perf_counter() - t0:.0f} s", flush=True)
        wait_gpu_free()
        for r in got[engine]["rows"]:
            r.setdefault("impl", engine)
    return got


def job_workloads(job: Job) -> list[str]:
    return sorted({t["workload"] for t in job.tasks} | set(job.level_workload.values()))


def write_results(job: Job, got: dict[str, dict], out_dir: Path, head: dict, profile: bool = False) -> list[Path]:
    """One file per workload of the job: both engines' rows, flags, versions, device, date, command
    (peers_*; a --profile run's, an experiment, profile_peers_*)."""
    prefix = "profile_peers" if profile else "peers"
    paths = []
    for workload in job_workloads(job):
        rows = [r for eng in got.values() for r in eng["rows"] if r.get("workload") == workload]
        if not rows:
            continue
        engines = {e: {k: v for k, v in g.items() if k != "rows"} for e, g in got.items()}
        result = dict(head, workload=workload, shape=job.shape, flags=job.flags.record(), engines=engines,
                      model=(f"{job.shape} shape, random weights made by each engine (--load-format dummy), "
                             if job.flags.load_format == "dummy" else
                             f"random-initialised {job.shape} shape (benchmarks/shared/checkpoint.py), ") + "bfloat16, "
                            "the embedded model's tokenizer", rows=rows)
        tp = f"_tp{job.flags.tensor_parallel_size}" if job.flags.tensor_parallel_size > 1 else ""
        paths.append(write_result(result, out_dir, f"{prefix}_{workload}_{job.shape}{tp}"))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", required=True, metavar="WORKLOAD[:SHAPE,...]",
                    help=f"of {', '.join(WORKLOADS)}")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--clients", type=int, nargs="+", default=list(HTTP_CLIENTS), help="http: the client counts")
    ap.add_argument("--api-server-count", type=int, default=None,
                    help="http, prefix: API processes of both servers (default: flashpage's default for this "
                         "host, 4 on 16 cores, for both: vLLM's own is 1)")
    ap.add_argument("--vllm-args", default="", help="http, prefix: more `vllm serve` flags (one string)")
    ap.add_argument("--flashpage-args", default="", help="http, prefix: more `python -m server` flags (one string)")
    ap.add_argument("--ckpt-root", default="/tmp/peers-ckpt", help="random checkpoints, made once, kept here")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--log-dir", default="/tmp/peers-logs")
    ap.add_argument("--logs-tar", default=None, metavar="PATH", help="at the end, the log dir as one .tar.gz here")
    ap.add_argument("--checkpoints-only", action="store_true", help="make the selection's checkpoints, run nothing")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="both engines split each model over this many GPUs")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="dummy: both engines make random weights from config.json (no weight files written)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for one engine's offline process")
    ap.add_argument("--estimate", action="store_true", help="print the estimated H100 minutes and exit")
    ap.add_argument("--profile", action="store_true",
                    help="offline workloads: one more run of each throughput task under torch.profiler, both "
                         "engines (vLLM's engine core in-process), written as profile_peers_<workload>_<shape>_<gpu>.json "
                         "(an experiment: its throughput rows are vLLM's in-process figures)")
    ap.add_argument("--from-rows", default=None, metavar="LOG_DIR",
                    help="run nothing: write the selection's result files from the rows a run left in its log dir")
    args = ap.parse_args(argv)
    args.argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    selection = parse_selection(args.workloads)
    print(f"estimated {estimate_minutes(selection)} min on an H100 for {len(selection)} workload-shapes", flush=True)
    if args.estimate:
        return 0
    if args.from_rows:
        return rebuild_from_rows(args, selection, Path(args.out_dir), Path(args.from_rows))
    if args.profile and any(w in ("http", "prefix") for w, _ in selection):
        raise SystemExit("--profile profiles offline workloads only (http and prefix serve through processes of their own)")
    # `timeout -s TERM` around a device call: stop the servers and engines, keep what was written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out_dir, root, logs = Path(args.out_dir), Path(args.ckpt_root), Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    if args.checkpoints_only:
        for shape in dict.fromkeys(s for _, s in selection):
            t0 = time.perf_counter()
            path = ensure_checkpoint(shape, root, logs, args.load_format == "dummy")
            print(f"{path} in {time.perf_counter() - t0:.0f} s", flush=True)
        return 0
    try:
        return run_selection(args, selection, out_dir, root, logs)
    finally:
        if args.logs_tar:
            import tarfile

            with tarfile.open(args.logs_tar, "w:gz") as tar:
                tar.add(logs, arcname="peers-logs")


def merged_jobs(args, selection: list[tuple[str, str]], shape: str, vocab: int) -> list[Job]:
    """The selection's jobs on `shape`, merged (one start of each engine per job), with the run's flags."""
    jobs = [j for w, s in selection if s == shape for j in jobs_for(w, s, vocab, args.clients)]
    for job in jobs:
        job.flags = replace(job.flags, tensor_parallel_size=args.tensor_parallel_size, load_format=args.load_format)
    merged = merge_jobs(jobs)
    for job in merged:
        if job.kind == "serve":
            from server.api.servers import default_api_server_count

            job.flags = replace(job.flags, api_server_count=args.api_server_count or default_api_server_count(),
                                vllm_args=tuple(shlex.split(args.vllm_args)),
                                flashpage_args=tuple(shlex.split(args.flashpage_args)))
    return merged


def rebuild_from_rows(args, selection: list[tuple[str, str]], out_dir: Path, rows_dir: Path) -> int:
    """--from-rows: the result files of a run whose own files did not come back (a device call brings
    back at most 8), from the rows_*.json its log dir kept (--logs-tar): offline jobs only (a serving
    job's rows are not kept there). Device and versions are the rows', the date their files' time."""
    from benchmarks.shared.checkpoint import LLAMA_SHAPES

    # the command as run, without the option that made this one a rebuild
    argv = [a for a in args.argv if not a.startswith("--from-rows=")]
    if "--from-rows" in argv:
        del argv[argv.index("--from-rows"):argv.index("--from-rows") + 2]
    written = 0
    for shape in dict.fromkeys(s for _, s in selection):
        vocab = LLAMA_SHAPES[split_shape(shape)[0]]["vocab_size"]
        for job in merged_jobs(args, selection, shape, vocab):
            files = {e: rows_path(rows_dir, job, e) for e in args.engines}
            files = {e: f for e, f in files.items() if f.exists()}
            if job.kind != "offline" or not files:
                print(f"{job.kind} job on {job.shape}: no rows in {rows_dir}", flush=True)
                continue
            got = {e: json.loads(f.read_text()) for e, f in files.items()}
            first = next(iter(got.values()))
            head = dict(device=first["device"], torch=first["versions"]["torch"].split("+")[0],
                        triton=first["versions"]["triton"],
                        date=datetime.date.fromtimestamp(max(f.stat().st_mtime for f in files.values())).isoformat(),
                        command="python -m benchmarks.peers.run " + " ".join(argv), rebuilt_from_rows=True)
            for path in write_results(job, got, out_dir, head, args.profile):
                print("wrote", path, flush=True)
                written += 1
    return 0 if written else 1


def run_selection(args, selection: list[tuple[str, str]], out_dir: Path, root: Path, logs: Path) -> int:
    import torch
    import triton

    head = dict(device=device_name(), torch=torch.__version__.split("+")[0], triton=triton.__version__,
                date=datetime.date.today().isoformat(),
                command="python -m benchmarks.peers.run " + " ".join(args.argv))
    failed = False
    for shape in dict.fromkeys(s for _, s in selection):  # shapes in the order given
        model = ensure_checkpoint(shape, root, logs, args.load_format == "dummy")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]  # the prompts' ids are below it
        for job in merged_jobs(args, selection, shape, vocab):
            got = run_job(job, args.engines, model, logs, args.timeout, args.profile)
            failed |= any("error" in r for g in got.values() for r in g["rows"])
            for path in write_results(job, got, out_dir, head, args.profile):
                print("wrote", path, flush=True)
    print(f"device {head['device']} ({gpu_slug(head['device'])})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
