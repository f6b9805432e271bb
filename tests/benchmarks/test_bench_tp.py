"""benchmarks/scaleout/bench_tp.py's arithmetic and report (its whole path, servers and offline engines at
TP 1 and 4, ran on the CPU with `--device cpu` when it was written; on a GPU it is the lead's)."""

from pathlib import Path

from benchmarks import make_report
from benchmarks.scaleout import bench_tp


def _row(tp, tpot, floor, load=(), offline=None):
    row = {"tp": tp, "tpot_ms": tpot, "floor_ms": floor, "tpot_over_floor": round(tpot / floor, 3),
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


def test_the_readme_report_of_a_tp_file():
    result = {"shape": "llama-3.1-70b", "rows": [_row(4, 14.2, 11.76, load=[(1, 70.0), (64, 2900.0)], offline=3100.0)]}
    result["goals"] = bench_tp.goals("llama-3.1-70b", result["rows"])
    text = bench_tp.report(result)
    assert "| 4 | 14.20 | 11.76 | 1.21 | 3,100 | 70 | 2,900 |" in text and "(met)" in text
    assert make_report.kind_of(Path("tp_llama-3.1-70b_h100.json")).module == "benchmarks.scaleout.bench_tp"  # found
