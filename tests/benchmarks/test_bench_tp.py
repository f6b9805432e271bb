"""benchmarks/scaleout/bench_tp.py's arithmetic and report (its whole path, servers and offline engines at
TP 1 and 4, ran on the CPU with `--device cpu` when it was written; on a GPU it is the lead's)."""

from pathlib import Path

import pytest

from benchmarks import make_report
from benchmarks.scaleout import bench_tp


def _row(tp, tpot, floor, load=(), offline=None, custom=None):
    row = {"tp": tp, "custom_all_reduce": custom, "tpot_ms": tpot, "floor_ms": floor, "tpot_over_floor": round(tpot / floor, 3),
           "load": [{"concurrency": c, "output_tokens_per_s": t} for c, t in load]}
    if offline:
        row["offline"] = {"tokens_per_s": offline}
    return row


def test_goals_are_the_issues():
    eight = [_row(1, 6.5, 5.35), _row(2, 3.8, 2.68)]
    (g,) = bench_tp.goals("llama-3.1-8b", eight)
    assert g["ratio"] == round(3.8 / 6.5, 3) and g["met"]
    (g,) = bench_tp.goals("llama-3.1-70b", [_row(4, 16.0, 11.76)])
    assert g["ratio"] == round(16.0 / 11.76, 3) and not g["met"]  # over 1.3x the floor
    assert bench_tp.goals("llama-3.1-8b", eight[:1]) == []  # no TP=2 row: nothing to judge


def test_the_goals_are_judged_on_h100s_only():
    """The floor's 3.0 TB/s and the ratios are set on H100s: an H200 run's ratio is shown, not
    judged, also where a file written before said `met` there."""
    (g,) = bench_tp.goals("llama-3.1-70b", [_row(4, 12.25, 11.76)], "NVIDIA H200")
    assert g["met"] is None and g["ratio"] == round(12.25 / 11.76, 3)
    old = {"shape": "llama-3.1-70b", "device": "NVIDIA H200", "rows": [_row(4, 12.25, 11.76)],
           "goals": [dict(g, met=True)]}
    assert "(the goal is an H100's; this ran on NVIDIA H200)" in bench_tp.report(old)


def test_the_readme_report_of_a_tp_file():
    result = {"shape": "llama-3.1-70b", "device": "NVIDIA H100 80GB HBM3",
              "rows": [_row(4, 14.2, 11.76, load=[(1, 70.0), (64, 2900.0)], offline=3100.0)]}
    result["goals"] = bench_tp.goals("llama-3.1-70b", result["rows"])
    text = bench_tp.report(result)
    assert "| 4 | - | 14.20 | 11.76 | 1.21 | 3,100 | 70 | 2,900 |" in text and "(met)" in text
    assert make_report.kind_of(Path("tp_llama-3.1-70b_h100.json")).module == "benchmarks.scaleout.bench_tp"  # found


def test_both_all_reduces_are_rows_of_their_own_each_judged_and_the_microbenchmark_reported():
    rows = [_row(1, 6.32, 5.35), _row(2, 4.33, 2.68, custom=False), _row(2, 3.7, 2.68, custom=True)]
    nccl, custom = bench_tp.goals("llama-3.1-8b", rows)
    assert "(NCCL all-reduce)" in nccl["goal"] and nccl["ratio"] == round(4.33 / 6.32, 3) and not nccl["met"]
    assert "(custom all-reduce)" in custom["goal"] and custom["ratio"] == round(3.7 / 6.32, 3) and custom["met"]
    micro = {"tp": 2, "graph_ops": 32, "replays": 50, "custom": True,
             "rows": [{"bytes": 8192, "nccl_us": 21.5, "custom_us": 6.1, "nccl_over_custom": 3.52},
                      {"bytes": 4 << 20, "nccl_us": 60.0}]}  # past the one-shot's buffer: NCCL's only
    text = bench_tp.report({"rows": rows, "goals": [nccl, custom], "all_reduce": [micro]})
    assert "| 2 | NCCL | 4.33 |" in text and "| 2 | custom | 3.70 |" in text and "| 1 | - | 6.32 |" in text
    assert "| 8,192 | 21.5 | 6.1 | 3.52 |" in text and "| 4,194,304 | 60.0 | - | - |" in text


def test_a_failed_all_reduce_microbenchmark_ends_its_wait_at_once_and_is_reported():
    """A rank of the microbenchmark that fails leaves the others in a collective for good: the wait
    for rank 0's report ends when a rank has exited with an error (not after its 300 s), and
    bench_tp reports the failure and goes on to its servers."""
    import queue
    import time
    from types import SimpleNamespace

    from benchmarks.shared.common import wait_for_report

    out = queue.Queue()
    ranks = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=None)]
    out.put(("rows", [], True))
    assert wait_for_report(ranks, out, 300) == ("rows", [], True)
    ranks[1].exitcode = 1
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exit codes \[None, 1\]"):
        wait_for_report(ranks, out, 300, poll=0.01)
    assert time.monotonic() - t0 < 1
    text = bench_tp.report({"rows": [_row(1, 6.32, 5.35)], "all_reduce": [{"tp": 2, "error": "no report", "rows": []}]})
    assert "One all-reduce at TP=2: failed (no report)." in text
