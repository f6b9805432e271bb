#!/usr/bin/env bash
# vLLM 0.26.0 for the GPU machine (Python 3.12, torch 2.11.0+cu130, triton 3.6.0, no network), as
# parts small enough to carry, one a device call. Run here, from the repo root:
#
#   bash benchmarks/peers/fetch/fetch_vllm.sh [OUT_DIR]      # default ./.vllm (from the repo root)
#
# Writes OUT_DIR/vllm-0.26.0-site.tar.zst.NN (zstd -19, split into equal parts of at most 38 MB),
# OUT_DIR/SHA256SUMS (the parts), OUT_DIR/MANIFEST.tsv (every file: path, bytes, sha256), the
# zstandard wheel (5.5 MB: the decompressor where the machine has no zstd tool; carry it with part 00)
# and OUT_DIR/fallback/: the unstripped _C library, in parts, to carry only if the stripped one fails.
# benchmarks/peers/fetch/unpack_vllm.sh unpacks them there into /tmp/vllm-site (vLLM and what it needs)
# and /tmp/site (the flashpage server's wheels, $FLASHPAGE_WHEELS, so that no .whl need travel too;
# files both sites hold alike are stored once, as hard links).
#
# Why vLLM 0.26.0: the last release pinned to torch==2.11.0; its extensions link CUDA 13's runtime,
# the machine's stack. Why it is slimmed (each checked in vLLM's code, the wheel's own):
#   vllm_flash_attn/_vllm_fa2_C.abi3.so (305 MB)  FlashAttention 2: fa_utils.get_flash_attn_version
#       picks FA3 on compute capability 9 (Hopper) when it loads; FA2 is its fallback elsewhere.
#   _moe_C_stable_libtorch.abi3.so (48 MB)       MoE ops only (topk_softmax, moe_align_block_size, ...):
#       platforms/cuda.py imports it under contextlib.suppress(ImportError); no dense model calls it.
#   _qutlass_C.abi3.so                           FP4 (MXFP4/NVFP4) quantization for Blackwell; import suppressed.
#   third_party/fmha_sm100, third_party/tml_fa4  Blackwell attention (MiniMax-M3, Inkling models only).
#   third_party/deep_gemm (35 MB, headers JIT-compiled with nvcc)  used only for 128x128 block-scaled
#       FP8 linears (DeepSeek/Qwen3-FP8 layout); without it has_deep_gemm() is False and vLLM takes the
#       next kernel of its own list, CUTLASS's block-scaled GEMM in _C (VLLM_USE_DEEP_GEMM=0 says so).
#       WITH_DEEP_GEMM=1 keeps it (then the first block-FP8 start JIT-compiles for a minute or more).
#   vllm-rs (43 MB)                              the Rust front end, run only with VLLM_USE_RUST_FRONTEND=1.
#   _C_stable_libtorch.abi3.so                   kept, but its fat binaries keep only what sm_90 loads
#       (benchmarks/peers/fetch/fatbin.py: sm_90 SASS, or the PTX where a kernel has none): 56 -> 15 MB packed.
#   kept: _C (all dense, quantized and cache ops), vllm_flash_attn/_vllm_fa3_C (FA3, bf16 and fp8 KV),
#       vllm_flash_attn/cute (FA4 Python, loaded lazily), _flashmla_C, the Python tree.
#
# What must travel besides vLLM: the dependencies the GPU image lacks that vLLM imports on our paths
# (`vllm serve` for Llama/Qwen2/Qwen3 in bf16 or with --kv-cache-dtype fp8 and FP8/AWQ/GPTQ/
# compressed-tensors checkpoints, `vllm bench serve` on the random and prefix_repetition datasets,
# vllm.LLM.generate, XGrammar structured outputs, prefix caching, ngram speculation). Found by
# benchmarks/peers/vllm_probe.py --cpu-stub (those modules, the app vLLM's server builds with all its
# routers, both CLIs) in a Python 3.12 venv holding the image's own versions of what it has
# (the GPU image's `pip list`), adding what each round found missing until nothing was, then reading
# vLLM for imports made only at run time on these paths:
#   pydantic, pydantic_core, annotated_types, typing_inspection   every config and protocol model
#   fastapi, starlette, uvicorn, watchfiles    the OpenAI server (uvicorn imports watchfiles)
#   prometheus_fastapi_instrumentator          /metrics, attached when the server builds its app
#   msgspec, pyzmq, cbor2, cachetools          the engine core's messages and sockets; block hashing
#   pybase64                                   the bench client's datasets and the server's media utils
#   partial_json_parser                        the tool parsers the serving layer imports
#   openai, httpx2, sniffio, openai_harmony    the OpenAI protocol types and GPT-OSS's harmony format,
#                                              imported by the serving modules at start-up
#   model_hosting_container_standards, jmespath  SageMaker's routes, attached to every server
#   xgrammar, apache-tvm-ffi                   structured outputs (the default backend, forced here)
#   llguidance                                 imported with the engine (vllm.v1.structured_output's
#                                              class annotations load it), though never used here
#   lm-format-enforcer, interegular            SamplingParams validates any structured request by importing
#                                              every backend's module; lm-format-enforcer's evaluates a
#                                              class annotation that loads the package (the first H100
#                                              run's structured workload failed on its absence)
#   compressed_tensors, loguru                 compressed-tensors checkpoints; vLLM's quantization registry
# The image already has torch, triton, transformers, tokenizers, numpy, numba, aiohttp, requests,
# psutil, sentencepiece, tiktoken, pillow, opencv, einops, cloudpickle, ninja, protobuf, pyyaml,
# prometheus_client, uvloop, h11, anyio, httpx, xxhash (piplist.txt); vLLM's pins of numba (0.65)
# and setuptools (<81) are not met there (0.68, 81) and need not be for these paths.
# Not carried, each imported only off these paths or optional where it is imported: setproctitle
# (process titles, try/except), depyf (a debug dump, or formatting an error), blake3 (the non-default
# prefix-cache hash), outlines_core, lark (the other structured-output backends: their modules import them lazily),
# anthropic, mcp (the Messages and Responses APIs, lazily), mistral_common, ijson (Mistral), flashinfer,
# tilelang, cutlass-dsl, quack, humming, tokenspeed_mla, triton_kernels (kernels vLLM picks only where
# importable, none its Hopper default for these models), torchcodec, PyNvVideoCodec (video),
# fastsafetensors, nvtx, opentelemetry (off unless asked for), datasets (the bench's HF datasets).
set -euo pipefail
OUT=${1:-$PWD/.vllm}  # run from the repo root: .vllm beside .whl (both git-ignored)
WORK=${WORK:-/tmp/peers-fetch}
PYTHON=${PYTHON:-python3}
VLLM_WHEEL=${VLLM_WHEEL:-}  # a downloaded vllm-0.26.0 wheel, else fetched
FLASHPAGE_WHEELS=${FLASHPAGE_WHEELS:-$PWD/.whl}  # empty: no flashpage site in the bundle
WITH_DEEP_GEMM=${WITH_DEEP_GEMM:-0}
PART_BYTES=38000000
HERE=$(cd "$(dirname "$0")" && pwd)

