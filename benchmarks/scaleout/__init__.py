"""More than one GPU: replicas behind vllm-router (bench_scaleout.py and its load, observer and report),
tensor parallelism (bench_tp.py)."""
