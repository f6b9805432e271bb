#!/usr/bin/env bash
# Side-by-side runs (benchmarks/peers/run.py) next to each other on one host's GPUs ("lanes"), each
# on its own GPUs with its own folders, all cut at one deadline; then each lane's folder (result
# files, engine logs) is packed into one file under $OUT (a device call brings back at most 8 files)
# and the tables of every result file are printed. vLLM must be unpacked first (fetch/unpack_vllm.sh).
#   bash benchmarks/peers/lanes.sh SECONDS 'long:0:--workloads long:llama-3.1-8b' \
#     'fp8:1:--workloads batch1:llama-3.1-8b.fp8-dynamic' \
#     'tp2:2,3:--workloads batch1:llama-3.1-8b --tensor-parallel-size 2 --load-format dummy'
# A lane is name:gpus:run.py's arguments (--out-dir and --log-dir are the lane's). The lanes share the
# checkpoints' folder: make a checkpoint that two lanes read first (run.py --checkpoints-only); a
# quantized copy one lane alone reads is made in it. Device time counts per host, so lanes cost what one
# costs alone; the host's CPUs are shared (the closing note says which lanes ran beside which).
# On four H200s (2026-11-28) the three lanes above, both engines each, took 202 s.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export VLLM_SITE=${VLLM_SITE:-/tmp/vllm-site} PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
deadline=$1; shift
names=()
for lane in "$@"; do
  IFS=: read -r name gpus args <<< "$lane"  # (args keeps its own colons: long:llama-3.1-8b)
  dir=/tmp/peer-lanes/$name; rm -rf "$dir"; mkdir -p "$dir"; names+=("$name")
  # shellcheck disable=SC2086
  ( CUDA_VISIBLE_DEVICES=$gpus timeout -s TERM "$deadline" python3 benchmarks/peers/run.py $args \
      --out-dir "$dir" --log-dir "$dir/logs" > "$dir/run.log" 2>&1
    echo "lane $name exit $?" >> "$dir/run.log" ) &
done
wait
for name in "${names[@]}"; do
  tar -czf "$OUT/$name.tgz" -C /tmp/peer-lanes "$name"
  echo "=== lane $name"; grep -v '^{' "/tmp/peer-lanes/$name/run.log" | tail -n "${LANE_TAIL:-8}"
  for f in /tmp/peer-lanes/"$name"/peers_*.json; do
    [ -e "$f" ] && python3 -c "import json, sys; from benchmarks.peers.report import report
print(report(json.load(open(sys.argv[1]))))" "$f" | grep '^|'
  done
done
