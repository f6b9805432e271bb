#!/usr/bin/env bash
# On the GPU machine, from the repo root, once every part that benchmarks/peers/fetch/fetch_vllm.sh wrote
# has been carried (they stay there between calls to a warm machine):
#
#   bash benchmarks/peers/fetch/unpack_vllm.sh [PARTS_DIR] [--probe [PROBE ARGS]]     # PARTS_DIR: .vllm
#
# checks the parts against SHA256SUMS, unpacks /tmp/vllm-site (vLLM 0.26.0 and its dependencies) and
# /tmp/site (the flashpage server's wheels), prints vLLM's version as its own Python reports it and,
# with --probe, runs benchmarks/peers/vllm_probe.py (every import the harness needs, both CLIs) with
# the arguments after it (`--probe --checkpoint /tmp/peers-ckpt/qwen2.5-0.5b`: also what vLLM makes of it).
# If .vllm/fallback holds the unstripped _C (fetch_vllm.sh writes it; carry it only if the stripped one
# fails with "no kernel image is available"), it replaces the stripped one.
# Then: export VLLM_SITE=/tmp/vllm-site PYTHONPATH=/tmp/site:$PWD and run benchmarks/peers/run.py.
set -euo pipefail
D=.vllm PROBE=0 ROOT=${UNPACK_ROOT:-/tmp}  # UNPACK_ROOT: elsewhere than /tmp (a trial unpack here)
PROBE_ARGS=()
for a in "$@"; do
  if [ "$PROBE" = 1 ]; then PROBE_ARGS+=("$a"); elif [ "$a" = --probe ]; then PROBE=1; else D=$a; fi
done
# every part listed must be there and whole; the zstandard wheel only if it was carried
(cd "$D" && grep 'tar\.zst\.' SHA256SUMS | sha256sum -c --quiet && sha256sum -c --quiet --ignore-missing SHA256SUMS) \
  || { echo "unpack_vllm: parts missing or damaged in $D" >&2; exit 1; }
unzstd() {  # the zstd tool where there is one, else the zstandard wheel carried with the first part
  if command -v zstd > /dev/null; then zstd -dc; else python3 "$(dirname "$0")/unzstd.py" "$D"/zstandard-*.whl; fi
}
rm -rf "$ROOT/vllm-site" "$ROOT/site"
cat "$D"/vllm-0.26.0-site.tar.zst.[0-9][0-9] | unzstd | tar -x -C "$ROOT"
if ls "$D"/fallback/_C_stable_libtorch.abi3.so.zst.[0-9][0-9] > /dev/null 2>&1; then
  (cd "$D/fallback" && sha256sum -c --quiet SHA256SUMS) || { echo "unpack_vllm: fallback parts damaged" >&2; exit 1; }
  cat "$D"/fallback/_C_stable_libtorch.abi3.so.zst.[0-9][0-9] | unzstd > "$ROOT/vllm-site/vllm/_C_stable_libtorch.abi3.so"
  echo "unpack_vllm: the unstripped _C_stable_libtorch.abi3.so from $D/fallback"
fi
echo "unpacked: $(du -sh "$ROOT/vllm-site" | cut -f1) $ROOT/vllm-site, $(du -sh "$ROOT/site" 2>/dev/null | cut -f1) $ROOT/site"
PYTHONPATH=$ROOT/vllm-site python3 -c "import vllm; print('vllm', vllm.__version__)"
if [ "$PROBE" = 1 ]; then
  PYTHONPATH=$ROOT/vllm-site python3 "$(dirname "$0")/../vllm_probe.py" "${PROBE_ARGS[@]}"
fi
