"""benchmarks/peers/run.py --profile on the CPU: the offline process profiles one more run of a
throughput task (its operators here; a GPU's kernels there), vLLM's engine core is asked into the
profiled process, a profile that cannot be made leaves the measured row in place, and the result
files of a profiled run, written or rebuilt from its rows, are named apart from the side by side's."""

import json

import pytest

from benchmarks.peers import engines, offline, run, workloads
from benchmarks.peers.engines import Flags


@pytest.fixture
def cpu_engine(monkeypatch):
    monkeypatch.setattr(engines, "llm_kwargs", lambda e, m, f: dict(model=m, device="cpu", num_blocks=64,
                                                                     max_model_len=f.max_model_len))
    monkeypatch.setattr(offline, "llm_kwargs", engines.llm_kwargs)
    monkeypatch.setenv(offline.PROFILE_ENV, "1")


def _run_task(tiny_ckpt, tmp_path) -> dict:
    tasks = [dict(workload="offline", name="random", kind="throughput", prompts=[[5, 6, 7], [8, 9]],
                  max_tokens=[3, 2], repeats=1)]
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps(dict(engine="flashpage", model=str(tiny_ckpt), flags=Flags(max_model_len=64).record(),
                                   tasks=tasks)))
    assert offline.main([str(job), str(out)]) == 0
    return json.loads(out.read_text())["rows"][0]


def test_a_profiled_throughput_task_says_where_its_time_went(tiny_ckpt, tmp_path, cpu_engine):
    row = _run_task(tiny_ckpt, tmp_path)
    prof = row["profile"]
    assert row["output_tokens"] == 5 and prof["wall_ms"] > 0 and 0 < prof["busy_ms"] <= prof["kernel_ms"] + 1e-6
    assert "GEMM/GEMV" in prof["categories"] and prof["kernels"][0]["us"] >= prof["kernels"][-1]["us"]
    assert run.profile_env("vllm") == {offline.PROFILE_ENV: "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert run.profile_env("flashpage") == {offline.PROFILE_ENV: "1"}


def test_a_profile_that_sees_no_kernel_leaves_the_measured_row(tiny_ckpt, tmp_path, cpu_engine, monkeypatch):
    """(vLLM's tensor-parallel workers run in processes of their own, where the profiler sees nothing)"""
    import torch.profiler

    class Blind(torch.profiler.profile):
        def events(self):
            return []

    monkeypatch.setattr(torch.profiler, "profile", Blind)
    row = _run_task(tiny_ckpt, tmp_path)
    assert row["output_tokens"] == 5 and row["output_tokens_per_s"] > 0
    assert row["profile"] == {"error": "RuntimeError: the profiler saw no kernel: the engine runs its model in "
                                       "another process"}


def test_a_profiled_runs_files_are_named_apart_written_or_rebuilt(tmp_path, monkeypatch):
    job = workloads.Job("offline", "tiny", Flags(max_model_len=64), tasks=[dict(workload="offline", name="random")])
    got = {"flashpage": {"rows": [dict(engine="flashpage", workload="offline", task="random", output_tokens_per_s=2.0)],
                         "versions": {"torch": "2.11.0", "triton": "3.6.0"}, "device": "NVIDIA H200"}}
    head = dict(device="NVIDIA H200", torch="2.11.0", triton="3.6.0", date="2026-11-28", command="c")
    assert [p.name for p in run.write_results(job, got, tmp_path / "w", head, profile=True)] == \
        ["profile_peers_offline_tiny_h200.json"]
    rows = tmp_path / "logs"
    rows.mkdir()
    run.rows_path(rows, job, "flashpage").write_text(json.dumps(got["flashpage"]))
    monkeypatch.setattr(run, "merged_jobs", lambda *a, **k: [job])  # the selection's one job
    for profile, name in ((True, "profile_peers_offline_tiny_h200.json"), (False, "peers_offline_tiny_h200.json")):
        out = tmp_path / f"rebuilt-{profile}"
        args = run.argparse.Namespace(argv=[], engines=["flashpage"], profile=profile)
        assert run.rebuild_from_rows(args, [("offline", "llama-3.2-1b")], out, rows) == 0
        assert [p.name for p in out.iterdir()] == [name]
