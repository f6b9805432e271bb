"""benchmarks/kernels/bench_fp8_kv.py's report: it renders whatever columns a file's decode rows carry,
those of files written while the fp8 kernel had its FP8_CAST option (row["casts"], a tail key per
cast) beside the rows written since (the tail's fp8 launch under the default cast's keys)."""

from benchmarks.kernels.bench_fp8_kv import report

_ROW = dict(impl="paged_decode", batch=16, context=4096, heads=32, kv_heads=8, head_dim=128, kv_bytes_16bit=2**30,
            copy_share_16bit=0.9, copy_share_fp8=0.6, speedup=1.33, ms_fp8_fused=0.1, copy_share_16bit_fused=0.8,
            copy_share_fp8_fused=0.5)


def test_old_cast_columns_and_new_rows_render_alike():
    old = dict(_ROW, casts={"asm_v": dict(copy_share=0.55, speedup=1.2)},
               tail={"ms_16bit": 1.0, "ms_fp8_cast": 1.0, "ms_fp8_asm_v": 1.0, "ms_fp8_asm": 1.0, "rel_err": 0.0,
                     "copy_share_16bit": 0.97, "copy_share_fp8_cast": 0.71, "copy_share_fp8_asm_v": 0.69,
                     "copy_share_fp8_asm": 0.52})
    new = dict(_ROW, tail={"ms_16bit": 1.0, "ms_fp8_cast": 1.0, "rel_err": 0.0, "copy_share_16bit": 0.96,
                           "copy_share_fp8_cast": 0.74})
    head, _, r_old, r_new = report({"rows": [old, new]}).splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert cols[8:] == ["fp8 asm_v % copy (x)", "fused write: 16-bit / fp8 % copy",
                        "fused, NEW_KV_TAIL: 16-bit % copy", "fused, NEW_KV_TAIL: fp8 cast % copy",
                        "fused, NEW_KV_TAIL: fp8 asm_v % copy", "fused, NEW_KV_TAIL: fp8 asm % copy"], head
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")][8:]  # noqa: E731
    assert cells(r_old) == ["55% (1.20x)", "80% / 50%", "97%", "71%", "69%", "52%"], r_old
    assert cells(r_new) == ["", "80% / 50%", "96%", "74%", "", ""], r_new
    # a file of rows written since renders the new rows' columns alone
    head, _, row = report({"rows": [new]}).splitlines()
    assert head.count("|") == 12 and row.endswith("| 96% | 74% |"), (head, row)
