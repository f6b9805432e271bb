"""benchmarks/profiling/profile_prefill.py on the CPU: a prompt in chunks, its TTFT, and the profiled
request's steps (one per chunk) and operators by category."""

from benchmarks.profiling import profile_prefill


def test_a_chunked_prompt_is_timed_and_split_by_category(tmp_path, capsys):
    result = profile_prefill.main(["--shape", "tiny-llama", "--device", "cpu", "--prompt", "40", "--chunk", "16",
                                   "--reps", "1", "--out-dir", str(tmp_path)])
    p = result["profile"]
    assert len(p["step_ms"]) >= 3  # chunks of 16, 16 and 8 tokens, each a step of its own
    assert result["ttft_ms"] > 0 and p["wall_ms"] >= sum(p["step_ms"]) * 0.99
    assert "attention prefill" in p["categories"] and p["kernels"]
    assert (tmp_path / "profile_prefill_tiny-llama_40_cpu.json").exists()
    assert "a 40-token prompt in chunks of 16" in capsys.readouterr().out
