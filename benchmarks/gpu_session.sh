#!/usr/bin/env bash
# One device call: GPU tests, then the engine benchmarks.
#   bash benchmarks/gpu_session.sh [tests|throughput|prefix|load|frontend|profile|scaleout|determinism|spec|eagle3|
#                                   tp2|tp2ar|armicro|tp2tests|tp2quant|tp2spec|tp4|fp8kv|fp8kv-engine|fp8kv-tests|quant|quanttests|
#                                   prefill-chunks|decode-variants|decode-latency|spec-policies|spec-fp8draft|profile-step|profile-draft|profile-spec|tp2profile|kerneltests|fp8gputests|quant-ab|pdltests|profile-fp8|act-quant|gemv16]...
# Run from the repo root on the GPU machine with .whl carried: the server's dependencies that the
# machine's image (python 3.12, torch, triton, transformers) lacks, and the router the scale-out step
# runs (with its own: setproctitle, aiohttp, orjson), fetched here once:
#   ../shared/device/fetch-wheels.sh msgspec httptools uvloop prometheus_client fastokens \
#     compressed-tensors loguru "vllm-router==0.1.17"
# plus xgrammar and apache-tvm-ffi (xgrammar's compiled core: without it every grammar GPU test
# fails) without their dependencies (torch, transformers and triton are on the machine):
#   pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl xgrammar apache-tvm-ffi
# Every benchmark runs as a module from the repo root: python -m benchmarks.<package>.<name>.
# One-GPU steps side by side on a host of two (device time counts per host: both GPUs busy halves it):
#   bash benchmarks/gpu_session.sh none    # installs once
#   ( export CUDA_VISIBLE_DEVICES=0 OUT=$OUT/g0; bash benchmarks/gpu_session.sh STEP... > $OUT/g0.log 2>&1 ) &
#   ( export CUDA_VISIBLE_DEVICES=1 OUT=$OUT/g1; bash benchmarks/gpu_session.sh STEP... > $OUT/g1.log 2>&1 ) &
#   wait
# (the host's CPU is shared: host-bound figures, batch-1 TPOT most, may move; say which ran beside which)
set -uo pipefail
# (installed once a machine: sessions run side by side on a host's GPUs, CUDA_VISIBLE_DEVICES and OUT
# apart, after a first one has installed, share it)
{ [ -e /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  .whl/*.whl && touch /tmp/site/.installed; }; } && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
# What the server imports at start (and what moves HTTP figures when missing: uvloop, httptools,
# fastokens) stops the session here, by name, not in the middle of a step; what only some steps
# import is a warning naming the wheel and what fails without it.
python3 - <<'PY' || exit 1
import importlib, sys

def missing(need):
    out = []
    for module, wheel in need.items():
        try:
            importlib.import_module(module)
        except ImportError as e:
            out.append(f"{wheel} ({e})")
    return out

for need, what in (({"xgrammar": "xgrammar", "tvm_ffi": "apache-tvm-ffi"},
                    "structured outputs and tool calls (and their GPU tests) will fail"),
                   ({"compressed_tensors": "compressed-tensors", "loguru": "loguru"},
                    "quantized checkpoints (tests/gpu/test_gpu_quant.py, bench_quant) will fail")):
    if missing(need):
        print(f"gpu_session: {what}, missing wheels: {', '.join(missing(need))}", file=sys.stderr)
server = missing({"msgspec": "msgspec", "prometheus_client": "prometheus_client", "uvloop": "uvloop",
                  "httptools": "httptools", "fastokens": "fastokens"})
sys.exit(f"gpu_session: missing wheels: {', '.join(server)}" if server else 0)
PY
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
status=0
# The fp8 GPU tests (fp8kv, fp8kv-tests): the engine's alone first, so that a limit cannot cut their
# report (on 2026-11-27 a cold machine's compiles ran one list past 330 s with a failure in it), then
# the kernels' selected by -k $2 within $1 s
commas() { echo "${1//,/ }"; }  # a lane's list variable (one word in its steps: 2,4) as separate words
fp8_tests() {
  # (FP8_GPU_K: a -k selection; --tb=short -x: a failure's report before a limit can cut it. The
  # four graphs-against-eager cases alone took 198 s on an H200: 220 s cut the summary)
  timeout "${FP8_GPU_S:-420}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_fp8.py ${FP8_GPU_K:+-x --tb=short -k "$FP8_GPU_K"} \
    2>&1 | tee "$OUT/fp8_gpu_tests.log" \
    | tail -30 || status=1
  [ "$1" = 0 ] && return
  timeout "$1" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8.py tests/kernels/test_kv_write.py \
    tests/kernels/test_rope.py tests/kernels/test_paged_decode.py tests/kernels/test_flash_prefill.py \
    tests/kernels/test_invariant_attention.py -k "$2" 2>&1 | tee "$OUT/fp8_tests.log" | tail -8 || status=1
}
for step in "${@:-tests throughput prefix}"; do
  for s in $step; do
    echo "=== $s"
    case $s in
      tests) python3 -m pytest -q tests/gpu tests/kernels -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1 ;;
      # the kernels' tests alone on the GPU (the defaults' bits after a kernel change), within KERNEL_TESTS_S
      # (-v: a test cut by the limit still leaves the names of those that failed before it); KERNEL_TESTS_FILES:
      # some of them (the whole folder takes more than one lane's call: 539 tests in 380 s on an H200 reached
      # test_paged_decode.py; a glob, one word in a lane's steps: KERNEL_TESTS_FILES=tests/kernels/test_[p-z]*.py)
      # shellcheck disable=SC2086
      kerneltests) timeout "${KERNEL_TESTS_S:-500}" python3 -m pytest -v -p no:cacheprovider ${KERNEL_TESTS_FILES:-tests/kernels} 2>&1 \
          | tee "$OUT/kernel_tests.log" | grep -E -e 'FAILED|ERROR' -e ' in [0-9.]+s' | tail -25 || status=1 ;;
      # the engine's fp8 GPU tests alone (fp8kv's first half)
      fp8gputests) fp8_tests 0 "fp8" ;;
      throughput) python3 -m benchmarks.engine.bench_throughput --out-dir "$OUT" 2>&1 | tee "$OUT/throughput.log" || status=1 ;;
      prefix) python3 -m benchmarks.engine.bench_prefix --out-dir "$OUT" 2>&1 | tee "$OUT/prefix.log" || status=1 ;;
      load) python3 -m benchmarks.serving.compare --out-dir "$OUT" "${LOAD_ARGS[@]:-}" 2>&1 | tee "$OUT/load.log" || status=1 ;;
      # Issue 20: the offline figure, the triton levels up to 1024 clients (merged into the committed
      # file's peers) and the API-process sweep, in one call; then py-spy on every server process.
      frontend)
        # offline, the load test's request shape (prompts 512 +- 128, outputs 256 +- 64)
        python3 -m benchmarks.engine.bench_throughput --skip flashpage_eager hf_eager hf_sdpa steps --input-len 384 640 \
          --output-len 192 320 --num-requests 1024 --out-dir "$OUT/offline" > "$OUT/offline.log" 2>&1 || status=1
        cp benchmarks/results/load_*.json "$OUT/" 2>/dev/null
        LOAD=(--duration 10 --grace 3 --requests-factor 8 --out-dir "$OUT" --no-progress)
        python3 -m benchmarks.serving.compare --impls triton --merge "${LOAD[@]}" > "$OUT/load.log" 2>&1 || status=1
        python3 -m benchmarks.serving.compare --api-server-counts 1 2 4 --concurrency 1 256 "${LOAD[@]}" \
          --offline-json "$(ls "$OUT"/offline/throughput_*.json)" > "$OUT/sweep.log" 2>&1 || status=1
        tail -4 "$OUT/offline.log"; tail -12 "$OUT/load.log"; tail -12 "$OUT/sweep.log" ;;
      # Issue 21: one replica per GPU of this host behind vllm-router (needs the vllm-router wheel carried).
      scaleout)
        python3 -m benchmarks.scaleout.bench_scaleout --replicas "$(nvidia-smi -L | wc -l)" --device cuda --out-dir "$OUT" \
          > "$OUT/scaleout.log" 2>&1 || status=1
        tail -14 "$OUT/scaleout.log" ;;
      # Issue 22: both modes of GPT-2 small and of the Llama-3.2-1B shape; on a host of two GPUs the
      # two shapes run at once, one per GPU, each pinned to its own half of the cores (unpinned, the
      # two servers and their load clients share every core, which moves the batch-1 TPOT; each
      # shape's two modes still share one GPU, in turn).
      determinism)
        DET=(--min-requests 1024 --out-dir "$OUT")
        if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
          half=$(( $(nproc) / 2 ))
          CUDA_VISIBLE_DEVICES=0 taskset -c 0-$((half - 1)) python3 -m benchmarks.engine.bench_determinism "${DET[@]}" \
            > "$OUT/det_gpt2.log" 2>&1 &
          CUDA_VISIBLE_DEVICES=1 taskset -c $half-$((2 * half - 1)) python3 -m benchmarks.engine.bench_determinism \
            --model-shape llama-3.2-1b "${DET[@]}" > "$OUT/det_llama.log" 2>&1 || status=1
          wait $! || status=1
        else
          for shape in gpt2 llama-3.2-1b; do
            python3 -m benchmarks.engine.bench_determinism --model-shape $shape "${DET[@]}" > "$OUT/det_$shape.log" 2>&1 || status=1
          done
        fi
        tail -n 12 "$OUT"/det_*.log ;;
      # Issue 48: speculative decoding's GPU tests, then speed against acceptance on the Llama-3.1-8B shape
      spec)
        timeout 200 python3 -m pytest -q tests/gpu/test_gpu_spec.py -k "not eagle3" \
          "tests/server/engine/test_deterministic.py::test_probe_is_bitwise_the_same[speculative]" \
          -p no:cacheprovider 2>&1 | tee "$OUT/spec_tests.log" | tail -5 || status=1
        timeout 380 python3 -m benchmarks.engine.bench_spec --deadline 300 --out-dir "$OUT" > "$OUT/spec.log" 2>&1 || status=1
        grep -v '^{' "$OUT/spec.log" | tail -35 ;;
      # Issue 48, EAGLE-3: its GPU test (graphs against eager, greedy tokens), then speed against acceptance
      # with a random head of the published layout for the Llama-3.1-8B shape (spec_eagle3_<gpu>.json)
      eagle3)
        timeout 150 python3 -m pytest -q tests/gpu/test_gpu_spec.py -k eagle3 -p no:cacheprovider 2>&1 | tee "$OUT/eagle3_tests.log" \
          | tail -5 || status=1
        timeout 400 python3 -m benchmarks.engine.bench_spec --methods eagle3 --deadline 300 --out-dir "$OUT" \
          > "$OUT/eagle3.log" 2>&1 || status=1
        grep -v '^{' "$OUT/eagle3.log" | tail -30 ;;
      # Issue 47: quantized weights, one device call each. quant: bench_quant on the Llama-3.1-8B shape
      # (the GEMMs at 1/16/256/2048 rows as CUDA graphs, the GEMV tile sweep, then bf16, FP8_DYNAMIC,
      # AWQ and 128x128-block engines side by side: batch-1 TPOT and offline throughput; engines past
      # its time budget are skipped, each in a child process); quanttests: the quantization GPU tests
      # (every path at 1/13/200 tokens, graph replay against eager bit for bit, the engine's graphs,
      # speculation on a quantized target, the staging race) and the quantized kernels' tests on the GPU.
      # QUANT_ARGS adds bench_quant flags (a second call: QUANT_ARGS="--steps engine --formats fp8-block").
      quant)
        # shellcheck disable=SC2086
        timeout 565 python3 -m benchmarks.quant.bench_quant --time-budget 490 --out-dir "$OUT" ${QUANT_ARGS:-} > "$OUT/quant.log" 2>&1 \
          || status=1
        grep -v '^{' "$OUT/quant.log" | tail -40 ;;
      # quant-ab: the engines only (bench_quant's engine step), each format with and without its options
      # (+pdl: --enable-pdl; +no-prescale: o_proj's and down_proj's int4 GEMVs in the fp32 loop;
      # +no-quantfirst: o_proj's FP8 row quantized in the GEMV; +no-w8a16: FP8 linears read one row
      # in FP8, quantized by the norms, silu_mul or a launch of their own; its quant_<gpu>.json holds these
      # engines only: keep it as experiments/quant_ab_<gpu>.json, apart from the full run's), for
      # the next defaults; pdltests: --enable-pdl's GPU tests (the same bits with and without it)
      quant-ab)
        timeout 565 python3 -m benchmarks.quant.bench_quant --steps engine --time-budget 520 --out-dir "$OUT" \
          --formats bf16 fp8-dynamic fp8-dynamic+no-w8a16 fp8-block fp8-block+no-w8a16 awq \
          > "$OUT/quant_ab.log" 2>&1 \
          || status=1
        grep -v '^{' "$OUT/quant_ab.log" | tail -20 ;;
      # gemv16: a 16-bit linear's one row through our GEMV (models/linear.py, on by default since
      # 2026-11-28) against cuBLAS (FLASHPAGE_GEMV16=0): its GPU test, its tile sweep at the 8B and 1B
      # shapes (bench_quant's bf16 kind; config16's picks came from an H200's), the 8B engine both ways
      gemv16)
        timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_gemv16.py 2>&1 | tee "$OUT/gemv16_tests.log" \
          | tail -3 || status=1
        for shape in llama-3.1-8b llama-3.2-1b; do
          mkdir -p "$OUT/gemv16_$shape"
          timeout 150 python3 -m benchmarks.quant.bench_quant --shape $shape --steps gemm sweep --gemm-m 1 --sweep-kinds bf16 \
            --out-dir "$OUT/gemv16_$shape" > "$OUT/gemv16_$shape.log" 2>&1 || status=1
          grep -E '^sweep|^tuned' "$OUT/gemv16_$shape.log"
        done
        timeout 200 python3 -m benchmarks.quant.bench_quant --steps engine --formats bf16 bf16+no-gemv16 --time-budget 190 \
          --out-dir "$OUT" > "$OUT/gemv16_engine.log" 2>&1 || status=1
        grep -E '^tpot|^throughput' "$OUT/gemv16_engine.log" ;;
      pdltests)
        timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_pdl.py 2>&1 | tee "$OUT/pdl_tests.log" \
          | tail -8 || status=1 ;;
      quanttests)
        timeout 560 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_quant.py tests/gpu/test_gpu_staging.py \
          tests/kernels/test_gemv.py tests/kernels/test_dequant.py tests/kernels/test_fp8_quant.py \
          tests/kernels/test_fp8_matmul.py tests/kernels/test_wo_matmul.py tests/models/test_quant_gemms.py 2>&1 \
          | tee "$OUT/quant_tests.log" | tail -25 || status=1 ;;
      # Issue 50: tensor parallelism. tp2 (two GPUs): the all-reduce alone (NCCL's and the one-shot
      # over symmetric memory, 8 KB to 4 MB), the Llama-3.1-8B shape's batch-1 TPOT at TP=1 and at
      # TP=2 both ways (--disable-custom-all-reduce and the default custom all-reduce), then the
      # custom all-reduce's GPU tests; tp2tests (two GPUs; its own call: tp2 fills one): the other TP
      # GPU tests; tp2quant (two GPUs, likewise): quantized checkpoints at two GPUs against one (issues
      # 47 + 50); tp2spec (two GPUs, its own call): speculation at two GPUs, its GPU tests (each method
      # against two GPUs without it), then n-gram's batch-1 and 8-client TPOT with and without it on
      # the Llama-3.1-8B shape at an oracle's acceptance (issues 48 + 50); tp4 (four GPUs): the
      # Llama-3.1-70B shape at TP=4 (dummy weights): batch-1 TPOT against its floor, the load test's
      # levels, offline throughput.
      # tp2: the micro-benchmark and three servers (each start took 44-67 s) fill a call alone; the
      # custom all-reduce's GPU tests are tp2ar, a call of their own on the same warm machine. It takes
      # TP2_SIZES (default 1,2) and TP2_AR (--custom-all-reduce, default off,on)
      tp2)
        # shellcheck disable=SC2086
        timeout 560 python3 -m benchmarks.scaleout.bench_tp --shape llama-3.1-8b --tp-sizes $(commas "${TP2_SIZES:-1,2}") \
          --custom-all-reduce $(commas "${TP2_AR:-off,on}") \
          --out-dir "$OUT" 2>&1 | tee "$OUT/tp2.log" || status=1 ;;
      # armicro: the all-reduce alone, NCCL's against the custom one, at AR_TP ranks (default 2; AR_TP=2,4).
      # tp4 takes TP4_AR=on|off|off,on (--custom-all-reduce; on, the server's default) and TP4_LEVELS=1,16 (empty: none)
      armicro)
        # shellcheck disable=SC2086
        timeout 240 python3 -m benchmarks.scaleout.all_reduce_micro --tp $(commas "${AR_TP:-2}") --out-dir "$OUT" 2>&1 \
          | tee "$OUT/armicro.log" | grep -v Warning | tail -14 || status=1 ;;
      tp2ar)
        timeout 120 python3 -m pytest -q tests/kernels/test_one_shot_all_reduce.py -p no:cacheprovider 2>&1 \
          | tee "$OUT/one_shot_kernel_tests.log" | tail -4 || status=1
        timeout 400 python3 -m pytest -q tests/gpu/test_gpu_tp.py -k all_reduce -p no:cacheprovider 2>&1 \
          | tee "$OUT/tp_custom_all_reduce_tests.log" | tail -8 || status=1 ;;
      tp2tests)
        timeout 540 python3 -m pytest -q tests/gpu/test_gpu_tp.py -k "not quantized and not all_reduce and not speculation" \
          -p no:cacheprovider \
          2>&1 | tee "$OUT/tp_tests.log" | tail -8 || status=1 ;;
      tp2quant)
        timeout 540 python3 -m pytest -q tests/gpu/test_gpu_tp.py -k quantized -p no:cacheprovider 2>&1 \
          | tee "$OUT/tp_quant_tests.log" | tail -12 || status=1 ;;
      tp2spec)
        timeout 300 python3 -m pytest -q tests/gpu/test_gpu_tp.py -k speculation -p no:cacheprovider 2>&1 \
          | tee "$OUT/tp_spec_tests.log" | tail -8 || status=1
        timeout 270 python3 -m benchmarks.engine.bench_spec --tensor-parallel-size 2 --methods ngram --clients 1 8 \
          --probabilities 0.8 --sweep-clients --forced-clients --repeats 2 --out-dir "$OUT" 2>&1 \
          | tee "$OUT/tp_spec.log" | tail -12 || status=1 ;;
      tp4)
        # shellcheck disable=SC2086
        timeout 540 python3 -m benchmarks.scaleout.bench_tp --shape llama-3.1-70b --tp-sizes 4 --custom-all-reduce $(commas "${TP4_AR:-on}") \
          --load-levels $(commas "${TP4_LEVELS-1,16,64,256}") \
          --level-duration 25 --offline-requests 512 --out-dir "$OUT" 2>&1 | tee "$OUT/tp4.log" || status=1 ;;
      # Issue 46: the FP8 KV cache. fp8kv: its GPU tests and the kernels' fp8 tests (Triton's casts on
      # the hardware), then the decode kernel against the 16-bit one on the same shapes and a tile
      # sweep; fp8kv-engine: the Llama-3.1-8B shape (dummy weights), 8k-token prompts, as many at once
      # as each cache holds, and batch-1 TPOT at 32k, per cache dtype (each step fits one call).
      fp8kv)
        # (a cold machine compiles every kernel variant first: 300 s ran out there, 61 s warm)
        fp8_tests 130 "fp8 or float8"
        timeout 240 python3 -m benchmarks.kernels.bench_fp8_kv --sections decode --sweep --sweep-budget 45 --tag decode \
          --out-dir "$OUT" 2>&1 | tee "$OUT/fp8_decode.log" | tail -28 || status=1 ;;
      fp8kv-engine)
        timeout 570 python3 -m benchmarks.kernels.bench_fp8_kv --sections engine --tag engine --out-dir "$OUT" 2>&1 \
          | tee "$OUT/fp8_engine.log" | tail -10 || status=1 ;;
      # fp8kv-tests: the fp8 GPU tests (fp8kv's first half) and the fused write's new-token options on
      # the GPU, then this triton's IR of both launches (the benchmark's, the engine's fused write) with
      # and without NEW_KV_TAIL.
      fp8kv-tests)
        fp8_tests 150 "fp8 or float8 or fused or new_kv"
        { timeout 60 python3 -m benchmarks.kernels.decode_ir --head-dims 128 --no-sweep
          timeout 90 python3 -m benchmarks.kernels.decode_ir --head-dims 128 64 --no-sweep --new-kv --tail; } \
          2>&1 | grep -v -i warn | tee "$OUT/decode_ir.log" | tail -16 || status=1 ;;
      # decode-variants: every decode shape, 16-bit and fp8, as the engine launches them (fused write),
      # and with NEW_KV_TAIL (issues 45/46: batch-1 TPOT at 32k runs the fused launch);
      # the file (fp8_kv_variants_<gpu>.json) is rewritten after each shape
      # decode-latency: the decode launch at batch 1 and 4 as the engine runs it (32 layers in a graph),
      # the default config against every split count and tile, and 32 splits with the launch option
      # HALF_MERGE (benchmarks/kernels/bench_decode_latency.py; whether the tables should pick it)
      decode-latency)
        timeout 540 python3 -m benchmarks.kernels.bench_decode_latency --budget "${LATENCY_S:-380}" --out-dir "$OUT" 2>&1 \
          | tee "$OUT/decode_latency.log" | grep -v Warning | tail -40 || status=1 ;;
      decode-variants)
        timeout "${VARIANTS_S:-560}" python3 -m benchmarks.kernels.bench_fp8_kv --sections decode \
          --fused-write --new-kv-tail --tag variants --out-dir "$OUT" 2>&1 | tee "$OUT/fp8_variants.log" | tail -26 || status=1 ;;
      # spec-policies: issue 48's back-off rules side by side (per_sequence, batch), the draft model and
      # EAGLE-3 at 1 / 8 / 256 clients (8 and 256 at two acceptances, 256 also forced on); the file
      # (spec_draft_model_eagle3_policies_<gpu>.json) is rewritten after each client count
      # spec-fp8draft: issue 48: the Llama-3.2-1B-shaped draft quantized to FP8 at load (the speculative
      # config's `quantization`: half its bytes a proposal step) after the 16-bit draft, in one call,
      # batch 1 and 8 clients at the oracle's 0.8
      spec-fp8draft)
        for q in "" fp8; do
          # shellcheck disable=SC2086
          timeout 265 python3 -m benchmarks.engine.bench_spec --methods draft_model ${q:+--draft-quantization $q} \
            --clients 1 8 --probabilities 0.8 --sweep-clients --forced-clients --repeats 2 --deadline 200 \
            --out-dir "$OUT" 2>&1 | tee -a "$OUT/spec_fp8draft.log" | grep -v '^{' | tail -10 || status=1
        done ;;
      spec-policies)
        timeout "${SPEC_S:-560}" python3 -m benchmarks.engine.bench_spec --methods draft_model eagle3 \
          --policies per_sequence batch --clients 1 8 256 --probabilities 0.5 0.8 --sweep-clients 8 256 \
          --forced-clients 256 --deadline "$(( ${SPEC_S:-560} * 3 / 4 ))" --out-dir "$OUT" 2>&1 | tee "$OUT/spec_policies.log" \
          | grep -v '^{' | tail -30 || status=1 ;;
      # Issue 45: where the 32k-token prompt's TTFT goes (chunks over the paged prefix; vLLM's FA3 beside
      # ours when VLLM_SITE names an unpacked vLLM site, benchmarks/peers/fetch/unpack_vllm.sh). First the
      # prefix loop's pipelining depth in this triton's IR, the program orders and prefix-loop options
      # compiled for real (the default's bits in each), then the benchmark times them all (a dozen
      # variants to compile, hence its longer limit)
      prefill-chunks)
        timeout 30 python3 -m benchmarks.kernels.prefill_ir 2>&1 | tee "$OUT/prefill_ir.log" | tail -3 || status=1
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_flash_prefill_order.py 2>&1 \
          | tee "$OUT/prefill_order_tests.log" | tail -5 || status=1
        timeout 410 python3 -m benchmarks.kernels.bench_prefill_chunks --out-dir "$OUT" 2>&1 | tee "$OUT/prefill_chunks.log" \
          | tail -60 || status=1 ;;
      # Issues 45 + 50: where a decode step's time goes on the Llama-3.1-8B shape (dummy weights), rank 0's
      # profile (benchmarks/profiling/profile_step.py): the served step, the step's device time through
      # its graph and eagerly, the kernels by category and by name. profile-step (one GPU): TP=1 at batch
      # 1 and 256; tp2profile (two GPUs): TP=2 at batch 1, the custom all-reduce (PROFILE_ARGS adds flags:
      # PROFILE_ARGS=--disable-custom-all-reduce for NCCL's). Each writes
      # profile_step_llama-3.1-8b_tp<N>_<gpu>.json into $OUT (benchmarks/results/experiments/ when kept).
      profile-step)
        # shellcheck disable=SC2086
        timeout 300 python3 -m benchmarks.profiling.profile_step --shape llama-3.1-8b --batch 1 256 --out-dir "$OUT" \
          ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile_step.log" | grep -v -e '^USDT' -e 'Warning' | tail -90 || status=1 ;;
      # profile-fp8: the FP8 step (weights quantized at load, FP8_DYNAMIC's kernels) at batch 1, without and
      # with --enable-pdl where PROFILE_FP8_PDL is set (issue 47: where its 4.38 ms against 0.6x's 3.78 go)
      profile-fp8)
        for extra in "" ${PROFILE_FP8_PDL:+--enable-pdl}; do
          # shellcheck disable=SC2086
          timeout 200 python3 -m benchmarks.profiling.profile_step --shape llama-3.1-8b --batch 1 --quantization fp8 \
            $extra --out-dir "$OUT" 2>&1 | tee -a "$OUT/profile_fp8.log" | grep -v -e '^USDT' -e 'Warning' | tail -40 \
            || status=1
        done ;;
      # profile-draft: issue 48: the Llama-3.2-1B-shaped draft's decode step at batch 1, 16-bit and FP8
      # weights (what each of a draft round's forwards costs, and where)
      profile-draft)
        for q in "" fp8; do
          # shellcheck disable=SC2086
          timeout 150 python3 -m benchmarks.profiling.profile_step --shape llama-3.2-1b --batch 1 ${q:+--quantization $q} \
            --out-dir "$OUT" 2>&1 | tee -a "$OUT/profile_draft.log" | grep -v -e '^USDT' -e 'Warning' | tail -30 \
            || status=1
        done ;;
      # profile-spec: issue 48: where a batch-1 speculative cycle's time goes (benchmarks/profiling/
      # profile_spec.py): the 1B-shaped draft, 16-bit and FP8, and n-gram, at the oracle's 0.8
      profile-spec)
        for variant in "--method draft_model" "--method draft_model --draft-quantization fp8" "--method ngram"; do
          # shellcheck disable=SC2086
          timeout 200 python3 -m benchmarks.profiling.profile_spec $variant --out-dir "$OUT" 2>&1 \
            | tee -a "$OUT/profile_spec.log" | grep -v -e '^USDT' -e 'Warning' -e 'Writing' | tail -2 || status=1
        done ;;
      # act-quant: the FP8 model's activation kernels against the torch chain vLLM compiles
      # (benchmarks/quant/bench_act_quant.py), then with bf16 rounded on the bits (the A/B of kernels/rounding.py)
      act-quant)
        timeout 200 python3 -m benchmarks.quant.bench_act_quant --out-dir "$OUT" > "$OUT/act_quant.log" 2>&1 || status=1
        FLASHPAGE_BF16_ROUND_BITS=1 TRITON_CACHE_DIR=/tmp/triton-round-bits timeout 150 python3 -m \
          benchmarks.quant.bench_act_quant --no-compiled --out-dir "$OUT" >> "$OUT/act_quant.log" 2>&1 || status=1
        grep '^M=' "$OUT/act_quant.log" | tail -40 ;;
      tp2profile)
        # shellcheck disable=SC2086
        timeout 300 python3 -m benchmarks.profiling.profile_step --shape llama-3.1-8b --tensor-parallel-size 2 --batch 1 \
          --out-dir "$OUT" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/tp2profile.log" | grep -v -e '^USDT' -e 'Warning' | tail -50 \
          || status=1 ;;
      profile)
        for n in 1 4; do
          python3 -m benchmarks.profiling.profile_server --server-args "--api-server-count $n" --label "api$n" \
            --out-dir "$OUT/profile" 2>&1 | tail -40 || status=1
        done ;;
    esac
  done
done
exit $status
