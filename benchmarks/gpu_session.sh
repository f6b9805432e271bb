#!/usr/bin/env bash
# One device call: GPU tests, then the engine benchmarks. Run from the repo root on the GPU machine
# with .whl carried (fastapi/uvicorn/pydantic wheels, see ../shared/device/fetch-wheels.sh).
#   bash benchmarks/gpu_session.sh [tests|throughput|prefix|load]...
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
status=0
for step in "${@:-tests throughput prefix}"; do
  for s in $step; do
    echo "=== $s"
    case $s in
      tests) python3 -m pytest -q tests/gpu tests/kernels -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1 ;;
      throughput) python3 benchmarks/bench_throughput.py --out-dir "$OUT" 2>&1 | tee "$OUT/throughput.log" || status=1 ;;
      prefix) python3 benchmarks/bench_prefix.py --out-dir "$OUT" 2>&1 | tee "$OUT/prefix.log" || status=1 ;;
      load) python3 benchmarks/compare.py --out-dir "$OUT" "${LOAD_ARGS[@]:-}" 2>&1 | tee "$OUT/load.log" || status=1 ;;
    esac
  done
done
exit $status
