"""What a profiled kernel does, from its name: the categories profile_step.py groups a decode step's
device time into, and the per-step table of kernels it reports.

Names are matched in order, first rule wins (case-insensitive), so the specific rules come before
the general ones: an NCCL all-gather is an all-reduce/all-gather before "gather" makes it a copy, a
fused norm-and-quantize kernel is a norm before "quant" makes it elementwise. A CUDA device's names
are those of its kernels (Triton's are the function's, e.g. `_decode_kernel`; cuBLAS's `nvjet_*`,
`sm90_xmma_gemm_*`, `gemv*`; NCCL's `ncclDevKernel_AllReduce_*`; the custom all-reduce's
`_one_shot_kernel`, kernels/one_shot_all_reduce.py); on the CPU they are operators (`aten::mm`,
`c10d::allreduce_`), and torch's SDPA, which serves decodes there too, counts as prefill attention.

Some Triton names say nothing of their job: `_merge_kernel` is the paged decode's split-KV merge,
the argmax's merge of its chunks and the batch-invariant attention's merge alike. Such a kernel
takes the category of the kernel before it in the stream, and its row is named after both
(`_merge_kernel after _decode_kernel`), so that the two merges are rows of their own.
"""

from __future__ import annotations

import re

RULES: list[tuple[str, str]] = [
    ("all-reduce/all-gather", r"nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|one_shot|two_shot|multimem"
                              r"|gloo|c10d::"),
    # FlashAttention-3 (vLLM's on Hopper: FlashAttnFwdSm90, FlashAttnFwdCombine, prepare_varlen_num_blocks)
    # runs prefill and decode rows in one kernel: a category of its own. Not FlashAttention-2's
    # flash::flash_fwd_* nor torch's SDPA (pytorch_flash::flash_fwd_*): prefill, below
    ("attention (FlashAttention-3)", r"flashattn|flash::prepare_varlen"),
    # torch.compile's generated pointwise / reduction kernels (vLLM compiles its model): fused
    # elementwise work, norms included (its GEMM templates, triton_tem_*, stay GEMMs)
    ("compiled (inductor)", r"^triton_(poi|red|per)_"),
    ("attention decode", r"decode|paged"),
    ("attention prefill", r"prefill|_attn_kernel|flash_fwd|fmha|scaled_dot_product|sdpa|efficient_attention"),
    ("rotary/KV write", r"rope|rotary|kv_write|reshape_and_cache"),
    ("norms", r"norm"),
    ("sampling/argmax", r"argmax|_chunk_kernel|sampl|noise|gumbel|softmax|topk|top_k|penalt|grammar|_wait_kernel"
                        r"|multinomial|sort"),
    ("GEMM/GEMV", r"gemm|gemv|matmul|nvjet|xmma|cutlass|cublas|splitkreduce|_linear_kernel|_dequant_kernel|_scaled_mm|^triton_tem_"
                  r"|aten::(mm|addmm|bmm|baddbmm|linear)$"),
    ("copies", r"memcpy|memset|copy|fill|embed|index_?select|cat_?array|gather|aten::(index|cat|stack|clone)$"),
    ("elementwise", r"elementwise|silu|gelu|swiglu|act_and_mul|quant|aten::(add|mul|sub|div|neg|exp|rsqrt|pow|where"
                    r"|masked_fill|clamp|sigmoid)_?$"),
]
CATEGORIES = [name for name, _ in RULES] + ["other"]
_RULES = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in RULES]
INHERITS = re.compile(r"^_merge_kernel$")  # kernels whose names say nothing of their job (above)


def category(name: str) -> str:
    """The category of a kernel (or CPU operator) by its name alone."""
    return next((cat for cat, rule in _RULES if rule.search(name)), "other")


def label(names: list[str]) -> list[tuple[str, str]]:
    """(row name, category) of each kernel of a stream, in its order: a kernel whose name says
    nothing (INHERITS) is named after, and takes the category of, the kernel before it."""
    out, prev = [], None
    for name in names:
        if INHERITS.search(name) and prev is not None:
            out.append((f"{name} after {prev[0]}", prev[1]))
        else:
            out.append((name, category(name)))
            prev = (name, out[-1][1])
    return out


def profiled_events(prof, on_cuda: bool) -> list[tuple[float, str, float]]:
    """(start us, name, us) of every kernel a torch.profiler run saw, or on the CPU (on_cuda False)
    of every operator by its self time: breakdown's events. Annotated ranges (record_function) and
    async events are not kernels of their own."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if on_cuda else DeviceType.CPU
    return [(e.time_range.start, e.name, e.time_range.elapsed_us() if on_cuda else e.self_cpu_time_total)
            for e in prof.events() if e.device_type == kind and not (e.is_async or e.is_user_annotation)]


def breakdown(events: list[tuple[float, str, float]], steps: int) -> dict:
    """Per step, of profiled kernels `events` (start us, name, duration us) over `steps` steps: the
    summed kernel time (`kernel_ms`), the time at least one kernel ran (`busy_ms`: less than the sum
    where kernels overlap, e.g. an all-reduce on its own stream), the kernel count, every kernel
    row {name, category, us, count} by time, and each category's {us, count, share} of the sum."""
    events = sorted(events)
    rows: dict[str, dict] = {}
    for (_, name, us), (key, cat) in zip(events, label([e[1] for e in events])):
        row = rows.setdefault(key, {"name": key, "category": cat, "us": 0.0, "count": 0})
        row["us"] += us
        row["count"] += 1
    busy, end = 0.0, float("-inf")  # the union of the kernels' intervals
    for start, _, us in events:
        busy += max(0.0, start + us - max(start, end))
        end = max(end, start + us)
    total = sum(r["us"] for r in rows.values())
    kernels = sorted(({**r, "us": round(r["us"] / steps, 2), "count": round(r["count"] / steps, 2)}
                      for r in rows.values()), key=lambda r: -r["us"])
    categories = {}
    for cat in CATEGORIES:
        mine = [r for r in rows.values() if r["category"] == cat]
        if mine:
            us = sum(r["us"] for r in mine)
            categories[cat] = {"us": round(us / steps, 2), "count": round(sum(r["count"] for r in mine) / steps, 2),
                               "share": round(us / total, 4) if total else 0.0}
    return {"kernel_ms": round(total / steps / 1e3, 4), "busy_ms": round(busy / steps / 1e3, 4),
            "kernels_per_step": round(len(events) / steps, 2), "categories": categories, "kernels": kernels}
