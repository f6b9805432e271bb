"""docs/benchmarks.md and the README's headline table are generated from the current result files
(benchmarks/results/, top level) and must match them; results/experiments/ is never read."""

import json
import re

import pytest

from benchmarks import make_report


def test_docs_and_readme_match_result_files():
    assert make_report.main(["--check"]) == 0, "stale: run python -m benchmarks.make_report"


def test_make_report_reads_every_current_file_and_nothing_else():
    by_kind = make_report.current_files()
    read = [f for files in by_kind.values() for f in files]
    assert all(f.parent == make_report.RESULTS for f in read)  # the top level only, never experiments/
    assert sorted(read) == sorted(make_report.RESULTS.glob("*.json"))  # and every file there
    doc = make_report.DOC.read_text()
    for f in make_report.RESULTS.iterdir():  # every current plot is shown, no experiment is
        if f.suffix == ".png":
            assert f"benchmarks/results/{f.name})" in doc, f"{f.name} is shown nowhere"
    assert "results/experiments/" not in doc.replace("`benchmarks/results/experiments/`", "")


def test_a_file_no_renderer_reads_is_refused(tmp_path):
    assert make_report.kind_of(tmp_path / "quant_quality_cpu.json").func == "quality_report"  # the longest prefix
    (tmp_path / "oneoff_ab_h100.json").write_text("{}")
    with pytest.raises(ValueError, match="oneoff_ab_h100.json"):
        make_report.current_files(tmp_path)


def test_every_result_file_has_the_shared_shape():
    for f in make_report.RESULTS.glob("*.json"):
        result = json.loads(f.read_text())
        for key in ("device", "torch", "triton", "date", "command", "rows"):
            assert key in result, f"{f.name} lacks {key!r}"
        assert all("impl" in row for row in result["rows"]), f.name


def test_headline_table_cells_come_from_their_files():
    """Each figure of the README's table links the file it is read from, and says so for a vLLM run
    that failed rather than leaving it blank."""
    from benchmarks.headline import headline

    text = headline(make_report.RESULTS)
    off = json.loads((make_report.RESULTS / "peers_offline_llama-3.2-1b_h100.json").read_text())
    fp = next(r for r in off["rows"] if r.get("impl") == "flashpage")
    row = next(line for line in text.splitlines() if line.startswith("| offline, tok/s | Llama-3.2-1B |"))
    assert f"[{fp['output_tokens_per_s']:,.0f}](benchmarks/results/peers_offline_llama-3.2-1b_h100.json)" in row
    vl = next((r for r in off["rows"] if r.get("impl") == "vllm"), {})  # its figure, or "failed" if it failed
    assert (f"| {vl['output_tokens_per_s']:,.0f} |" if "output_tokens_per_s" in vl
            else "[failed](docs/benchmarks.md#side-by-side-with-vllm)") in row
    hf = json.loads((make_report.RESULTS / "throughput_llama-3.2-1b_h100.json").read_text())
    best = max(r["output_tokens_per_s"] for r in hf["rows"] if r["impl"] in ("hf_eager", "hf_sdpa"))
    assert f"{best:,.0f} (hf_" in row
    assert re.search(r"\| batch 1, TPOT ms \| Llama-3.1-8B \| \[\d+\.\d\d\]", text)
    # a shape split over GPUs: its row from whichever GPU's run there is (its file named _tp<N>)
    name = next(make_report.RESULTS.glob("peers_batch1_llama-3.1-70b_tp4_*.json")).name
    tp = json.loads((make_report.RESULTS / name).read_text())
    by = {r["impl"]: r["tpot_ms"] for r in tp["rows"]}
    row = next(line for line in text.splitlines()
               if line.startswith("| batch 1, TPOT ms | Llama-3.1-70B, tensor parallel over 4 GPUs |"))
    assert f"[{by['flashpage']:.2f}](benchmarks/results/{name}) | {by['vllm']:.2f} |" in row


def test_capability_rows_come_from_their_files(tmp_path):
    """The capabilities table: each 'with' figure links its file, the speed-up is computed from the
    two figures, and a capability without a current file has no row."""
    import shutil

    from benchmarks.headline import capabilities

    for name in ("spec_h100.json", "tp_llama-3.1-8b_h100.json"):
        shutil.copy(make_report.RESULTS / name, tmp_path / name)
    text = capabilities(tmp_path)
    spec = json.loads((tmp_path / "spec_h100.json").read_text())
    by = {(r["clients"], r["config"]): r for r in spec["rows"]}
    on, off = by[1, "ngram p=0.8"], by[1, "off"]
    row = next(line for line in text.splitlines() if line.startswith("| speculation, n-gram | batch 1"))
    assert f"| {off['tpot_ms']:.2f} | [{on['tpot_ms']:.2f}](benchmarks/results/spec_h100.json) | " \
           f"{off['tpot_ms'] / on['tpot_ms']:.2f}× |" in row
    tp = {r["tp"]: r for r in json.loads((tmp_path / "tp_llama-3.1-8b_h100.json").read_text())["rows"]}
    assert f"{tp[2]['tpot_ms'] / tp[1]['tpot_ms']:.2f}× the time" in text
    assert "KV cache: fp8" not in text and "weights:" not in text and "EAGLE-3" not in text
    assert capabilities(tmp_path / "none") == ""


def test_runs_of_a_kind_are_rows_of_one_table(tmp_path, monkeypatch):
    def result(date, tok):
        return {"device": "NVIDIA H100 80GB HBM3", "torch": "x", "triton": "x", "date": date, "command": "c",
                "workload": {"num_requests": 1, "input_len": [1, 2], "output_len": [1, 2], "model": "m"},
                "rows": [{"impl": "flashpage", "output_tokens_per_s": tok}]}

    (tmp_path / "throughput_gpt2_h100.json").write_text(json.dumps(result("2026-01-01", 5.0)))
    (tmp_path / "throughput_qwen3-0.6b_h100.json").write_text(json.dumps(result("2026-02-02", 7.0)))
    monkeypatch.setattr(make_report, "ROOT", tmp_path)
    doc = make_report.render_doc(tmp_path)
    assert doc.count("### Engine throughput (offline)\n") == 1
    assert ("| [gpt2, h100](#engine-throughput-offline-gpt2-h100) | flashpage 5 tok/s | NVIDIA H100 80GB HBM3 | "
            "2026-01-01 | `c` |") in doc
    assert "| [qwen3-0.6b, h100](#engine-throughput-offline-qwen3-06b-h100) |" in doc and "2026-02-02" in doc
    assert "## Kernels" not in doc  # a subject without files has no section


def test_load_report_takes_the_offline_reference_of_a_throughput_file():
    """compare.py --offline-json reads bench_throughput.py's result format; the load section then
    sets the 256-client row against it."""
    import json
    import re

    from benchmarks.serving.compare import report
    from benchmarks.serving.load_sweep import read_offline

    results = make_report.RESULTS
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
