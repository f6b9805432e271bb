"""The vLLM side-by-side harness (benchmarks/peers/) on the CPU: both engines' commands from one set
of flags, the workloads and their merging, `vllm bench serve`'s arguments and its saved JSON (a file
recorded from vLLM 0.26.0's own client against a flashpage server), the report, and the offline
runner end to end on flashpage's engine. The GPU runs themselves are benchmarks, not tests."""

import json
import random
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.peers import engines, report, run, vllm_bench, workloads
from benchmarks.peers.engines import SERVED_NAME, Flags, llm_kwargs, serve_cmd
from server.cli import build_parser, config_from_args

DATA = Path(__file__).parent / "data"


def test_flashpage_command_parses_into_the_flags_given():
    flags = Flags(max_model_len=3000, max_num_seqs=64, max_num_batched_tokens=1024, gpu_memory_utilization=0.8,
                  block_size=32, enable_prefix_caching=False, api_server_count=2, seed=5)
    cmd = engines.serve_cmd("flashpage", "/ckpt", 8123, flags)
    assert cmd[1:3] == ["-m", "server"]
    cfg = config_from_args(args := build_parser().parse_args(cmd[3:]))
    assert (cfg.model, cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size) == \
           ("/ckpt", 3000, 64, 1024, 32)
    assert (cfg.gpu_memory_utilization, cfg.enable_prefix_caching, cfg.enable_chunked_prefill, cfg.seed) == \
           (0.8, False, True, 5)
    assert (cfg.attention, cfg.dtype, cfg.enforce_eager, args.port, args.api_server_count) == \
           ("triton", "bfloat16", False, 8123, 2)
    assert cfg.served_model_name == SERVED_NAME


def test_vllm_command_says_the_same_in_vllms_words():
    flags = Flags(max_model_len=3000, max_num_seqs=64, enable_prefix_caching=False, kv_cache_dtype="fp8")
    cmd = engines.serve_cmd("vllm", "/ckpt", 8123, flags)
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/ckpt"]
    pairs = dict(zip(cmd[5::1], cmd[6::1]))
    assert pairs["--max-model-len"] == "3000" and pairs["--max-num-seqs"] == "64" and pairs["--block-size"] == "16"
    assert pairs["--kv-cache-dtype"] == "fp8" and pairs["--served-model-name"] == SERVED_NAME
    assert "--no-enable-prefix-caching" in cmd and "--enable-chunked-prefill" in cmd
    assert "--enforce-eager" not in cmd and "--attention-backend" not in cmd  # graphs on, vLLM's own backend
    assert json.loads(pairs["--structured-outputs-config"]) == {"backend": "xgrammar", "disable_any_whitespace": True}


