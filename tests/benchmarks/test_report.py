"""README's results section is generated from benchmarks/results/*.json and must match them."""

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
