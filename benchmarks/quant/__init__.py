"""Quantized weights: GEMMs, TPOT and throughput on a GPU (bench_quant.py), perplexity per format
(bench_quant_quality.py), and the quantized checkpoints both use (quant_checkpoint.py)."""
