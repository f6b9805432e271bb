"""benchmarks/serving/load_test.py against a real flashpage server on loopback (tiny random checkpoint), a
dead port, and a scripted SSE stream (httpx.MockTransport) whose timing is known; plus the plots,
compare.report and compare.py's CPU dry run."""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.shared.common import REPO_ROOT, free_port
from benchmarks.serving.load_plots import plot
from benchmarks.serving.load_test import run_load

VOCAB = 512  # tests/conftest.py make_checkpoint's default; n_positions 256


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server  # tests/conftest.py: the session's plain server on the tiny checkpoint


def test_counts_and_latencies_closed_loop(server):
    row = run_load(server, concurrency=3, num_requests=7, warmup=2, input_len=20, input_jitter=5, output_len=10,
                   output_jitter=3, vocab_size=VOCAB, seed=3, progress=False, keep_requests=True)
    reqs = row["requests"]
    assert row["mode"] == "closed" and row["concurrency"] == 3 and row["warmup_errors"] == 0
    assert row["num_requests"] == row["completed"] == len(reqs) == 7
    assert row["errors"] == row["cancelled"] == row["usage_mismatches"] == row["length_mismatches"] == 0
    for r in reqs:
        assert r["ok"] and r["status"] == 200 and r["finish_reason"] == "length"
        assert 15 <= r["input_len"] <= 25 and r["prompt_tokens"] == r["input_len"]  # server's count of the prompt
        assert 7 <= r["max_tokens"] <= 13
        assert r["n_out"] == r["max_tokens"] == r["usage_completion_tokens"]  # ignore_eos: forced length
        assert len(r["itl"]) == r["n_out"] - 1  # one value per token after the first
        assert 0 < r["ttft"] <= r["e2e"]
        assert sum(r["itl"]) <= r["e2e"] - r["ttft"] + 1e-6
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / (r["n_out"] - 1))
    assert sorted(r["index"] for r in reqs) == list(range(7))
    total = sum(r["max_tokens"] for r in reqs)
    assert row["output_tokens"] == row["output_tokens_received"] == total
    assert row["input_tokens"] == sum(r["input_len"] for r in reqs)
    assert row["output_tokens_per_s"] == pytest.approx(total / row["duration_s"])
    assert row["requests_per_s"] == pytest.approx(7 / row["duration_s"])
    for m in ("ttft", "tpot", "itl", "e2e"):
        assert 0 <= row[f"{m}_p50_ms"] <= row[f"{m}_p90_ms"] <= row[f"{m}_p99_ms"]
        assert row[f"{m}_mean_ms"] > 0
    assert row["e2e_p50_ms"] >= row["ttft_p50_ms"]


def test_openai_completions_route(server, tiny_ckpt):
    """api="completions": the same load over streamed /v1/completions (what vLLM serves too); its
    chunks carry text, so the output count is the final chunk's usage and each chunk one arrival."""
    row = run_load(server, concurrency=2, num_requests=3, input_len=12, output_len=6, vocab_size=VOCAB, seed=1,
                   progress=False, keep_requests=True, api="completions", extra_body={"model": str(tiny_ckpt)})
    assert row["api"] == "completions" and row["completed"] == 3 and row["errors"] == 0
    assert row["length_mismatches"] == 0 and row["output_tokens"] == 18 and row["input_tokens"] == 36
    for r in row["requests"]:
        assert r["ok"] and r["n_out"] == r["usage_completion_tokens"] == 6 and r["prompt_tokens"] == 12
        assert r["finish_reason"] == "length" and 0 < r["ttft"] <= r["e2e"]
        # a chunk per arrival: the server may carry several tokens in one chunk when the client reads
        # late (CI's load: all five after the first came as one, no gap), never more gaps than tokens
        assert len(r["itl"]) <= 5 and sum(r["itl"]) <= r["e2e"] - r["ttft"] + 1e-6
    assert any(r["itl"] for r in row["requests"])  # gaps are measured at all
    bad = run_load(server, concurrency=1, num_requests=1, input_len=4, output_len=2, vocab_size=VOCAB,
                   progress=False, api="completions", extra_body={"model": "no-such-model"})
    assert bad["completed"] == 0 and bad["errors_by_status"] == {"404": 1}


