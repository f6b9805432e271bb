"""benchmarks/profiling/profile_step.py: its whole path on the CPU at two ranks (gloo), and the
categories and arithmetic it reports of a GPU's kernels (benchmarks/profiling/kernel_categories.py)."""

import json

import pytest

from benchmarks.profiling import profile_step
from benchmarks.profiling.kernel_categories import breakdown, category, label

# Names as an H100's profiler reports them (cuBLAS, NCCL, torch's one-shot all-reduce, the project's Triton kernels)
H100_NAMES = {
    "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "GEMM/GEMV",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>": "GEMM/GEMV",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel":
        "GEMM/GEMV",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false>": "GEMM/GEMV",
    "_fp8_gemv_kernel": "GEMM/GEMV",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all-reduce/all-gather",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all-reduce/all-gather",
    "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all-reduce/all-gather",
    "_one_shot_kernel": "all-reduce/all-gather",
    "_decode_kernel": "attention decode",
    "_flash_prefill_kernel": "attention prefill",
    "_rope_kv_write_kernel": "rotary/KV write",
    "_add_rmsnorm_kernel": "norms",
    "_norm_quant_kernel": "norms",
    "_chunk_kernel": "sampling/argmax",
    "_silu_mul_kernel": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>":
        "copies",
    "void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>": "copies",
    "Memcpy HtoD (Pinned -> Device)": "copies",
    "_range_probe_kernel": "other",
    # vLLM's (peers' profiles, benchmarks/peers/offline.py): FlashAttention-3 and torch.compile's kernels
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2>>>>":
        "attention (FlashAttention-3)",
    "void flash::prepare_varlen_num_blocks_kernel<1, true>(int, int, int, int const*, int const*)":
        "attention (FlashAttention-3)",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "compiled (inductor)",
    "triton_poi_fused_mul_silu_slice_1": "compiled (inductor)",
    "triton_tem_fused_mm_0": "GEMM/GEMV",  # inductor's GEMM template
    # torch's SDPA (our sdpa backend) and FlashAttention-2: prefill, not FlashAttention-3
    "void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<128, 128, 64, 4, false>, true>":
        "attention prefill",
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::half_t>>":
        "attention prefill",
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>":
        "rotary/KV write",
}


@pytest.mark.parametrize("name", sorted(H100_NAMES))
def test_a_gpu_kernel_falls_in_its_category(name):
    assert category(name) == H100_NAMES[name]


def test_a_merge_kernel_takes_the_category_and_row_of_the_kernel_before_it():
    names = ["_decode_kernel", "_merge_kernel", "nvjet_tst_a", "_chunk_kernel", "_merge_kernel"]
    assert label(names) == [("_decode_kernel", "attention decode"),
                            ("_merge_kernel after _decode_kernel", "attention decode"),
                            ("nvjet_tst_a", "GEMM/GEMV"), ("_chunk_kernel", "sampling/argmax"),
                            ("_merge_kernel after _chunk_kernel", "sampling/argmax")]


