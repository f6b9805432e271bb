"""benchmarks/quant/bench_quant.py's bookkeeping on the CPU (its measurements need a GPU): the ratios
against bf16 and the goals (4-bit judged by the 4-bit goal, +prescale runs too), the fastest GEMV tiles per linear and
kind, and the table's lines (a format whose engine failed says why)."""

import pytest

from benchmarks.quant.bench_quant import (base_format, best_configs, gemms_switches, install_gemv_configs,
                                         linear_shapes, summarize, table)


def test_summary_goals_tuned_tiles_and_table():
    rows = [dict(step="tpot", format="bf16", tpot_ms=6.0, weight_bytes=16 * 2**30),
            dict(step="tpot", format="fp8-dynamic", tpot_ms=3.3, weight_bytes=8 * 2**30),
            dict(step="tpot", format="awq", tpot_ms=2.7, weight_bytes=5 * 2**30),
            dict(step="tpot", format="awq+prescale", tpot_ms=2.4, weight_bytes=5 * 2**30),
            dict(step="tpot", format="bf16+pdl", tpot_ms=5.7, weight_bytes=16 * 2**30),
            dict(step="throughput", format="bf16", tok_per_s=1000.0),
            dict(step="throughput", format="fp8-dynamic", tok_per_s=1250.0),
            dict(step="engine", format="fp8-block", error="exit status 1"),
            dict(step="sweep", impl="fp8_gemv", n=6144, k=4096, config=[16, 512, 4, 0], us=30.0),
            dict(step="sweep", impl="fp8_gemv", n=6144, k=4096, config=[8, 512, 4, 0], us=25.0),
            dict(step="sweep", impl="int4_gemv", n=6144, k=4096, config=[4, 512, 2, 0], error="OutOfResources"),
            dict(step="sweep", impl="int4_half2_gemv", n=6144, k=4096, config=[8, 1024, 4, 0], us=9.0),
            dict(step="gemm", linear="qkv_proj", m=1, impl="ours_fp8", us=31.5)]
    s = summarize(rows)
    assert s["tpot_ratio_fp8-dynamic"] == 0.55 and s["tpot_goal_met_fp8-dynamic"]  # <= 0.6
    assert s["tpot_ratio_awq"] == 0.45 and not s["tpot_goal_met_awq"]  # 4-bit: <= 0.4
    assert s["tpot_ratio_awq+prescale"] == 0.4 and s["tpot_goal_met_awq+prescale"]  # the 4-bit goal too
    assert s["tpot_ratio_bf16+pdl"] == 0.95 and "tpot_goal_met_bf16+pdl" not in s  # an option of bf16: no goal
    assert s["throughput_ratio_fp8-dynamic"] == 1.25 and not s["throughput_goal_met_fp8-dynamic"]  # >= 1.3
    assert "tpot_goal_met_fp8-block" not in s
    # failed configs never win; the half2 loop's picks are its own, not int4's
    assert best_configs(rows) == {"fp8 6144 4096": [8, 512, 4, 0], "int4_half2 6144 4096": [8, 1024, 4, 0]}
    text = table(dict(rows=rows, summary=s, shape="llama-3.1-8b"))
    assert "fp8-dynamic: TPOT 3.300 ms (x0.55), 1250.0 tok/s (x1.25)" in text
    assert "fp8-block: exit status 1" in text
    assert "qkv_proj: - | - | - | 31.5 |" in text  # bf16_cublas, ours_bf16_gemv, fp8_scaled_mm, ours_fp8
    assert linear_shapes("llama-3.1-8b") == {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
                                             "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


def test_format_options_set_the_gemms_switches_on_and_off():
    assert gemms_switches("awq+no-prescale+pdl") == {"HALF2_PRESCALE": False}
    assert gemms_switches("fp8-dynamic+quantfirst") == {"FP8_GEMV_QUANT_FIRST": True}
    assert gemms_switches("fp8-block+no-w8a16+pdl") == {"ONE_ROW_W8A16": False}
    assert gemms_switches("gptq-desc-act") == {} and base_format("gptq-desc-act+no-quantfirst") == "gptq-desc-act"
    with pytest.raises(SystemExit, match="unknown format option"):
        gemms_switches("awq+prescal")


def test_gemv16_option_and_the_sweeps_bf16_tiles_in_config16(monkeypatch):
    # +no-gemv16 sets no gemms switch (the child sets FLASHPAGE_GEMV16 before the model is built)
    assert gemms_switches("bf16+no-gemv16") == {} and base_format("bf16+no-gemv16+pdl") == "bf16"
    import kernels.gemv as gemv

    monkeypatch.setattr(gemv, "config", gemv.config)
    monkeypatch.setattr(gemv, "config16", gemv.config16)
    default = gemv.config16(4096, 14336)
    install_gemv_configs({"bf16 4096 4096": [16, 512, 4, 0], "fp8 4096 4096": [8, 512, 4, 0]})
    assert gemv.config16(4096, 4096) == gemv.GemvConfig(16, 512, 4, 0)
    assert gemv.config16(4096, 14336) == default  # not swept: the default
    assert gemv.config(4096, 4096, False) == gemv.GemvConfig(8, 512, 4, 0)