def test_client_processes_share_the_load(server):
    row = run_load(server, concurrency=4, num_requests=6, workers=2, input_len=10, input_jitter=2, output_len=6,
                   vocab_size=VOCAB, progress=False, keep_requests=True)
    assert row["client_processes"] == 2 and row["completed"] == 6 and row["errors"] == 0
    assert sorted(r["index"] for r in row["requests"]) == list(range(6))
    assert row["output_tokens"] == sum(r["max_tokens"] for r in row["requests"]) == 36
    assert row["usage_mismatches"] == row["length_mismatches"] == 0 and row["client_cpu_util"] > 0


def test_poisson_open_loop(server):
    t = time.monotonic()
    row = run_load(server, request_rate=40.0, num_requests=6, input_len=12, output_len=5, vocab_size=VOCAB,
                   progress=False)
    assert row["mode"] == "poisson" and row["request_rate"] == 40.0 and row["concurrency"] is None
    assert row["completed"] == 6 and row["errors"] == 0 and row["output_tokens"] == 30
    assert time.monotonic() - t < 30


def test_too_long_prompts_are_400s_counted(server):
    row = run_load(server, concurrency=2, num_requests=5, input_len=300, output_len=10, vocab_size=VOCAB,
                   progress=False)
    assert row["completed"] == 0 and row["errors"] == 5
    assert row["errors_by_status"] == {"400": 5} and row["errors_by_exception"] == {}
    assert "256" in row["error_examples"][0]  # the server's message, kept for the report
    assert row["output_tokens_per_s"] == 0 and row["ttft_p50_ms"] is None
    assert row["duration_s"] > 1e-4  # answered errors still take time: the run's elapsed is not ~0


def test_dead_port_is_transport_errors():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    row = run_load(url, concurrency=2, num_requests=4, input_len=8, output_len=4, vocab_size=VOCAB,
                   progress=False, timeout=5)
    assert row["errors"] == 4 and row["errors_by_exception"] == {"ConnectError": 4} and row["errors_by_status"] == {}
    assert row["completed"] == 0


def test_vocab_size_needed_when_server_does_not_tell(server):
    with pytest.raises(ValueError, match="vocab"):
        run_load(server, concurrency=1, num_requests=1, input_len=8, output_len=4, progress=False)