DEPS=(
  pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5
  fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0
  msgspec==0.22.0 pyzmq==27.3.0 cbor2==6.3.0 cachetools==8.0.2 pybase64==1.5.1 partial-json-parser==0.2.1.1.post7
  openai==3.57.0 httpx2==2.16.2 sniffio==1.3.1 openai-harmony==0.0.8
  model-hosting-container-standards==0.1.16 jmespath==1.1.0
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.6 lm-format-enforcer==0.11.3 interegular==0.3.3
  compressed-tensors==0.17.0 loguru==0.7.3
)
PLATFORMS=()
for n in 5 17 24 26 27 28 31; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
PIP_TARGET=(-m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12
            --implementation cp "${PLATFORMS[@]}" --upgrade --target)

split_parts() {  # FILE PREFIX: equal parts of at most PART_BYTES, PREFIX00, PREFIX01, ...
  local n=$(( ($(stat -c %s "$1") + PART_BYTES - 1) / PART_BYTES ))
  split -n "$n" -d -a 2 "$1" "$2"
}

rm -rf "$WORK/stage" "$WORK/deps" && mkdir -p "$WORK/wheels" "$WORK/deps" "$WORK/stage" "$OUT"
if [ -z "$VLLM_WHEEL" ]; then
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$WORK/wheels" vllm==0.26.0
  VLLM_WHEEL=$(ls "$WORK"/wheels/vllm-0.26.0-*.whl)
