"""Benchmarks, one package per subject; every script runs from the repo root as a module:

    python -m benchmarks.<package>.<name> [--help]

kernels/ (flash prefill, paged decode, batch-invariant kernels), engine/ (offline throughput, two
commits side by side, prefix caching, structured outputs, determinism, speculative decoding),
serving/ (the HTTP load test, the naive transformers peer, soak, slow clients), scaleout/ (replicas
behind vllm-router, tensor parallelism), quant/ (quantized weights), peers/ (vLLM side by side),
profiling/ (where time goes); shared/ holds what they share (servers on loopback, result files and
device names, random checkpoints). The vLLM side's own tools in peers/ (vllm_probe.py, fetch/) run
by path, under vLLM's site or before this checkout is importable, as their docstrings show.

Results: benchmarks/results/ (the current file of each benchmark, shape and device; experiments/
holds A/B runs and profiles), rendered into docs/benchmarks.md and the README's headline table by
`python -m benchmarks.make_report`. On a GPU machine: `bash benchmarks/gpu_session.sh`.
"""