def test_prompts_file_text_prompts(server, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("The quick brown fox\n\nReturn a new list\nof the items\n")
    row = run_load(server, concurrency=2, num_requests=4, output_len=6, prompts_file=str(f),
                   prompts_split="paragraph", progress=False, keep_requests=True)
    assert row["completed"] == 4 and row["output_tokens"] == 24
    assert all(r["prompt_tokens"] > 0 and r["input_len"] is None for r in row["requests"])


# ---------------------------------------------------------------- scripted streams (known timing)
def scripted(events_of_tokens: list[tuple[float, int]], usage_tokens=None, done=True):
    """MockTransport whose SSE stream sends, after each delay, one event carrying k tokens."""

    async def handler(request):
        body = json.loads(request.content)

        async def stream():
            n = 0
            for delay, k in events_of_tokens:
                await asyncio.sleep(delay)
                yield f"data: {json.dumps({'id': 'x', 'text': 'a' * k, 'token_ids': [7] * k, 'finished': False})}\n\n".encode()
                n += k
            final = {"id": "x", "text": "", "token_ids": [], "finished": True, "finish_reason": "length",
                     "usage": {"prompt_tokens": len(body["prompt_token_ids"]),
                               "completion_tokens": n if usage_tokens is None else usage_tokens}}
            yield f"data: {json.dumps(final)}\n\n".encode()
            if done:
                yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_itl_counts_multi_token_events_as_one_gap_then_zeros():
    t = scripted([(0.05, 1), (0.10, 3), (0.05, 1)])
    row = run_load("http://mock", concurrency=1, num_requests=1, input_len=4, output_len=5, vocab_size=VOCAB,
                   progress=False, keep_requests=True, transport=t)
    (r,) = row["requests"]
    assert r["ok"] and r["n_out"] == 5 and row["usage_mismatches"] == 0
    assert r["ttft"] == pytest.approx(0.05, abs=0.03)
    assert r["itl"][1:3] == [0.0, 0.0] and len(r["itl"]) == 4
    assert r["itl"][0] == pytest.approx(0.10, abs=0.03) and r["itl"][3] == pytest.approx(0.05, abs=0.03)
    assert r["tpot"] == pytest.approx(0.15 / 4, abs=0.01)


def test_usage_mismatch_and_incomplete_stream_are_reported():
    row = run_load("http://mock", concurrency=1, num_requests=2, input_len=4, output_len=2, vocab_size=VOCAB,
                   progress=False, transport=scripted([(0, 1), (0, 1)], usage_tokens=3))
    assert row["completed"] == 2 and row["usage_mismatches"] == 2
    assert row["usage_mismatch_examples"][0] == {"index": 0, "stream": 2, "usage": 3}
    row = run_load("http://mock", concurrency=1, num_requests=2, input_len=4, output_len=2, vocab_size=VOCAB,
                   progress=False, transport=scripted([(0, 1), (0, 1)], done=False))
    assert row["completed"] == 0 and row["errors_by_exception"] == {"IncompleteStream": 2}


@pytest.mark.parametrize("mode", [{"concurrency": 2}, {"request_rate": 20.0}])
def test_duration_stops_issuing_and_cancels_in_flight(mode):
    slow = scripted([(0.1, 1)] * 30)  # 3 s per request
    t = time.monotonic()
    row = run_load("http://mock", **mode, duration=0.5, grace=0.3, input_len=4, output_len=30, vocab_size=VOCAB,
                   progress=False, keep_requests=True, transport=slow)
    wall = time.monotonic() - t
    assert wall < 1.5  # deadline 0.5 s + grace 0.3 s, not 3 s
    assert row["completed"] == 0 and row["errors"] == 0 and row["cancelled"] == row["num_requests"] >= 2
    assert all(r["start"] - min(x["start"] for x in row["requests"]) < 0.5 for r in row["requests"])
    assert 0.7 < row["duration_s"] < 1.2 and row["output_tokens_received"] > 0 and row["output_tokens"] == 0
    assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens_received"] / row["duration_s"])
    if "concurrency" in mode:
        assert row["num_requests"] == 2  # each client's first request is still running at the deadline


def test_num_requests_bound_with_fast_stream():
    row = run_load("http://mock", concurrency=4, num_requests=10, input_len=4, output_len=2, vocab_size=VOCAB,
                   progress=False, transport=scripted([(0, 1), (0, 1)]))
    assert row["num_requests"] == row["completed"] == 10 and row["output_tokens"] == 20


# ---------------------------------------------------------------- plots, report, compare.py
def fake_rows():
    rows = []
    for impl, speed in (("triton", 4.0), ("eager", 2.0), ("naive_hf", 1.0)):
        for c in (1, 8, 64):
            rows.append({"impl": impl, "concurrency": c, "output_tokens_per_s": 100 * speed * c ** 0.5,
                         "requests_per_s": speed * c ** 0.5, "errors": 0, "cancelled": 0,
                         **{f"{m}_{s}_ms": (10 + c) / speed * (3 if s == "p99" else 1)
                            for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")}})
    return rows


def test_plot_and_report(tmp_path):
    from benchmarks.serving.compare import report

    result = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-11-22",
              "command": "python -m benchmarks.serving.compare", "rows": fake_rows()}
    path = tmp_path / "load_h100.json"
    path.write_text(json.dumps(result))
    paths = plot([str(path)], tmp_path / "load_h100")
    assert [p.rsplit("_", 1)[1] for p in paths] == ["throughput.png", "latency.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    md = report(result)
    assert "| triton | 64 | 3,200 |" in md and "| naive_hf | 1 | 100 |" in md
    assert "| 8 | 2.00× | 4.00× |" in md  # triton/eager, triton/naive_hf at concurrency 8
    assert "benchmarks/results/load_h100_throughput.png" in md and "load_h100_latency.png" in md


def test_load_test_cli_writes_json_and_plots(server, tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.serving.load_test", "--url", server,
                        "--concurrency", "1", "2", "--num-requests", "2", "--input-len", "8", "--output-len", "3",
                        "--vocab-size", str(VOCAB), "--out", str(out), "--plot", str(tmp_path / "p"),
                        "--no-progress", "--label", "fp"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["concurrency"], r["completed"]) for r in rows] == [("fp", 1, 2), ("fp", 2, 2)]
    assert (tmp_path / "p_throughput.png").exists() and (tmp_path / "p_latency.png").exists()


def test_compare_cpu_dry_run(tiny_ckpt, tmp_path):
    # triton (Triton interpreter, bf16) and the naive server: the two paths that differ from a plain
    # `python -m server`; sdpa/eager differ from triton only in the --attention flag.
    cmd = [sys.executable, "-m", "benchmarks.serving.compare", "--device", "cpu", "--model", str(tiny_ckpt),
           "--impls", "triton", "naive_hf", "--concurrency", "1", "2", "--num-requests", "2",
           "--input-len", "16", "--output-len", "4", "--warmup", "1", "--out-dir", str(tmp_path), "--no-progress",
           # passed to the flashpage server only: its engine on a thread, one process to start instead of two
           "--server-args", "--no-engine-process"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads((tmp_path / "load_cpu.json").read_text())
    assert result["device"] == "cpu" and result["failures"] == [] and "torch" in result and "date" in result
    got = {(r["impl"], r["concurrency"]): r for r in result["rows"]}
    assert set(got) == {(i, c) for i in ("triton", "naive_hf") for c in (1, 2)}
    for r in got.values():
        assert r["completed"] == 2 and r["errors"] == 0 and r["usage_mismatches"] == 0
        assert r["output_tokens"] == r["output_tokens_received"] and r["output_tokens_per_s"] > 0
        assert r["ttft_p50_ms"] > 0 and r["tpot_p50_ms"] is not None and r["itl_p99_ms"] is not None
    for impl in ("triton", "naive_hf"):  # each level its own prompts: no prefix-cache hits carried over
        assert got[(impl, 1)]["seed"] != got[(impl, 2)]["seed"]
    assert (tmp_path / "load_cpu_throughput.png").exists() and (tmp_path / "load_cpu_latency.png").exists()
    assert "| triton | 2 |" in p.stdout and "triton / naive_hf" in p.stdout  # report() printed


# ---------------------------------------------------------------- levels past max-num-seqs, API-process sweep
def test_server_defaults_known_to_load_sweep():
    from benchmarks.serving import load_sweep
    from server.api.guards import ServerLimits
    from server.config import EngineConfig

    assert load_sweep.SERVER_MAX_NUM_SEQS == EngineConfig().max_num_seqs
    assert load_sweep.SERVER_MAX_WAITING == ServerLimits().max_waiting_requests
    assert load_sweep.SERVER_MAX_CONNECTIONS == ServerLimits().max_connections


def parse_compare(argv):
    from benchmarks.serving import compare
    from benchmarks.serving.load_sweep import resolve_args

    args = compare.build_parser().parse_args(argv)
    resolve_args(args, compare.IMPLS, compare.DEFAULT_CONCURRENCY)
    return args


def test_compare_levels_caps_and_api_sweep_arguments():
    from benchmarks.serving.load_sweep import plan, server_room_args

    args = parse_compare([])
    assert args.concurrency[-2:] == [512, 1024] and args.impls == ["triton", "sdpa", "eager", "naive_hf"]
    assert not args.merge and args.api_server_counts is None
    runs = plan(args.impls, args.concurrency, args.impl_caps, args.api_server_counts)
    assert [(i, n, lv[-1]) for i, n, lv in runs] == [("triton", None, 1024), ("sdpa", None, 256),
                                                     ("eager", None, 256), ("naive_hf", None, 256)]
    args = parse_compare(["--impl-max-concurrency"])  # no values: no caps
    assert all(lv[-1] == 1024 for *_, lv in plan(args.impls, args.concurrency, args.impl_caps, None))
    args = parse_compare(["--impl-max-concurrency", "triton=8", "--concurrency", "1", "64"])
    assert plan(args.impls, args.concurrency, args.impl_caps, None)[:2] == [("triton", None, [1]), ("sdpa", None, [1, 64])]

    args = parse_compare(["--api-server-counts", "1", "2", "4", "--offline-json", "off.json"])
    assert args.impls == ["triton"] and args.concurrency == [256] and args.merge and args.offline_json == "off.json"
    assert plan(args.impls, args.concurrency, args.impl_caps, args.api_server_counts) == \
        [("triton", 1, [256]), ("triton", 2, [256]), ("triton", 4, [256])]
    assert not parse_compare(["--api-server-counts", "2", "--no-merge"]).merge
    for bad in (["--api-server-counts", "2", "--impls", "naive_hf"], ["--api-server-counts", "2", "2"],
                ["--api-server-counts", "0"], ["--impl-max-concurrency", "sdpa"], ["--impl-max-concurrency", "x=4"],
                ["--api-server-counts", "2", "--server-args", "--api-server-count", "3"]):
        with pytest.raises(ValueError):
            parse_compare(bad)

    # room for every client: the engine's queue (4096 by default) and the connection cap never answer 503
    assert server_room_args(256, []) == server_room_args(1024, []) == []
    assert server_room_args(8192, []) == ["--max-waiting-requests", "8192", "--max-connections", "8448"]
    assert server_room_args(4096, ["--max-waiting-requests", "-1"]) == ["--max-connections", "4352"]


class FakeServer:
    """compare.py's ServerProcess, without a server: records the command it was given."""
    commands: list = []
    proc = type("P", (), {"poll": staticmethod(lambda: None)})()
    wait_healthy = stop = log_tail = lambda self, *a: ""

    def __init__(self, cmd, port, log_path, env=None):
        FakeServer.commands.append(cmd)
        self.url = f"http://127.0.0.1:{port}"


def fake_run_load(url, *, concurrency, label, seed, **kwargs):
    speed = {"triton": 4.0, "sdpa": 2.5, "eager": 2.0, "naive_hf": 1.0}.get(label.split("/")[0], 4.0)
    if "/api" in label:
        speed *= 1 + 0.1 * int(label.rsplit("api", 1)[1])
    return {"impl": label, "concurrency": concurrency, "seed": seed, "num_requests": 2, "completed": 2,
            "errors": 0, "cancelled": 0, "output_tokens_per_s": 100 * speed * concurrency ** 0.5,
            "requests_per_s": speed, "client_cpu_util": 0.1,
            **{f"{m}_{s}_ms": (10 + concurrency) / speed * (3 if s == "p99" else 1)
               for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")}}


def test_compare_bookkeeping_impl_then_api_sweep_into_one_file(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """compare.main with the servers and the load faked: what each server is started with, how rows are
    labelled and merged into one file, and the report of that file."""
    from benchmarks.serving import compare

    monkeypatch.setattr(compare, "ServerProcess", FakeServer)
    monkeypatch.setattr(compare, "run_load", fake_run_load)
    monkeypatch.setattr(compare, "_health", lambda url: 200)
    real_plot = compare.plot_result
    monkeypatch.setattr(compare, "plot_result", lambda *a, **k: [])  # drawn once below, for the API sweep
    FakeServer.commands = []
    base = ["--device", "cpu", "--model", str(tiny_ckpt), "--num-requests", "2", "--input-len", "16",
            "--output-len", "4", "--out-dir", str(tmp_path), "--no-progress"]
    assert compare.main(base + ["--concurrency", "1", "256", "1024"]) == 0
    path = tmp_path / "load_cpu.json"
    first = json.loads(path.read_text())
    assert [(r["impl"], r["concurrency"]) for r in first["rows"]] == \
        [("triton", 1), ("triton", 256), ("triton", 1024)] + [(i, c) for i in ("sdpa", "eager", "naive_hf") for c in (1, 256)]
    assert all("api_server_count" not in r for r in first["rows"])
    cmds = {c[c.index("--attention") + 1] if "--attention" in c else "naive_hf": c for c in FakeServer.commands}
    # the default queue has room for 1024 waiting clients: no flag added, and the row says so
    assert "--max-waiting-requests" not in cmds["triton"] + cmds["sdpa"] + cmds["naive_hf"]
    assert "server_room_args" not in first["rows"][2]

    offline = tmp_path / "throughput_cpu.json"
    offline.write_text(json.dumps({"device": "cpu", "torch": "x", "triton": "x", "date": "2026-01-01",
                                   "command": "python -m benchmarks.engine.bench_throughput", "workload": {
                                       "num_requests": 256, "input_len": [128, 512], "output_len": [128, 512]},
                                   "rows": [{"impl": "copy", "tbps": 1.0},
                                            {"impl": "flashpage", "output_tokens_per_s": 12800.0}]}))
    FakeServer.commands = []
    monkeypatch.setattr(compare, "plot_result", real_plot)
    assert compare.main(base + ["--api-server-counts", "1", "2", "4", "--offline-json", str(offline)]) == 0
    assert [c[c.index("--api-server-count") + 1] for c in FakeServer.commands] == ["1", "2", "4"]
    assert all(c[c.index("--attention") + 1] == "triton" and "--max-waiting-requests" not in c
               for c in FakeServer.commands)
    result = json.loads(path.read_text())
    assert result["rows"][:len(first["rows"])] == first["rows"]  # the impl sweep's rows kept
    api = [(r["impl"], r["api_server_count"], r["concurrency"]) for r in result["rows"] if "api_server_count" in r]
    assert api == [("triton", 1, 256), ("triton", 2, 256), ("triton", 4, 256)]
    assert result["settings"] == first["settings"] and result["api_sweep"]["api_server_counts"] == [1, 2, 4]
    assert result["command"].count(" && ") == 1 and "--api-server-counts" in result["api_sweep"]["command"]
    assert result["offline"]["output_tokens_per_s"] == 12800.0 and result["offline"]["source"] == "throughput_cpu.json"
    assert [Path(p).name for p in result["plots"]] == ["load_cpu_throughput.png", "load_cpu_latency.png",
                                                       "load_cpu_api_servers.png"]
    md = capsys.readouterr().out
    assert "| 1 | 256 | 7,040 | 1.00× | 55% |" in md and "| 4 | 256 | 8,960 | 1.27× | 70% |" in md
    assert "At 256 clients: 6,400 tok/s = 50% of offline" in md and "load_cpu_api_servers.png" in md
    assert "| triton | 1024 |" in md and "| sdpa | 1024 |" not in md

    # measured again: replaces its row, the others stay
    monkeypatch.setattr(compare, "plot_result", lambda *a, **k: [])
    assert compare.main(base + ["--api-server-counts", "4", "--concurrency", "256"]) == 0
    again = json.loads(path.read_text())
    assert len(again["rows"]) == len(result["rows"]) and again["rows"][-1]["api_server_count"] == 4
    assert again["offline"] == result["offline"]  # kept from the file


def test_client_process_raises_its_open_file_limit_for_its_streams():
    import resource

    from benchmarks.serving.load_client import raise_fd_limit
    from benchmarks.serving.load_test import auto_workers

    assert auto_workers(1024, None, None, 256) <= 8  # so 1024 clients are >= 128 sockets per process
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = soft + 64 if hard == resource.RLIM_INFINITY else min(hard, soft + 64)
    try:
        assert raise_fd_limit(need) == need == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert raise_fd_limit(16) == need  # never lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
