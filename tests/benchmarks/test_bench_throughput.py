"""benchmarks/engine/bench_throughput.py's engine timer, run on the CPU: it wraps the runner's launch
and collect to split the time, so a change of their signatures must show here, not on the GPU
(a bench_quant session lost its engine rows to a launch wrapper that missed `verifies`)."""

import json

from benchmarks.engine.bench_throughput import run_engine
from server.config import EngineConfig, SpeculativeConfig
from server.engine import LLMEngine


def test_run_engine_counts_every_token_and_splits_the_time(tmp_path):
    from tests.helpers import make_llama_checkpoint

    path = make_llama_checkpoint(tmp_path / "tiny")
    prompts = [[5 + i, 6, 7, 8, 9] * 2 for i in range(6)]
    outs = [3, 5, 4, 6, 2, 5]
    for spec in (None, SpeculativeConfig.parse(json.dumps({"method": "ngram", "num_speculative_tokens": 2}))):
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu", num_blocks=64, speculative_config=spec))
        launch = engine.runner.launch
        dt, tokens, split = run_engine(engine, prompts, outs)
        assert tokens == sum(outs) and dt > 0
        assert split["steps"] >= max(outs) // (3 if spec else 1) and split["prefill_steps"] >= 1
        assert engine.runner.launch == launch, "the runner's own launch is put back"
        assert engine.block_manager.check_all_free()
        engine.close()
