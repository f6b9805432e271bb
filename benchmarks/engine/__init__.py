"""Benchmarks of the engine through its Python API (no HTTP): offline throughput, two commits side by
side, prefix caching, structured outputs and penalties, speculative decoding; and batch invariance
(bench_determinism.py, over HTTP)."""
