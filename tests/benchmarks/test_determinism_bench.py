"""benchmarks/engine/bench_determinism.py: its --quick run against a real CPU server (default mode only: the
deterministic mode may run its kernels in Triton's interpreter, too slow here), the JSON it writes,
and its pieces (probe plan, prompts, the exact comparison of outputs, the mode ratios) on their own."""

import asyncio
import json
import math

import httpx

from benchmarks.engine.bench_determinism import Probe, Prompt, compare_modes, main, make_prompts, plan_probes, send_probe


def test_quick_default_mode_writes_counts_and_timings(tmp_path, capsys):
    # --device cpu: a CPU server and a result file named for the CPU even where a GPU is present
    rc = main(["--quick", "--modes", "default", "--out-dir", str(tmp_path), "--server-args", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads((tmp_path / "determinism_embedded_cpu.json").read_text())
    assert result["device"] == "cpu" and result["model"] == "embedded" and "--quick" in result["command"]
    assert {"torch", "date", "vocab_size", "context", "targets"} <= set(result)
    cfg = result["config"]
    assert (cfg["prompts"], cfg["copies"], cfg["background"], cfg["max_tokens"], cfg["concurrency"]) == \
        (2, 4, [0, 4], 4, [4])
    assert list(result["modes"]) == ["default"] and result["ratios"] == {} and result["criteria"] == {}

    m = result["modes"]["default"]
    assert "--deterministic" not in m["server_command"] and "--max-num-batched-tokens" in m["server_command"]
    assert m["probe_requests"] == 2 * 4 and m["probe_errors"] == 0
    assert [(p["phase"], p["background"], p["probes"], p["errors"]) for p in m["phases"]] == \
        [("alone", 0, 4, 0), ("bg0", 0, 2, 0), ("bg4", 4, 2, 0)]  # copy j of a prompt goes to phase j % 3
    assert m["phases"][1]["background_requests"] == {}
    assert m["greedy"]["requests"] + m["seeded"]["requests"] == 8 and m["seeded"]["requests"] == 2
    for kind in ("greedy", "seeded"):
        rows = m[kind]["per_prompt"]
        assert [r["prompt"] for r in rows] == [0, 1] and rows[0]["shared_prefix"] and not rows[1]["shared_prefix"]
        for r in rows:
            assert 1 <= r["distinct"] <= r["requests"] and 1 <= r["most_common_count"] <= r["requests"]
            assert set(r["distinct_by_phase"]) <= {"alone", "bg0", "bg4"}
            assert all(1 <= n <= r["distinct"] for n in r["distinct_by_phase"].values())
            assert len(r["divergences"]) == min(r["distinct"], 4) - 1
        assert m[kind]["max_distinct"] == max(r["distinct"] for r in rows) >= 1
        assert m[kind]["prompts_with_one_output"] == sum(r["distinct"] == 1 for r in rows)
    assert len(m["prompt_lengths"]) == 2 and max(m["prompt_lengths"]) <= cfg["max_prompt_len"]

    (row,) = m["throughput"]
    assert row["concurrency"] == 4 and row["errors"] == 0 and row["completed"] == row["num_requests"] == 8
    assert "output_tokens_per_s" in row
    assert m["batch1"]["concurrency"] == 1 and m["batch1"]["completed"] == 2 and m["batch1"]["errors"] == 0
    assert m["batch1"]["tpot_p50_ms"] is not None
    assert "| default | 8 | " in out and "batch-1 TPOT ms" in out


def test_probe_plan_and_prompts():
    prompts = make_prompts(8, vocab=1000, scale=300, seed=1)
    prefix = prompts[0].token_ids[:150]
    for p in prompts:
        assert 2 <= len(p.token_ids) <= 300 and all(0 <= t < 1000 for t in p.token_ids)
        assert p.shared_prefix == (p.index % 2 == 0) == (p.token_ids[:150] == prefix)
    assert len({p.seed for p in prompts}) == 8 and make_prompts(8, 1000, 300, 1) == prompts
    phases = ["alone", "bg0", "bg8", "bg64", "bg256"]
    probes = plan_probes(prompts, 128, phases, seeded_every=4)
    assert len(probes) == 1024
    for ph in phases:  # every phase gets both kinds of every prompt
        mine = [q for q in probes if q.phase == ph]
        assert {(q.prompt, q.kind) for q in mine} == {(i, k) for i in range(8) for k in ("greedy", "seeded")}
    # per prompt and phase: copies of rank 0..25, every 4th (3, 7, ..., 23) seeded: 6 ranks x 5 phases
    assert sum(q.kind == "seeded" for q in probes) == 8 * 30
    assert all(q.kind == "greedy" for q in plan_probes(prompts, 8, phases, seeded_every=0))


def test_outputs_compared_bit_for_bit():
    lp = [-0.5, -1.25]

    def answer(request):
        body = json.loads(request.content)
        assert body["logprobs"] == 1 and body["ignore_eos"] and body["prompt"] == [1, 2, 3]
        assert (body["temperature"], body.get("seed")) in ((0.0, None), (1.0, 7))
        return httpx.Response(200, json={"choices": [{"text": "ab", "finish_reason": "length", "logprobs": {
            "tokens": ["a", "b"], "token_logprobs": lp, "top_logprobs": [{"a": lp[0]}, {"b": lp[1]}]}}]})

    async def probe(kind):
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await send_probe(client, "http://mock", "m", Prompt(0, [1, 2, 3], False, 7), Probe(0, kind, "bg0"), 2)

    first, again = asyncio.run(probe("greedy")), asyncio.run(probe("seeded"))
    assert first.digest == again.digest and first.logprobs == lp
    lp[1] = math.nextafter(lp[1], 0.0)  # one ulp: another output
    assert asyncio.run(probe("greedy")).digest != first.digest


def test_ratios_and_criteria():
    def mode(tput, tpot, distinct):
        return {"throughput": [{"concurrency": c, "output_tokens_per_s": v} for c, v in tput.items()],
                "batch1": {"tpot_p50_ms": tpot}, "probe_requests": 1024, "probe_errors": 0,
                "greedy": {"max_distinct": distinct}, "seeded": {"max_distinct": 1}}

    ratios, criteria = compare_modes({"default": mode({64: 1000.0, 256: 2000.0}, 10.0, 5),
                                      "deterministic": mode({64: 900.0, 256: 1500.0}, 12.0, 1)})
    assert ratios == {"throughput": {"64": 0.9, "256": 0.75}, "batch1_tpot": 1.2}
    assert criteria["one_output_per_prompt"] and criteria["tpot_ratio_ok"] and not criteria["throughput_ratio_ok"]
    ratios, criteria = compare_modes({"deterministic": mode({64: 1.0}, 1.0, 2)})
    assert ratios == {} and not criteria["one_output_per_prompt"] and criteria["throughput_ratio_ok"] is None
    assert compare_modes({"default": mode({64: 1.0}, 1.0, 2)}) == ({}, {})