def test_offline_constructor_arguments():
    from server.config import EngineConfig

    flags = Flags(max_model_len=2048, enable_prefix_caching=False)
    cfg = EngineConfig(**engines.llm_kwargs("flashpage", "/ckpt", flags))
    assert (cfg.max_model_len, cfg.enable_prefix_caching, cfg.attention, cfg.enforce_eager) == \
           (2048, False, "triton", False)
    kw = engines.llm_kwargs("vllm", "/ckpt", flags)
    assert kw["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert kw["block_size"] == 16
    assert kw["max_num_seqs"] == cfg.max_num_seqs and kw["max_num_batched_tokens"] == cfg.max_num_batched_tokens


def test_each_engine_gets_its_own_site():
    base = {"PYTHONPATH": "/tmp/site", "VLLM_SITE": "/opt/vs"}
    v = engines.engine_env("vllm", base)["PYTHONPATH"].split(":")
    f = engines.engine_env("flashpage", base)["PYTHONPATH"].split(":")
    assert v == ["/opt/vs", str(engines.REPO_ROOT)]  # not the flashpage server's fastapi/pydantic
    assert f == [str(engines.REPO_ROOT), "/tmp/site"]
    # the carried site has neither DeepGEMM nor FlashInfer: vLLM must not reach for them
    env = engines.engine_env("vllm", base)
    assert env["VLLM_USE_DEEP_GEMM"] == "0" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_multicast_stays_off_in_both_engines_whatever_the_caller_set():
    from server.config import NCCL_ENV

    base = {"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}
    for engine in engines.ENGINES:
        env = engines.engine_env(engine, base)
        assert {k: env[k] for k in NCCL_ENV} == NCCL_ENV == {
            "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    # vLLM's symmetric-memory all-reduce (multimem) is off by name; its custom all-reduce stays on
    assert engines.engine_env("vllm", base)["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"


def test_nano_vllm_protocol_is_its_bench_py_draw_for_draw():
    # nano-vllm's bench.py, written as it is (module-level random after seed(0))
    state = random.getstate()
    try:
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
        max_tokens = [random.randint(100, 1024) for _ in range(256)]
    finally:
        random.setstate(state)
    assert workloads.nano_vllm_workload() == (prompts, max_tokens)


def test_workloads_selected_together_share_an_engine_start():
    sel = run.parse_selection(["offline:qwen3-0.6b,llama-3.1-8b", "nanovllm:llama-3.1-8b", "batch1:llama-3.1-8b",
                               "long", "http", "prefix"])
    assert ("long", "llama-3.1-8b") in sel and ("http", "qwen2.5-0.5b") in sel and ("prefix", "qwen2.5-0.5b") in sel
    jobs = workloads.merge_jobs([j for w, s in sel for j in workloads.jobs_for(w, s, vocab=1000)])
    kinds = [(j.kind, j.shape, j.flags.max_model_len, sorted(run.job_workloads(j))) for j in jobs]
    assert kinds == [("offline", "qwen3-0.6b", 4096, ["offline"]),
                     ("offline", "llama-3.1-8b", 4096, ["batch1", "nanovllm", "offline"]),
                     ("offline", "llama-3.1-8b", 33024, ["long"]),
                     ("serve", "qwen2.5-0.5b", 4096, ["http", "prefix"])]
    serve = jobs[-1]
    assert serve.flags.max_num_batched_tokens == 2048 and serve.flags.enable_prefix_caching
    assert [lv.concurrency for lv in serve.levels] == [1, 32, 256, 1024, 64]
    assert len({lv.seed for lv in serve.levels}) == len(serve.levels)  # no level finds another's prompts cached
    batch1 = next(t for t in jobs[1].tasks if t["workload"] == "batch1")
    assert {len(p) for p in batch1["prompts"]} == {512} and len(batch1["prompts"]) == 1 + 5 + 3
    assert len({tuple(p) for p in batch1["prompts"]}) == 9 and max(max(p) for p in batch1["prompts"]) < 1000
    assert not jobs[0].flags.enable_prefix_caching  # repeated offline runs must not hit the cache
    assert 5 < workloads.estimate_minutes(sel) < 40
    fp8 = workloads.jobs_for("long-fp8", "llama-3.1-8b", vocab=1000)[0]  # the long workload, fp8 caches
    assert fp8.flags == replace(jobs[2].flags, kv_cache_dtype="fp8") and fp8.tasks[0]["workload"] == "long-fp8"
    assert fp8.tasks[0]["prompts"] == jobs[2].tasks[0]["prompts"]
    assert "--kv-cache-dtype" in serve_cmd("vllm", "/m", 1, fp8.flags) and llm_kwargs("flashpage", "/m", fp8.flags)[
        "kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit):
        run.parse_selection(["offline:gpt-5"])


def test_bench_args_fixed_lengths_and_result_file(tmp_path):
    args = vllm_bench.bench_args("http://h:1", "/ckpt", "model", dataset=dict(name="random", input_len=512,
                                 output_len=256), num_prompts=64, max_concurrency=32, seed=7,
                                 result_dir=str(tmp_path), result_filename="x.json", num_warmups=8)
    pairs = dict(zip(args[::1], args[1::1]))
    assert pairs["--random-range-ratio"] == "0" and pairs["--random-input-len"] == "512"
    assert pairs["--max-concurrency"] == "32" and pairs["--endpoint"] == "/v1/completions"
    assert "--ignore-eos" in args and "--save-result" in args and pairs["--result-filename"] == "x.json"
    prefix = vllm_bench.bench_args("http://h:1", "/ckpt", "model", dataset=dict(
        name="prefix_repetition", prefix_len=1024, suffix_len=128, num_prefixes=8, output_len=128),
        num_prompts=512, max_concurrency=64, seed=1, result_dir="d", result_filename="y.json")
    assert dict(zip(prefix, prefix[1:]))["--prefix-repetition-num-prefixes"] == "8"
    with pytest.raises(ValueError):
        vllm_bench.bench_args("u", "m", "n", dataset=dict(name="sharegpt"), num_prompts=1, max_concurrency=1,
                              seed=0, result_dir="d", result_filename="z")


def test_parse_a_saved_vllm_bench_serve_result():
    data = json.loads((DATA / "vllm_bench_serve_0.26.0.json").read_text())
    row = vllm_bench.parse_result(data)
    assert row["completed"] == data["completed"] > 0 and row["errors"] == 0
    assert row["output_tokens_per_s"] == data["output_throughput"]
    assert row["ttft_p50_ms"] == data["median_ttft_ms"] and row["ttft_p99_ms"] == data["p99_ttft_ms"]
    assert row["itl_p99_ms"] == data["p99_itl_ms"] and row["tpot_p50_ms"] == data["median_tpot_ms"]
    assert row["e2e_p90_ms"] == data["p90_e2el_ms"] and row["concurrency"] == data["max_concurrency"]
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
    assert vllm_bench.parse_result({"error": "boom"}) == {"client": "vllm-bench", "error": "boom"}


def fake_result(workload: str, rows: list[dict]) -> dict:
    return dict(device="NVIDIA H100 80GB HBM3", torch="2.11.0", triton="3.6.0", date="2026-11-27", command="c",
                workload=workload, shape="qwen2.5-0.5b", flags=Flags().record(),
                engines={"vllm": {"versions": {"vllm": "0.26.0"}}, "flashpage": {"versions": {"flashpage": "abc1234"}}},
                rows=rows)


def test_report_puts_both_engines_in_each_row():
    offline = fake_result("offline", [
        dict(impl="flashpage", task="random", output_tokens_per_s=30000.0),
        dict(impl="vllm", task="random", output_tokens_per_s=25000.0),
        dict(impl="flashpage", task="nano-vllm", output_tokens_per_s=20000.0),
        dict(impl="vllm", task="nano-vllm", error="exit 1:\nValueError: boom")])
    md = report.report(offline)
    assert "| 256 requests, in/out 128–512, greedy | 30,000 | 25,000 | 1.20× |" in md
    assert "| 20,000 | – | – |" in md and "vLLM failed on nano-vllm: `ValueError: boom`" in md
    assert "vLLM 0.26.0" in md and "flashpage abc1234" in md and "prefix caching on" in md
    lat = fake_result("long", [dict(impl=e, task="prompt-8k", kind="latency", prompt_len=8192, max_tokens=128,
                                    ttft_ms=t, tpot_ms=p) for e, t, p in (("flashpage", 500.0, 6.0), ("vllm", 450.0, 6.6))])
    assert "| 8,192 → 128 | 500.00 ms | 450.00 ms | 6.000 ms | 6.600 ms | 0.91× |" in report.report(lat)
    row = vllm_bench.parse_result(json.loads((DATA / "vllm_bench_serve_0.26.0.json").read_text()))
    http = fake_result("http", [dict(row, impl="flashpage", level="c4"), dict(row, impl="vllm", level="c4")])
    md = report.report(http)
    assert "`vllm bench serve`" in md and f"| {row['concurrency']} | " in md and "| 1.00× |" in md
    structured = fake_result("structured", [dict(impl="vllm", with_tok_s=9000.0, without_tok_s=10000.0, ratio=0.9,
                                                 parsed=64, batch=64, mean_len=80.5)])
    assert "| vLLM | 9,000 | 10,000 | 0.90 | 64/64 | 80.5 |" in report.report(structured)


def test_make_report_renders_a_peers_file(tmp_path, monkeypatch):
    from benchmarks import make_report

    assert make_report.kind_of(Path("peers_offline_x_h100.json")).module == "benchmarks.peers.report"
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "peers_offline_qwen2.5-0.5b_h100.json").write_text(json.dumps(fake_result("offline", [
        dict(impl="flashpage", task="random", output_tokens_per_s=3.0), dict(impl="vllm", task="random",
                                                                            output_tokens_per_s=2.0)])))
    monkeypatch.setattr(make_report, "ROOT", tmp_path)
    text = make_report.render_doc(results)
    assert "#### Side by side with vLLM: offline, qwen2.5-0.5b, h100" in text and "| 1.50× |" in text
    assert "| flashpage 3 tok/s; vLLM 2 tok/s |" in text  # the run's row in the table of runs


def test_offline_runner_end_to_end_on_flashpage(tiny_ckpt, tmp_path, monkeypatch):
    """benchmarks/peers/offline.py's three task kinds through flashpage's engine (CPU, tiny GPT-2):
    the token counts it checks, the batch-1 split, the constrained run against its twin."""
    from benchmarks.peers import offline

    monkeypatch.setattr(engines, "llm_kwargs", lambda e, m, f: dict(model=m, device="cpu", num_blocks=64,
                                                                     max_model_len=f.max_model_len))
    monkeypatch.setattr(offline, "llm_kwargs", engines.llm_kwargs)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(500) for _ in range(n)]  # noqa: E731
    tasks = [dict(workload="offline", name="random", kind="throughput", prompts=[ids(6), ids(9), ids(4)],
                  max_tokens=[3, 5, 2], repeats=1),
             dict(workload="batch1", name="b1", kind="latency", prompts=[ids(8) for _ in range(4)], max_tokens=4,
                  ttft_runs=2),
             dict(workload="structured", name="json", kind="structured", prompts=[ids(5), ids(5)], max_tokens=16,
                  schema={"enum": ["yes", "no"]}, repeats=1)]  # a grammar any model ends within a few tokens
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps(dict(engine="flashpage", model=str(tiny_ckpt), flags=Flags(max_model_len=128).record(),
                                   tasks=tasks)))
    assert offline.main([str(job), str(out)]) == 0
    got = json.loads(out.read_text())
    tput, lat, st = got["rows"]
    assert got["engine"] == "flashpage" and got["device"] == "cpu" and got["versions"]["torch"]
    assert tput["output_tokens"] == 10 and tput["requests"] == 3 and tput["workload"] == "offline"
    assert tput["output_tokens_per_s"] == pytest.approx(10 / tput["seconds"], rel=0.02, abs=0.1)  # both rounded
    assert len(lat["ttft_runs_ms"]) == 2 and len(lat["e2e_runs_ms"]) == 1 and lat["prompt_len"] == 8
    assert lat["tpot_ms"] == pytest.approx((lat["e2e_ms"] - lat["ttft_ms"]) / 3, abs=1e-3)
    assert st["batch"] == 2 and st["parsed"] == 2 and st["mean_len"] < 16 and st["with_tok_s"] > 0
    assert st["runs"][0]["tokens"] == 2 * st["mean_len"] and st["without_tok_s"] > 0


def test_an_engine_that_cannot_start_leaves_its_error_in_the_rows(tiny_ckpt, tmp_path, monkeypatch):
    """vLLM's site missing: its process fails at `import vllm`; each of its tasks gets an error row
    with the end of the log, and the result files still carry them (what stopped it, exactly)."""
    monkeypatch.setenv("VLLM_SITE", str(tmp_path / "no-site"))
    tasks = [dict(workload="offline", name="random", kind="throughput", prompts=[[1, 2]], max_tokens=[2]),
             dict(workload="batch1", name="b1", kind="latency", prompts=[[1, 2]] * 4, max_tokens=2)]
    job = workloads.Job("offline", "tiny", Flags(max_model_len=64), tasks=tasks)
    got = run.run_job(job, ["vllm"], Path(tiny_ckpt), tmp_path, timeout=300)
    rows = got["vllm"]["rows"]
    assert [(r["task"], r["workload"], r["impl"]) for r in rows] == [("random", "offline", "vllm"),
                                                                    ("b1", "batch1", "vllm")]
    assert all("No module named 'vllm'" in r["error"] for r in rows)
    head = dict(device="NVIDIA H100 80GB HBM3", torch="2.11.0", triton="3.6.0", date="2026-11-27", command="c")
    paths = run.write_results(job, got, tmp_path / "out", head)
    assert [p.name for p in paths] == ["peers_batch1_tiny_h100.json", "peers_offline_tiny_h100.json"]
    assert "vLLM failed on random: `ModuleNotFoundError: No module named 'vllm'`" in \
           report.report(json.loads(paths[1].read_text()))


def test_a_server_under_our_client(tiny_ckpt, tmp_path):
    """serving.serve_and_measure with flashpage's server on the CPU (our client only: vLLM's needs
    vLLM): the server comes up from the shared flags, every level gets a row, the server goes away."""
    from benchmarks.peers import serving

    flags = Flags(max_model_len=128, dtype="float32",
                  flashpage_args=("--device", "cpu", "--attention", "sdpa", "--num-blocks", "64"))
    levels = [serving.Level("c2", 2, 4, dict(name="random", input_len=12, output_len=4), seed=3,
                            clients=("flashpage-load",))]
    got = serving.serve_and_measure("flashpage", str(tiny_ckpt), flags, levels, tmp_path, vocab_size=400,
                                    tag="tiny_flashpage", startup_timeout=300)
    (row,) = got["rows"]
    assert got["startup_s"] > 0 and "--served-model-name model" in got["command"]
    assert (row["impl"], row["client"], row["level"], row["api"]) == ("flashpage", "flashpage-load", "c2", "completions")
    assert row["completed"] == 4 and row["errors"] == 0 and row["output_tokens"] == 16 and row["length_mismatches"] == 0
    assert (tmp_path / "tiny_flashpage_server.log").exists()


def test_quantized_shapes_are_the_16_bit_checkpoints_quantized_copy(tmp_path, monkeypatch):
    """`<shape>.<format>`: the 16-bit random checkpoint made first (once), then quant_checkpoint.py's
    copy of it in that format; formats vLLM cannot read, and unknown shapes, refused by name."""
    from benchmarks.quant.quant_checkpoint import FORMATS

    assert set(workloads.QUANT_FORMATS) <= set(FORMATS)
    sel = run.parse_selection(["offline:llama-3.1-8b.fp8-dynamic,qwen2.5-0.5b.awq", "batch1:llama-3.1-8b.awq"])
    assert sel == [("offline", "llama-3.1-8b.fp8-dynamic"), ("offline", "qwen2.5-0.5b.awq"),
                   ("batch1", "llama-3.1-8b.awq")]
    plain = workloads.estimate_minutes([("offline", "llama-3.1-8b"), ("batch1", "llama-3.1-8b")])
    assert workloads.estimate_minutes([("offline", "llama-3.1-8b.fp8-dynamic"), ("batch1", "llama-3.1-8b.awq")]) > plain
    for bad in ("offline:llama-3.1-8b.gptq-desc-act", "offline:gpt-5.awq", "offline:llama-3.1-8b.int3"):
        with pytest.raises(SystemExit, match="unknown shape"):
            run.parse_selection([bad])
    calls = []

    def fake_run(cmd, **kw):  # the GPU's part: record what would run, make the directory it would write
        calls.append(cmd[3:])
        Path(cmd[3]).mkdir(parents=True)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    for shape in ("llama-3.1-8b.awq", "llama-3.1-8b.fp8-dynamic"):
        assert run.ensure_checkpoint(shape, tmp_path, tmp_path) == tmp_path / shape
    base = str(tmp_path / "llama-3.1-8b")
    assert calls == [[base, "llama-3.1-8b"], [str(tmp_path / "llama-3.1-8b.awq"), "awq", base],
                     [str(tmp_path / "llama-3.1-8b.fp8-dynamic"), "fp8-dynamic", base]]


def test_tensor_parallel_and_dummy_weights_reach_both_engines(tmp_path, monkeypatch):
    """--tensor-parallel-size and --load-format dummy (issue 50's TP rows): both CLIs and both offline
    constructors get them in the same words, a dummy shape is a config-only directory (no weight
    files, never written for llama-3.1-70b), and the result file names its TP size."""
    from server.config import EngineConfig

    flags = Flags(tensor_parallel_size=4, load_format="dummy")
    for engine in engines.ENGINES:
        cmd = serve_cmd(engine, "/ckpt", 8123, flags)
        pairs = dict(zip(cmd, cmd[1:]))
        assert pairs["--tensor-parallel-size"] == "4" and pairs["--load-format"] == "dummy", engine
        assert "--tensor-parallel-size" not in serve_cmd(engine, "/ckpt", 8123, Flags())
    cfg = config_from_args(build_parser().parse_args(serve_cmd("flashpage", "/ckpt", 8123, flags)[3:]))
    assert (cfg.tensor_parallel_size, cfg.load_format) == (4, "dummy")
    cfg = EngineConfig(**llm_kwargs("flashpage", "/ckpt", flags))
    assert (cfg.tensor_parallel_size, cfg.load_format) == (4, "dummy")
    kw = llm_kwargs("vllm", "/ckpt", flags)
    assert (kw["tensor_parallel_size"], kw["load_format"]) == (4, "dummy")
    assert "tensor_parallel_size" not in llm_kwargs("vllm", "/ckpt", Flags())

    assert run.parse_selection(["batch1:llama-3.1-70b"]) == [("batch1", "llama-3.1-70b")]
    path = run.ensure_checkpoint("llama-3.1-70b", tmp_path, tmp_path, dummy=True)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 80
    assert not list(path.glob("*.safetensors"))
    with pytest.raises(SystemExit, match="dummy only"):
        run.ensure_checkpoint("llama-3.1-70b", tmp_path, tmp_path)
    with pytest.raises(SystemExit, match="quantized shape"):
        run.ensure_checkpoint("llama-3.1-8b.awq", tmp_path, tmp_path, dummy=True)

    job = workloads.Job("offline", "llama-3.1-70b", replace(workloads.OFFLINE_FLAGS, tensor_parallel_size=4,
                                                               load_format="dummy"),
                        tasks=[dict(name="batch1-512", workload="batch1")])
    got = {"flashpage": {"rows": [dict(engine="flashpage", task="batch1-512", workload="batch1", tpot_ms=20.0)]}}
    (written,) = run.write_results(job, got, tmp_path, dict(device="NVIDIA H100 80GB HBM3"))
    assert written.name == "peers_batch1_llama-3.1-70b_tp4_h100.json"
    assert "--load-format dummy" in json.loads(written.read_text())["model"]
    line = report.flags_line(json.loads(written.read_text()))  # the docs say how the row was split
    assert "tensor parallel over 4 GPUs" in line and "`--load-format dummy`" in line
    assert "tensor parallel" not in report.flags_line(dict(flags=Flags().record()))


def test_a_checkpoint_that_cannot_be_made_says_why(tmp_path, monkeypatch):
    def failing(cmd, stdout=None, **kw):
        stdout.write("ModuleNotFoundError: No module named 'compressed_tensors'\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(run.subprocess, "run", failing)
    (tmp_path / "llama-3.1-8b").mkdir()
    (tmp_path / "llama-3.1-8b" / ".complete").write_text("")
    with pytest.raises(SystemExit, match="compressed_tensors"):
        run.ensure_checkpoint("llama-3.1-8b.fp8-dynamic", tmp_path, tmp_path)


def test_result_files_rebuilt_from_the_rows_a_run_left_in_its_logs(tmp_path):
    """--from-rows: a call whose result files did not come back (at most 8 files do) left its rows in
    the log dir's archive; the files written from them carry those rows, both engines' versions, the
    rows' device, the date of the rows' files, and say that they were rebuilt. A serving job has no
    rows there, and nothing found is an error."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for engine, tpot in (("flashpage", 3.09), ("vllm", 3.94)):
        row = dict(engine=engine, impl=engine, workload="batch1", task="batch1-512", kind="latency", tpot_ms=tpot)
        (logs / f"rows_llama-3.2-1b.awq_4096_{engine}.json").write_text(json.dumps(dict(
            engine=engine, versions={"torch": "2.11.0+cu130", "triton": "3.6.0", engine: "v"}, device="NVIDIA H200",
            init_s=1.0, rows=[row])))
    out = tmp_path / "out"
    argv = ["--workloads", "batch1:llama-3.2-1b.awq", "http:llama-3.2-1b.awq", "--out-dir", str(out), "--from-rows", str(logs)]
    assert run.main(argv) == 0
    (path,) = out.iterdir()
    got = json.loads(path.read_text())
    assert path.name == "peers_batch1_llama-3.2-1b.awq_h200.json" and got["rebuilt_from_rows"]
    assert [(r["engine"], r["tpot_ms"]) for r in got["rows"]] == [("flashpage", 3.09), ("vllm", 3.94)]
    assert got["engines"]["vllm"]["versions"]["vllm"] == "v" and got["torch"] == "2.11.0"
    assert got["flags"]["max_model_len"] == 4096 and "--from-rows" not in got["command"]
    assert run.main(argv[:-1] + [str(tmp_path / "empty")]) == 1


def test_wait_gpu_free_asks_only_for_the_visible_gpus(monkeypatch):
    # lanes side by side on a host's GPUs: a lane on GPU 2 must not wait for GPU 0's engine
    calls, readings = [], iter(["30000\n", "100\n"])

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=next(readings))

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    run.wait_gpu_free(limit_mib=2048, timeout=5)
    assert len(calls) == 2 and all("--id=2,3" in c for c in calls)  # waited out the 30 GB, on GPUs 2 and 3
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    calls.clear()
    readings = iter(["[N/A]\n"])
    run.wait_gpu_free(timeout=5)
    assert len(calls) == 1 and not any(a.startswith("--id") for a in calls[0])


def test_an_offline_process_that_hangs_after_its_last_row_is_cut_not_waited_on(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "EXIT_GRACE_S", 0.5)
    rows = tmp_path / "rows.json"
    p = subprocess.Popen(["sleep", "60"])
    try:
        rows.write_text(json.dumps({"rows": [{"task": "a"}]}))
        assert run.wait_offline(p, rows, tasks=2, timeout=2.5) == ("timeout after 2 s", False)  # a task missing
        rows.write_text(json.dumps({"rows": [{"task": "a"}, {"task": "b"}]}))
        assert run.wait_offline(p, rows, tasks=2, timeout=30) == (0, True)  # all in: cut after the grace
        assert p.poll() is None  # (run_offline's kill_tree ends it)
    finally:
        p.kill()
        p.wait()
    q = subprocess.Popen(["true"])
    assert run.wait_offline(q, tmp_path / "none.json", tasks=1, timeout=30) == (0, False)
