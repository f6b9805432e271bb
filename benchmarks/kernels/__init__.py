"""Kernel benchmarks (GPU, triton.testing.do_bench medians): flash prefill, paged decode, the
batch-invariant kernels."""