fi
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$WORK/deps" "${DEPS[@]}"

# vLLM and its dependencies: /tmp/vllm-site there
SITE="$WORK/stage/vllm-site"
"$PYTHON" "${PIP_TARGET[@]}" "$SITE" "$VLLM_WHEEL" "$WORK"/deps/*.whl
V="$SITE/vllm"
rm -f "$V/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$V/_moe_C_stable_libtorch.abi3.so" "$V/_qutlass_C.abi3.so" "$V/vllm-rs"
rm -rf "$V/third_party/fmha_sm100" "$V/third_party/tml_fa4" "$SITE/bin"
if [ "$WITH_DEEP_GEMM" = 1 ]; then
  find "$V/third_party/deep_gemm" -name '_C.cpython-3*' ! -name '_C.cpython-312-*' -delete
else
  rm -rf "$V/third_party/deep_gemm"
fi
# the unstripped library, packed apart: unpack_vllm.sh puts it back if .vllm/fallback is carried
rm -rf "$OUT/fallback" && mkdir -p "$OUT/fallback"
zstd -19 -T0 -q -f "$V/_C_stable_libtorch.abi3.so" -o "$WORK/_C_stable_libtorch.abi3.so.zst"
split_parts "$WORK/_C_stable_libtorch.abi3.so.zst" "$OUT/fallback/_C_stable_libtorch.abi3.so.zst."
(cd "$OUT/fallback" && sha256sum _C_stable_libtorch.abi3.so.zst.* > SHA256SUMS)
"$PYTHON" "$HERE/fatbin.py" --arch 90 "$V/_C_stable_libtorch.abi3.so"

# the flashpage server's wheels: /tmp/site there (what benchmarks/gpu_session.sh installs from .whl)
if [ -n "$FLASHPAGE_WHEELS" ]; then
  "$PYTHON" "${PIP_TARGET[@]}" "$WORK/stage/site" "$FLASHPAGE_WHEELS"/*.whl
  rm -rf "$WORK/stage/site/bin"
fi
# a file both sites hold byte for byte becomes one hard link (tar stores it once); then the manifest
"$PYTHON" "$HERE/fetch_manifest.py" "$WORK/stage" "$OUT/MANIFEST.tsv"

# pack: one zstd-19 stream, cut into equal parts of at most PART_BYTES
rm -f "$OUT"/vllm-0.26.0-site.tar.zst.* "$OUT/SHA256SUMS"
ARCHIVE="$WORK/vllm-0.26.0-site.tar.zst"
tar -C "$WORK/stage" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | zstd -19 -T0 -q -f -o "$ARCHIVE"
split_parts "$ARCHIVE" "$OUT/vllm-0.26.0-site.tar.zst."
# the decompressor for a machine without the zstd tool (benchmarks/peers/fetch/unzstd.py), carried with part 00
rm -f "$OUT"/zstandard-*.whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$OUT" zstandard==0.25.0
(cd "$OUT" && sha256sum vllm-0.26.0-site.tar.zst.* zstandard-*.whl > SHA256SUMS)
echo "vllm-site $(du -sh "$SITE" | cut -f1), site $(du -sh "$WORK/stage/site" 2>/dev/null | cut -f1); parts:"
ls -l "$OUT"/vllm-0.26.0-site.tar.zst.* "$OUT"/zstandard-*.whl "$OUT"/fallback/*.zst.* | awk '{print "  " $5, $9}'
