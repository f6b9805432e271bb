"""Load test flashpage (triton / sdpa / eager attention) and a naive transformers server, one GPU.

    python -m benchmarks.serving.compare                          # GPU: random GPT-2 small, full sweep
    python -m benchmarks.serving.compare --model /path/to/gpt2    # your checkpoint
    python -m benchmarks.serving.compare --device cpu --concurrency 1 2 --num-requests 4 \\
        --input-len 16 --output-len 8                     # CPU dry run (tiny random model)

For each configuration in turn it starts the server as a subprocess on the same device
(`python -m server --model M --attention X` for `triton`, `sdpa`, `eager`;
`python -m benchmarks.serving.naive_server --model M` for `naive_hf`), waits for `GET /health`, sends a
warm-up, runs the same closed-loop sweep with benchmarks/serving/load_test.py (C concurrent streaming
clients for each C in --concurrency; random prompt ids of --input-len +- --input-jitter tokens;
max_tokens --output-len +- --output-jitter with ignore_eos; greedy; at each level
max(--requests-factor x C, --min-requests) requests or --num-requests, cut at --duration s, with
in-flight requests cancelled --grace s later), stops the server, and moves on. The result file is
rewritten after every level, so a run cut short still leaves what it measured.

Levels run to 1024 clients, past the server's --max-num-seqs (256), so TTFT includes the wait for a
slot (the server gets room for every client: no 503s); the peers sdpa/eager/naive_hf stop at 256
(--impl-max-concurrency). `--api-server-counts 1 2 4` runs the API-process sweep instead (triton,
`--api-server-count N`, 256 clients); `--merge` adds a run's rows to the file (on by default for
that sweep), so the parts fit 10-minute device calls; `--offline-json` copies a bench_throughput.py
figure in as the offline reference. See benchmarks/serving/load_sweep.py:

    python -m benchmarks.serving.compare --impls triton sdpa && python -m benchmarks.serving.compare --impls eager naive_hf --merge
    python -m benchmarks.engine.bench_throughput --out-dir /tmp/off && python -m benchmarks.serving.compare \\
        --api-server-counts 1 2 4 --offline-json /tmp/off/throughput_gpt2_h100.json

Writes `<out-dir>/load_<gpu>.json` ({device, torch, triton, date, command, rows: [{impl,
concurrency, output_tokens_per_s, requests_per_s, ttft_p50_ms, ...}]}) and the plots
`load_<gpu>_throughput.png`, `load_<gpu>_latency.png` (and `load_<gpu>_api_servers.png` with an
API-process sweep). `report(result)` turns the JSON into the docs/benchmarks.md section. Metric definitions:
see benchmarks/serving/load_metrics.py.

With no --model, a random-initialised GPT-2 small (transformers.GPT2Config() defaults: 124M,
1024 positions, vocab 50257) is written to a temporary directory with the embedded model's
tokenizer (models/embedded; a small byte-level BPE is trained instead if that is missing). Random
weights cost the same to run as trained ones and ignore_eos fixes the output lengths. On
`--device cpu` the default is a tiny 2-layer model instead (`--model-size`), and the `triton`
server runs under TRITON_INTERPRET=1 in bfloat16 (the kernels take fp16/bf16 only): slow, but it
checks the whole path.

Needs torch, transformers, httpx, matplotlib here, and fastapi/uvicorn/pydantic importable by the
servers (PYTHONPATH is passed through to them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.shared.common import REPO_ROOT, ServerProcess, free_port, gpu_slug  # noqa: E402
from benchmarks.serving.load_metrics import print_row  # noqa: E402
from benchmarks.serving.load_plots import plot_result  # noqa: E402
from benchmarks.serving.load_report import IMPLS, report  # noqa: E402  (make_report.py and tests take report from here)
from benchmarks.serving.load_sweep import (API_SWEEP_CONCURRENCY, add_row, level_seed, max_num_seqs, merge,  # noqa: E402
                                   plan, read_offline, requests_for, resolve_args, server_command,
                                   server_room_args)
from benchmarks.serving.load_test import run_load  # noqa: E402

DEFAULT_CONCURRENCY = [1, 8, 32, 64, 128, 256, 512, 1024]
EMBEDDED = REPO_ROOT / "models" / "embedded"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


# ------------------------------------------------------------------------------- the model
def _write_tokenizer(path: Path) -> str:
    """The embedded model's tokenizer if it loads, else a small byte-level BPE; returns which."""
    from transformers import AutoTokenizer

    if (EMBEDDED / "tokenizer.json").exists():
        for name in TOKENIZER_FILES:
            if (EMBEDDED / name).exists():
                shutil.copy(EMBEDDED / name, path / name)
        try:
            tok = AutoTokenizer.from_pretrained(path)
            if tok.eos_token_id is not None:
                return "models/embedded tokenizer"
        except Exception as e:  # being rebuilt, half-written: fall back
            print(f"embedded tokenizer unusable ({e!r}); training a small BPE", file=sys.stderr)
        for name in TOKENIZER_FILES:
            (path / name).unlink(missing_ok=True)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog.", "Return a new list of the items.",
            "def f(x):\n    return x * 2\n", "naïve café"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            unk_token="<|endoftext|>").save_pretrained(path)
    return "small trained byte-level BPE"


