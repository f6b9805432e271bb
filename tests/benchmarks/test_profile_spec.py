"""benchmarks/profiling/profile_spec.py: the phases it cuts a speculative cycle into, the device
time it credits each, and its whole path on the CPU (the tiny shapes, a draft model)."""

import json

import pytest

from benchmarks.profiling import profile_spec


def test_cycles_from_host_spans():
    """Each cycle runs from one proposer round to the next: the round, the verification's launch to
    the end of its collect, and the host's remainder; a prefill step before the first round and a
    last round with no verification after it are no cycles."""
    spans = [("launch", 0.0, 0.1), ("collect", 0.2, 0.5),  # the prompt's step
             ("propose", 1.0, 1.3), ("launch", 1.35, 1.4), ("collect", 1.4, 1.9),
             ("propose", 2.0, 2.2), ("launch", 2.3, 2.4), ("collect", 2.5, 2.8),
             ("propose", 3.0, 3.1)]
    rows = profile_spec.cycles(spans)
    assert len(rows) == 2
    assert rows[0] == pytest.approx({"cycle_ms": 1000.0, "propose_ms": 300.0, "verify_ms": 550.0, "host_ms": 150.0})
    assert rows[1] == pytest.approx({"cycle_ms": 1000.0, "propose_ms": 200.0, "verify_ms": 500.0, "host_ms": 300.0})


def test_busy_in_clips_kernels_to_ranges_and_counts_overlap_once():
    kernels = [(0.0, 10.0), (5.0, 12.0), (20.0, 30.0), (40.0, 50.0)]
    assert profile_spec.busy_in(kernels, [(0.0, 25.0)]) == pytest.approx(17.0)  # [0, 12) and [20, 25)
    assert profile_spec.busy_in(kernels, [(8.0, 9.0), (45.0, 60.0)]) == pytest.approx(6.0)
    assert profile_spec.busy_in(kernels, [(13.0, 19.0)]) == 0.0


def test_a_draft_model_cycle_on_the_cpu(tmp_path):
    result = profile_spec.main(["--target-shape", "tiny", "--device", "cpu", "--prompt-len", "16", "--max-tokens", "24",
                                "--out-dir", str(tmp_path)])
    assert result["cycles"] >= 3 and result["verifications"] >= result["cycles"]
    assert result["propose_ms"] > 0 and result["verify_ms"] > 0 and result["host_ms"] >= 0
    assert result["cycle_ms"] >= result["propose_ms"]
    assert json.loads((tmp_path / "profile_spec_draft_model_cpu.json").read_text())["method"] == "draft_model"


def test_phase_kernels_lead_tail_and_categories_per_cycle():
    """Two ranges (cycles): the host's lead before each range's first kernel, the tail after its last,
    the busy time clipped to the ranges, and the kernels inside them by category."""
    kernels = [(0.0, "nvjet_a", 10.0), (12.0, "_decode_kernel", 3.0), (30.0, "outside", 5.0),
               (50.0, "_chunk_kernel", 2.0)]
    d = profile_spec.phase_kernels(kernels, [(-5.0, 20.0), (45.0, 60.0)], 2)
    assert (d["busy_ms"], d["lead_ms"], d["tail_ms"]) == pytest.approx((0.0075, 0.005, 0.0065), abs=6e-4)
    assert d["kernels"] == 1.5 and set(d["categories"]) == {"GEMM/GEMV", "attention decode", "sampling/argmax"}