def test_breakdown_per_step_sums_overlap_and_shares():
    """Two steps; in each an all-reduce on its own stream overlaps the GEMM before it by 5 us: the
    kernels' sum counts it twice, the busy time once. Events come in any order."""
    step = [(0.0, "nvjet_tst_a", 10.0), (5.0, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 10.0),
            (20.0, "_decode_kernel", 4.0), (24.0, "_merge_kernel", 1.0), (30.0, "_chunk_kernel", 2.0),
            (32.0, "_merge_kernel", 1.0)]
    events = [(t + 100.0 * s, n, us) for s in range(2) for t, n, us in step][::-1]
    b = breakdown(events, steps=2)
    assert b["kernel_ms"] == pytest.approx(28e-3) and b["busy_ms"] == pytest.approx(23e-3)
    assert b["kernels_per_step"] == 6
    assert b["categories"]["attention decode"] == {"us": 5.0, "count": 2.0, "share": round(5 / 28, 4)}
    assert b["categories"]["sampling/argmax"]["us"] == 3.0 and b["categories"]["all-reduce/all-gather"]["us"] == 10.0
    assert [k["name"] for k in b["kernels"][:2]] == ["nvjet_tst_a", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"]
    assert {"name": "_merge_kernel after _chunk_kernel", "category": "sampling/argmax", "us": 1.0,
            "count": 1.0} in b["kernels"]
    assert sum(c["share"] for c in b["categories"].values()) == pytest.approx(1.0, abs=1e-3)


def _mode(device_ms, kernels):
    b = breakdown(kernels, steps=1)
    return {"device_ms": device_ms, "host_ms": 0.1, **b, "gap_ms": round(device_ms - b["busy_ms"], 4)}


def test_report_puts_the_modes_side_by_side_and_lists_the_graphs_kernels():
    gemv = [(0.0, "nvjet_tst_a", 3000.0), (3000.0, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 650.0)]
    result = {"shape": "llama-3.1-8b", "tensor_parallel_size": 2, "disable_custom_all_reduce": True, "context": 512,
              "dtype": "bfloat16", "device": "NVIDIA H100 80GB HBM3",
              "rows": [{"batch": 1, "step_ms": 4.32, "graph": _mode(4.1, gemv),
                        "eager": _mode(9.5, gemv + [(4000.0, "_decode_kernel", 100.0)])}]}
    text = profile_step.report(result)
    assert "llama-3.1-8b at TP=2, NCCL all-reduces" in text and "Batch 1: served step 4.320 ms" in text
    assert "| graph | 4.100 | 3.650 | 3.650 | 0.450 | 0.100 | 2 |" in text
    assert "| all-reduce/all-gather | 650.0 | 17.8% | 650.0 | 17.3% |" in text
    assert "| attention decode | - | - | 100.0 | 2.7% |" in text  # (not in the graph's profile)
    assert "Top kernels (graph):" in text and "| 3000.0 | 1 | GEMM/GEMV | `nvjet_tst_a` |" in text
    # a profiler that saw no kernels inside the replays: the eager step's are listed
    result["rows"][0]["graph"] = _mode(4.1, [])
    assert "Top kernels (eager):" in profile_step.report(result)


def test_the_whole_script_on_the_cpu_at_two_ranks(tmp_path):
    """Rank 0's profile of a tiny Llama split over two gloo ranks: each batch's served step, no
    graph mode on the CPU, and the eager step's operators, its collectives among them (the
    embedding's all-reduce and two a layer, the broadcast of the sampled ids, the LM head's gather:
    docs/architecture.md), written and reported."""
    result = profile_step.main(["--shape", "tiny-llama", "--device", "cpu", "--tensor-parallel-size", "2",
                                "--batch", "1", "2", "--context", "16", "--served-steps", "2", "--reps", "1",
                                "--steps", "1", "--out-dir", str(tmp_path)])
    written = json.loads((tmp_path / "profile_step_tiny-llama_tp2_cpu.json").read_text())
    assert written == result and result["tensor_parallel_size"] == 2 and result["device"] == "cpu"
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    layers = profile_step.TINY["num_hidden_layers"]
    for row in result["rows"]:
        assert row["graph"] is None and row["step_ms"] > 0
        eager = row["eager"]
        assert eager["device_ms"] > 0 and eager["kernel_ms"] > 0 and eager["host_ms"] > 0
        counts = {k["name"]: k["count"] for k in eager["kernels"] if k["category"] == "all-reduce/all-gather"}
        assert counts.get("c10d::allreduce_") == 2 * layers + 1, counts
        assert counts.get("c10d::broadcast_") == 1 and counts.get("c10d::_allgather_base_") == 1, counts
        assert eager["categories"]["GEMM/GEMV"]["count"] >= 4 * layers  # q/k/v, o, gate/up, down at least
        assert sum(c["share"] for c in eager["categories"].values()) == pytest.approx(1.0, abs=1e-3)
    assert "Batch 2: served step" in profile_step.report(result)


def test_fp8_weights_profiled_apart(tmp_path):
    """--quantization fp8: the dummy weights quantized at load (the CPU serves them dequantized),
    named in the file and the report."""
    result = profile_step.main(["--shape", "tiny-llama", "--device", "cpu", "--quantization", "fp8", "--batch", "1",
                                "--context", "8", "--served-steps", "1", "--reps", "1", "--steps", "1",
                                "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "profile_step_tiny-llama_tp1_fp8_cpu.json").read_text()) == result
    assert result["quantization"] == "fp8" and "float32, fp8 weights" in profile_step.report(result)
