"""README's results section is generated from benchmarks/results/*.json and must match them."""

import pytest

from benchmarks import make_report


def test_readme_results_match_result_files():
    assert make_report.main(["--check"]) == 0, "README is stale: run python benchmarks/make_report.py"


def test_every_result_file_has_the_shared_shape():
    import json

    for f in (make_report.ROOT / "benchmarks" / "results").glob("*.json"):
        if f.name.startswith("sweep_"):
            continue
        result = json.loads(f.read_text())
        for key in ("device", "torch", "triton", "date", "command", "rows"):
            assert key in result, f"{f.name} lacks {key!r}"
        assert all("impl" in row for row in result["rows"]), f.name


def test_load_report_takes_the_offline_reference_of_a_throughput_file():
    """compare.py --offline-json reads bench_throughput.py's result format; the load section then
    sets the 256-client row against it."""
    import json
    import re

    from benchmarks.serving.compare import report
    from benchmarks.serving.load_sweep import read_offline

    results = make_report.ROOT / "benchmarks" / "results"
    load = json.loads((results / "load_h100.json").read_text())
    off = read_offline(results / "throughput_gpt2_h100.json", load["device"])
    assert off["output_tokens_per_s"] > 0 and len(off["workload"]["input_len"]) == 2
    md = report({**load, "offline": off})
    assert re.search(r"At 256 clients: [\d,]+ tok/s = \d+% of offline", md)
    plain = {**load, "rows": [r for r in load["rows"] if r.get("api_server_count") is None]}
    plain.pop("api_sweep", None)
    assert "API processes" in md and "API processes" not in report(plain)  # the sweep's table comes with its rows


def test_report_api_sweep_only_and_merge_checks():
    from benchmarks.serving.compare import report
    from benchmarks.serving.load_sweep import add_row, merge

    rows = [{"impl": "triton", "concurrency": 256, "api_server_count": n, "output_tokens_per_s": 1000.0 * n,
             "errors": 0, "ttft_p50_ms": 50.0} for n in (1, 2)]
    result = {"device": "cpu", "torch": "x", "triton": "x", "date": "d", "command": "c", "slug": "cpu",
              "settings": {}, "rows": rows, "failures": [{"impl": "triton", "api_server_count": 4,
                                                          "stage": "start", "message": "did not start"}]}
    md = report(result)
    assert "| impl | concurrency |" not in md and "load_cpu_throughput.png" not in md  # no impl sweep rows
    assert "| 2 | 256 | 2,000 | 2.00× |" in md and "% of offline" not in md and "load_cpu_api_servers.png" in md
    assert "`triton` with `--api-server-count 4` failed at start" in md

    new = {"device": "cpu", "command": "c2", "settings": {"input_len": 16, "concurrency": [1], "impls": ["eager"]},
           "rows": []}
    with pytest.raises(ValueError, match="input_len"):
        merge({**result, "settings": {"input_len": 32}}, new, [("eager", None, [1])])
    with pytest.raises(ValueError, match="cpu"):
        merge({**result, "device": "H100"}, new, [("eager", None, [1])])
    merged = merge(result, {**new, "api_sweep": {}}, [("triton", 4, [256])])
    assert merged["failures"] == [] and merged["command"] == "c && c2" and len(merged["rows"]) == 2
    add_row(merged, dict(rows[1], output_tokens_per_s=5.0))
    assert [r["output_tokens_per_s"] for r in merged["rows"]] == [1000.0, 5.0]


def test_merged_rows_of_another_day_say_so():
    """A file whose triton rows were measured again after the peers' says which rows are of which
    day (the header's single date would claim the peers ran beside the new code)."""
    from benchmarks.serving.compare import report
    from benchmarks.serving.load_sweep import merge

    settings = {"input_len": 16, "concurrency": [1], "impls": ["triton", "eager"]}
    row = {"concurrency": 1, "output_tokens_per_s": 10.0, "errors": 0, "ttft_p50_ms": 1.0}
    old = {"device": "cpu", "torch": "x", "triton": "x", "date": "2026-01-01", "command": "c", "slug": "cpu",
           "settings": settings, "rows": [dict(row, impl="triton"), dict(row, impl="eager")]}
    new = {"device": "cpu", "date": "2026-02-02", "command": "c2", "settings": dict(settings, impls=["triton"]),
           "rows": []}
    merged = merge(old, new, [("triton", None, [1])])
    assert merged["impl_dates"] == {"triton": "2026-02-02", "eager": "2026-01-01"}
    assert "`triton` rows 2026-02-02; `eager` rows 2026-01-01" in report(merged)
    assert "rows 2026" not in report(old)  # one day: the date alone
