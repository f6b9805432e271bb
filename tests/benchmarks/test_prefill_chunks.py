"""benchmarks/kernels/bench_prefill_chunks.py on the CPU (interpreter): every chunk of a prompt with
its paged prefix, checked against the reference before it is timed, and the report of the rows."""

import pytest

from benchmarks.kernels import bench_prefill_chunks as bench


def test_chunks_with_their_paged_prefix_match_the_reference_and_report(capsys):
    bench.main(["--smoke", "--prompt", "13", "--chunk", "6"])  # chunks at 0, 6, 12: the last one a single token
    out = capsys.readouterr().out
    for start in (0, 6, 12):
        assert f"(chunk at {start})" in out
    assert "| whole prompt | flashpage |" in out and "Sum over the chunks: flashpage" in out
    # both program orders, paged and contiguous, and the prefix loop's options where there is a prefix
    for impl in ("flashpage_tiles_fastest", "flashpage_contiguous_tiles_fastest", "flashpage_split",
                 "flashpage_gathered", "flashpage_gathered_kernel", "flashpage_gathered_tile_map"):
        assert f"| 6 | {impl} |" in out
    assert "| 0 | flashpage_split |" not in out and "| 0 | flashpage_gathered |" not in out


def test_contiguous_rows_count_the_work_they_ran():
    """A contiguous row runs every query up to its chunk's end: at chunk 1 of 2 (4 + 4 tokens) it
    runs 8·4.5 = 36 query-key pairs for the chunk's 4·6.5 = 26, and the report's last column says so."""
    text = bench.report(dict(workload=dict(prompt=8, chunk=4, heads=1, kv_heads=1, head_dim=1, dtype="x",
                                           block_size=4),
                             rows=[dict(impl="flashpage_contiguous", chunk_start=4, chunk_len=4, ms=1.0, tflops=26.0)]))
    assert "| 4 | flashpage_contiguous | 1.00 | 26 | 36 |" in text


def test_a_wrong_kernel_output_stops_the_run(monkeypatch):
    real = bench.flash_prefill
    monkeypatch.setattr(bench, "flash_prefill", lambda *a, **kw: real(*a, **kw) * 1.5)
    with pytest.raises(SystemExit, match="CHECK FAILED: flashpage"):
        bench.main(["--smoke", "--prompt", "8", "--chunk", "4"])


def test_flops_count_the_causal_work_of_a_chunk():
    # 2 queries at positions 4 and 5 see 5 and 6 keys: 11 query-key pairs, 4 flops per pair per head-dim
    assert bench.chunk_flops(4, 2, heads=1, d=1) == 4 * 11
