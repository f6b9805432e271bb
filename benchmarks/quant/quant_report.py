"""What docs/benchmarks.md shows of the quantization benchmarks' files: quant_<gpu>.json
(bench_quant.py: GEMMs, batch-1 TPOT and offline throughput per format) and quant_quality_<device>.json
(bench_quant_quality.py: perplexity per format). Nothing here needs a GPU."""

from __future__ import annotations

GEMM_IMPLS = ("bf16_cublas", "fp8_scaled_mm", "fp8_scaled_mm_with_quant", "fp8_triton_channel", "fp8_triton_block",
              "fp8_weight_only", "int4_weight_only")


def report(result: dict) -> str:
    """quant_<gpu>.json: per format, batch-1 TPOT and offline throughput against 16-bit (with the
    run's goals), then each linear's GEMM time per implementation and row count."""
    rows = result["rows"]
    tpot = {r["format"]: r for r in rows if r["step"] == "tpot"}
    tput = {r["format"]: r for r in rows if r["step"] == "throughput"}
    base_t, base_x = tpot.get("bf16", {}).get("tpot_ms"), tput.get("bf16", {}).get("tok_per_s")
    goals = ", ".join(f"{k} {v}" for k, v in result.get("goals", {}).items())
    out = [f"The {result['shape']} shape, random weights quantized on the GPU (round to nearest); goals: {goals}.", "",
           "| format | weights (GB) | batch-1 TPOT (ms) | vs bf16 | offline tok/s | vs bf16 |",
           "|---|---:|---:|---:|---:|---:|"]
    for fmt in result["formats"]:
        t, x = tpot.get(fmt, {}), tput.get(fmt, {})
        if not t and not x:
            continue
        tr = f"{t['tpot_ms'] / base_t:.2f}×" if t and base_t else ""
        xr = f"{x['tok_per_s'] / base_x:.2f}×" if x and base_x else ""
        gb = f"{t['weight_bytes'] / 1e9:.1f}" if t.get("weight_bytes") else ""
        out.append(f"| {fmt} | {gb} | {t.get('tpot_ms', '')} | {tr} | {x.get('tok_per_s', 0):,.0f} | {xr} |")
    failed = [r for r in rows if r["step"] == "engine" and r.get("error")]
    if failed:  # (an engine child that failed: its row says so, the run's other figures stand)
        out += ["", "Engines that did not run: " + ", ".join(f"{r['format']} ({r['error']})" for r in failed) + "."]
    gemm = [r for r in rows if r["step"] == "gemm" and "us" in r]
    # the known implementations in their order, then any a newer bench_quant added, as they come
    impls = [i for i in GEMM_IMPLS if any(r["impl"] == i for r in gemm)]
    impls += [i for i in dict.fromkeys(r["impl"] for r in gemm) if i not in impls]
    if gemm:
        out += ["", "GEMM time per linear (µs, medians of `triton.testing.do_bench`), by rows (m):", "",
                "| linear | n × k | m | " + " | ".join(impls) + " |", "|---|---|---:|" + "---:|" * len(impls)]
        by = {(r["linear"], r["m"], r["impl"]): r["us"] for r in gemm}
        for linear, n, k, m in dict.fromkeys((r["linear"], r["n"], r["k"], r["m"]) for r in gemm):
            cells = " | ".join(f"{by[(linear, m, i)]:.1f}" if (linear, m, i) in by else "" for i in impls)
            out.append(f"| {linear} | {n} × {k} | {m} | {cells} |")
    if result.get("tuned"):  # the GEMV tile sweep's fastest config per weight shape (kernels/gemv.py's order)
        out += ["", "GEMV tiles the sweep picked (one row): " + "; ".join(
            f"{key}: {cfg}" for key, cfg in result["tuned"].items()) + "."]
    return "\n".join(out)


def quality_report(result: dict) -> str:
    """quant_quality_<device>.json: perplexity per format against 16-bit, and the goal each meets."""
    out = [f"{result['model']}, {result['documents']} held-out documents ({result['split']}):", "",
           "| format | what | perplexity | vs 16-bit | goal | meets it |", "|---|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        ratio = f"{r['ratio']:.4f}" if r.get("ratio") else ""
        meets = "" if "meets_goal" not in r else ("yes" if r["meets_goal"] else "**no**")
        out.append(f"| {r['format']} | {r.get('quantization') or '16-bit'} | {r['ppl']:.3f} | {ratio} | "
                   f"{r.get('goal') or ''} | {meets} |")
    return "\n".join(out)
