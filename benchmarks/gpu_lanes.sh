#!/usr/bin/env bash
# gpu_session.sh runs side by side on one host's GPUs ("lanes"), each on its own GPUs with its own
# output folder, all cut at one deadline; then each lane's folder is packed into one file under $OUT
# (a device call brings back at most 8 files) and each lane's log tail is printed.
#   bash benchmarks/gpu_lanes.sh SECONDS 'g0:0:fp8kv' 'g1:1:quanttests' 'tp:2,3:tp2profile tp2tests'
# A lane is name:gpus:steps, the steps as gpu_session.sh takes them; VAR=value words among them are
# set for that lane alone ('g2:2:SPEC_S=300 spec-policies'). Device time counts per host, so four
# one-GPU lanes on a host of four cost what one costs alone; the host's CPUs are shared (host-bound
# figures, batch-1 TPOT most, may move: the closing note says which lanes ran beside which).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
deadline=$1; shift
bash benchmarks/gpu_session.sh none > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
for lane in "$@"; do
  IFS=: read -r name gpus steps <<< "$lane"
  dir=/tmp/lanes/$name; rm -rf "$dir"; mkdir -p "$dir"
  vars=(); words=()
  for w in $steps; do if [[ $w == *=* ]]; then vars+=("$w"); else words+=("$w"); fi; done
  # (timeout signals its whole process group, and the steps' own timeouts pass the signal on)
  ( timeout -k 15 "$deadline" env "${vars[@]}" CUDA_VISIBLE_DEVICES="$gpus" OUT="$dir" \
      bash benchmarks/gpu_session.sh "${words[@]}" > "$dir/lane.log" 2>&1
    echo "lane $name exit $?" >> "$dir/lane.log" ) &
done
wait
for lane in "$@"; do
  name=${lane%%:*}
  tar -czf "$OUT/$name.tgz" -C /tmp/lanes "$name"
  echo "=== lane $name ($lane)"; grep -v -e '^{' -e 'Warning' "/tmp/lanes/$name/lane.log" | tail -n "${LANE_TAIL:-30}"
done