def make_random_gpt2(path: str | Path, size: str = "small", seed: int = 0) -> tuple[Path, str]:
    """Random-initialised GPT-2 in Hugging Face format at `path`: 'small' = GPT2Config() defaults
    (124M), 'tiny' = 2 layers x 64 wide, 256 positions, vocab 512. Returns (path, description)."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok_desc = _write_tokenizer(path)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    torch.manual_seed(seed)
    if size == "small":
        config = GPT2Config(bos_token_id=eos, eos_token_id=eos)
    elif size == "tiny":
        config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=512,
                            bos_token_id=eos, eos_token_id=eos)
    else:
        raise ValueError(f"unknown model size {size!r}")
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    return path, (f"random-initialised GPT-2 {size} ({n / 1e6:.{0 if n >= 1e7 else 2}f}M parameters, {config.n_layer} layers, "
                  f"{config.n_positions} positions, vocab {config.vocab_size}; {tok_desc})")


def read_model_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


# ------------------------------------------------------------------------------- the run
def device_info(device: str | None) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(torch.device(dev)) if dev.startswith("cuda") else "cpu"
    return {"device": name, "torch": torch.__version__.split("+")[0], "triton": triton_version}


def _health(url: str) -> int | None:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=10).status_code
    except httpx.HTTPError:
        return None


def run_compare(args) -> tuple[dict, bool]:
    """Run the servers of `plan` in turn; returns the result (merged with the file's, with --merge)
    and whether this run measured everything without failures or errors."""
    t_start = time.monotonic()
    info = device_info(args.device)
    slug = args.tag or gpu_slug(info["device"])
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"load_{slug}.json"
    try:
        offline = read_offline(args.offline_json, info["device"]) if args.offline_json else None
    except (OSError, ValueError) as e:
        raise SystemExit(f"--offline-json: {e}")
    runs = plan(args.impls, args.concurrency, args.impl_caps, args.api_server_counts)
    for impl in args.impls:
        if not any(r[0] == impl for r in runs):
            print(f"-- {impl}: no level within its cap ({args.impl_caps.get(impl)} clients); not run", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="flashpage-compare-"))
    log_dir = Path(args.log_dir) if args.log_dir else tmp / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    if args.model:
        model, model_desc = Path(args.model), args.model
    else:
        size = args.model_size or ("tiny" if args.device == "cpu" else "small")
        print(f"writing a random GPT-2 {size} checkpoint to {tmp / 'model'} ...", file=sys.stderr)
        model, model_desc = make_random_gpt2(tmp / "model", size, args.seed)
    cfg = read_model_config(model)
    vocab = cfg["vocab_size"]
    n_pos = cfg.get("n_positions", 1024)
    if args.input_len + args.input_jitter + args.output_len + args.output_jitter > n_pos:
        print(f"warning: prompts up to {args.input_len + args.input_jitter} + outputs up to "
              f"{args.output_len + args.output_jitter} tokens exceed the model's {n_pos} positions: "
              "those requests will get 400s", file=sys.stderr)

    command = args.command
    settings = {"concurrency": args.concurrency, "input_len": args.input_len,
                "input_jitter": args.input_jitter, "output_len": args.output_len,
                "output_jitter": args.output_jitter, "num_requests": args.num_requests,
                "requests_factor": args.requests_factor, "min_requests": args.min_requests,
                "duration_s": args.duration, "grace_s": args.grace, "warmup": args.warmup,
                "temperature": 0.0, "ignore_eos": True, "naive_max_batch": args.naive_max_batch,
                "naive_batch_wait_ms": args.naive_batch_wait_ms, "impls": args.impls,
                "server_args": args.server_args, "vocab_size": vocab, "impl_max_concurrency": args.impl_caps,
                "max_num_seqs": max_num_seqs(args.server_args)}
    result = {**info, "date": datetime.date.today().isoformat(), "command": command, "model": model_desc,
              "slug": slug, "settings": settings, "failures": [], "rows": []}
    if args.api_server_counts:
        del settings["impl_max_concurrency"]
        result["settings"] = {}
        result["api_sweep"] = {"command": command, "date": result["date"],
                               "api_server_counts": args.api_server_counts, **settings}
    if offline:
        result["offline"] = offline
    if args.merge and json_path.exists():
        try:
            result = merge(json.loads(json_path.read_text()), result, runs, IMPLS)
        except ValueError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SystemExit(f"cannot add to {json_path}: {e} (--no-merge rewrites it)")
        print(f"adding to {json_path} ({len(result['rows'])} rows there)", file=sys.stderr)
    ok = True

    def save():
        json_path.write_text(json.dumps(result, indent=1))

    def fail(impl, n_api, stage, message):
        print(f"!! {impl}: {message}", file=sys.stderr)
        f = {"impl": impl, "stage": stage, "message": message[-2000:]}
        result["failures"].append(f if n_api is None else {**f, "api_server_count": n_api})
        save()

    try:
        for impl, n_api, levels in runs:
            name = impl if n_api is None else f"{impl}/api{n_api}"
            port = free_port()
            room = server_room_args(max(levels), args.server_args) if impl != "naive_hf" else []
            extra = [*args.server_args, *room, *(["--api-server-count", str(n_api)] if n_api is not None else [])]
            cmd = server_command(impl, str(model), port, args.device, extra, args.naive_max_batch,
                                 args.naive_batch_wait_ms)
            print(f"== {name}: {' '.join(cmd)}", file=sys.stderr)
            t0 = time.monotonic()
            env = dict(os.environ)
            if impl == "triton" and (args.device or "").startswith("cpu"):
                env.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on the CPU: the interpreter
            server = ServerProcess(cmd, port, log_dir / f"server_{name.replace('/', '_')}.log", env=env)
            try:
                try:
                    server.wait_healthy(args.health_timeout)
                except RuntimeError as e:
                    ok = False
                    fail(impl, n_api, "start", f"did not start: {e}")
                    continue
                startup = time.monotonic() - t0
                print(f"   healthy after {startup:.1f} s", file=sys.stderr)
                for i, c in enumerate(levels):
                    row = run_load(server.url, concurrency=c, num_requests=requests_for(c, args),
                                   duration=args.duration, grace=args.grace,
                                   warmup=args.warmup if i == 0 else 0, input_len=args.input_len,
                                   input_jitter=args.input_jitter, output_len=args.output_len,
                                   output_jitter=args.output_jitter, vocab_size=vocab, seed=level_seed(args.seed, i),
                                   temperature=0.0, ignore_eos=True, timeout=args.timeout,
                                   progress=args.progress, label=name, workers=args.client_processes)
                    row["impl"] = impl
                    if n_api is not None:
                        row["api_server_count"] = n_api
                    if room:
                        row["server_room_args"] = room
                    row["server_startup_s"] = startup
                    print_row(row)
                    ok = ok and not row["errors"]
                    add_row(result, row)
                    save()
                    health = _health(server.url) if server.proc.poll() is None else None
                    if health != 200:
                        ok = False
                        code = server.proc.poll()
                        msg = (f"server exited with {code}" if code is not None else
                               f"server /health answers {health}") + f" after c={c}:\n{server.log_tail()}"
                        fail(impl, n_api, f"concurrency {c}", msg)
                        break
            finally:
                server.stop()
    finally:
        if not args.keep_model and not args.model:
            shutil.rmtree(tmp / "model", ignore_errors=True)
        elif not args.model:
            print(f"random checkpoint kept in {tmp / 'model'}", file=sys.stderr)
        if not args.log_dir and ok:
            shutil.rmtree(tmp / "logs", ignore_errors=True)
        elif not ok:
            print(f"server logs in {log_dir}", file=sys.stderr)
        if not any(tmp.iterdir()):
            tmp.rmdir()

    result["elapsed_s"] = time.monotonic() - t_start
    save()
    if result["rows"]:
        prefix = out_dir / f"load_{slug}"
        try:
            paths = plot_result(result, prefix, title=f"{result['device']}, {result['model'].split(' (')[0]}")
        except ImportError as e:  # the numbers are saved; plots can be made later with load_test.py plot
            print(f"no plots ({e}); later: python -m benchmarks.serving.load_test plot {json_path} "
                  f"--out-prefix {prefix}", file=sys.stderr)
        else:
            result["plots"] = [os.path.relpath(p, REPO_ROOT) if Path(p).resolve().is_relative_to(REPO_ROOT) else p
                               for p in paths]
            save()
    print(json_path, file=sys.stderr)
    return result, ok


# ------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to serve")
    g.add_argument("--model", default=None,
                   help="HF GPT-2 checkpoint directory (default: write a random GPT-2 to a temp dir)")
    g.add_argument("--model-size", choices=["small", "tiny"], default=None,
                   help="random model when no --model: small = GPT2Config() 124M (default on CUDA), "
                        "tiny = 2 layers x 64 (default on --device cpu)")
    g.add_argument("--keep-model", action="store_true", help="keep the random checkpoint's temp dir")
    g.add_argument("--impls", nargs="+", choices=IMPLS, default=None,
                   help="configurations, in order (default: all; with --api-server-counts: triton)")
    g.add_argument("--impl-max-concurrency", nargs="*", metavar="IMPL=C", default=None,
                   help="run IMPL only at levels up to C clients (default: sdpa=256 eager=256 naive_hf=256, the "
                        "peers ten times slower than triton; the flag with no values lifts every cap)")
    g.add_argument("--api-server-counts", type=int, nargs="+", default=None, metavar="N",
                   help="API-process sweep instead of the impl sweep: start the server once per N with "
                        "`--api-server-count N` and run --concurrency (default here: %s) against each; "
                        "rows get api_server_count: N" % API_SWEEP_CONCURRENCY)
    g.add_argument("--device", default=None, help="cuda, cuda:1 or cpu, passed to every server (default: cuda if available)")
    g.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="extra arguments for `python -m server` (put last), e.g. --server-args --num-blocks 4096")
    g.add_argument("--naive-max-batch", type=int, default=256, help="--max-batch of the naive server (default: %(default)s)")
    g.add_argument("--naive-batch-wait-ms", type=float, default=5.0,
                   help="--batch-wait-ms of the naive server: a short window lets clients that arrive together "
                        "share a batch (default: %(default)s)")
    g.add_argument("--health-timeout", type=float, default=600.0, help="seconds to wait for a server's /health")
    g = p.add_argument_group("load (per concurrency level)")
    g.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help=f"closed-loop client counts (default: {DEFAULT_CONCURRENCY}; with --api-server-counts "
                        f"{API_SWEEP_CONCURRENCY})")
    g.add_argument("--num-requests", type=int, default=None,
                   help="requests per level (default: max(requests-factor x C, min-requests))")
    g.add_argument("--requests-factor", type=int, default=2, help="default: %(default)s")
    g.add_argument("--min-requests", type=int, default=32, help="default: %(default)s")
    g.add_argument("--duration", type=float, default=15.0,
                   help="per-level deadline in s: stop issuing then, cancel in-flight requests at +grace (default: %(default)s)")
    g.add_argument("--grace", type=float, default=5.0, help="default: %(default)s")
    g.add_argument("--warmup", type=int, default=16,
                   help="uncounted requests sent to each server before its first level (default: %(default)s)")
    g.add_argument("--client-processes", type=int, default=None,
                   help="load-generator processes per level (default: one per 16 clients, at most 8 and CPUs - 2: "
                        "128 clients each at 1024)")
    g.add_argument("--timeout", type=float, default=300.0, help="per-request HTTP timeout in s (default: %(default)s)")
    g.add_argument("--input-len", type=int, default=512, help="prompt tokens, mean (default: %(default)s)")
    g.add_argument("--input-jitter", type=int, default=None, help="prompt length uniform in len +- jitter (default: len/4)")
    g.add_argument("--output-len", type=int, default=256, help="output tokens, mean (default: %(default)s)")
    g.add_argument("--output-jitter", type=int, default=None, help="output length uniform in len +- jitter (default: len/4)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("output")
    g.add_argument("--out-dir", default=None,
                   help="default: benchmarks/results; with --device cpu (a dry run) <tmp>/flashpage-load-dry-run, "
                        "so that CPU numbers never land among the GPU results")
    g.add_argument("--tag", default=None, help="file name part instead of the GPU slug (load_<tag>.json)")
    g.add_argument("--merge", action=argparse.BooleanOptionalAction, default=None,
                   help="add this run's rows to the existing load_<tag>.json (a row measured again replaces its "
                        "old one) instead of rewriting it (default: on with --api-server-counts, else off)")
    g.add_argument("--offline-json", default=None, metavar="PATH",
                   help="a benchmarks/engine/bench_throughput.py result (throughput_<gpu>.json) measured in the same "
                        "device call: its flashpage output tok/s goes into the file as the offline reference")
    g.add_argument("--log-dir", default=None, help="keep server logs here (default: temp dir, kept only on failure)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = "python -m benchmarks.serving.compare " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        resolve_args(args, IMPLS, DEFAULT_CONCURRENCY)
    except ValueError as e:
        parser.error(str(e))
    if args.out_dir is None:
        dry = (args.device or "").startswith("cpu")
        args.out_dir = (Path(tempfile.gettempdir()) / "flashpage-load-dry-run" if dry
                        else REPO_ROOT / "benchmarks" / "results")
    if args.input_jitter is None:
        args.input_jitter = args.input_len // 4
    if args.output_jitter is None:
        args.output_jitter = args.output_len // 4
    result, ok = run_compare(args)
    print(report(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
