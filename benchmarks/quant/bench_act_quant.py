"""The activation kernels between an FP8 model's GEMMs, at a shape's rows (GPU): where the offline
profile (benchmarks/peers/run.py --profile, Llama-3.1-8B fp8-dynamic on an H200) put flashpage's
`_silu_quant_kernel` at 576 ms of a 5.97 s run against 232 ms for vLLM's compiled equivalent.

  silu_fp8_row      kernels.fp8_quant.silu_mul_fp8 with one program a row (split_rows=0: the path more
                    than 16 rows took before 0a8bc16, with this tree's rounding)
  silu_fp8_split    the same cut into 1024-column chunks: the chunks' values and amax, then the row's
                    scale and q (two launches)
  silu_fp8          as models/quant calls it (the default rule: kernels.fp8_quant.SPLIT_MAX_ROWS)
  silu_mul          kernels.silu_mul.silu_mul alone (16-bit out): the bf16 model's kernel
  compiled          torch.compile of the reference (silu * up, per-token absmax scale, division,
                    clamp, fp8 cast): what vLLM's compiled graph fuses there (not bit-exact to ours)
  norm_fp8          kernels.fp8_quant.add_rmsnorm_fp8 at the hidden size (the other fused activation)

Rows M in --rows; each case a CUDA graph of calls cycling over inputs that together pass the L2
cache (at least --calls calls, each input once at least; device time only), the median of
triton.testing.do_bench. Every ours-case is first checked equal,
bit for bit, to the default path. FLASHPAGE_BF16_ROUND_BITS=1 in the environment times the kernels
with bf16 rounded on the bits (kernels/rounding.py) instead of by the conversion instruction.

    python -m benchmarks.quant.bench_act_quant [--shape llama-3.1-8b] [--out-dir benchmarks/results/experiments]
Writes act_quant_<shape>[_round-bits]_<gpu>.json.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.shared.checkpoint import LLAMA_SHAPES
from benchmarks.shared.common import gpu_run_info, write_result

ROWS = (1, 16, 32, 64, 256, 1024, 4096)


def silu_quant_torch(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up quantized per token (scale = amax / 448) in torch ops: the chain vLLM's
    compiled graph fuses there, and eagerly the same bits as silu_mul_fp8 (tests/benchmarks)."""
    inter = gate_up.shape[1] // 2
    h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    s = (h.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    return (h.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


def compiled_reference():
    """silu_quant_torch compiled: the fusion vLLM's graph makes (its bits may differ from ours)."""
    torch._dynamo.config.cache_size_limit = 64  # one graph a row count
    return torch.compile(silu_quant_torch, dynamic=False)


def graph_us(fn, inputs: list, calls: int) -> float:
    """Median device µs of one call: calls cycling over `inputs` (each at least once, `calls` at
    least), captured as one CUDA graph."""
    import triton

    for x in inputs[:2]:
        fn(x)  # compiles / autotunes outside the capture
    torch.cuda.synchronize()
    calls = max(calls, len(inputs))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(inputs[i % len(inputs)])
    return triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median") * 1e3 / calls


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(LLAMA_SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--no-compiled", action="store_true", help="skip the torch.compile case (its compiles take minutes)")
    ap.add_argument("--out-dir", default="benchmarks/results/experiments")
    args = ap.parse_args(argv)
    from kernels.fp8_quant import add_rmsnorm_fp8, silu_mul_fp8
    from kernels.silu_mul import silu_mul

    cfg = LLAMA_SHAPES[args.shape]
    inter, hidden = cfg["intermediate_size"], cfg["hidden_size"]
    dt = torch.bfloat16
    compiled = None if args.no_compiled else compiled_reference()
    w = torch.rand(hidden, dtype=dt, device="cuda") + 0.5
    rows = []
    for m in args.rows:
        copies = max(2, -(-256 * 2**20 // (m * 2 * inter * 2)))  # inputs that together pass the L2 cache
        gus = [torch.randn(m, 2 * inter, dtype=dt, device="cuda") for _ in range(min(copies, 64))]
        xs = [torch.randn(m, hidden, dtype=dt, device="cuda") for _ in range(min(copies, 64))]
        ys = [torch.randn(m, hidden, dtype=dt, device="cuda") for _ in range(min(copies, 64))]
        ours = {"silu_fp8": lambda x: silu_mul_fp8(x),
                "silu_fp8_row": lambda x: silu_mul_fp8(x, split_rows=0),
                "silu_fp8_split": lambda x: silu_mul_fp8(x, split_rows=1 << 30)}
        want = ours["silu_fp8"](gus[0])
        for name, fn in ours.items():
            q, s = fn(gus[0])
            assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(s, want[1]), name
        cases = {**ours, "silu_mul": silu_mul, **({"compiled": compiled} if compiled else {})}
        moved = m * (2 * inter * 2 + inter)  # bytes: gate_up read, q written
        for name, fn in cases.items():
            us = graph_us(fn, gus, args.calls)
            rows.append(dict(impl=name, m=m, inter=inter, us=round(us, 2), tbps=round(moved / us / 1e6, 3)))
            print(f"M={m:5d} {name:15s} {us:9.2f} us", flush=True)
        pairs = list(zip(xs, ys))
        us = graph_us(lambda xy: add_rmsnorm_fp8(xy[0], xy[1], w, 1e-5), pairs, args.calls)
        rows.append(dict(impl="norm_fp8", m=m, hidden=hidden, us=round(us, 2),
                         tbps=round(m * hidden * (2 * 2 + 2 + 1) / us / 1e6, 3)))
        print(f"M={m:5d} {'norm_fp8':15s} {us:9.2f} us", flush=True)
        del gus, xs, ys
    bits = os.environ.get("FLASHPAGE_BF16_ROUND_BITS", "0") == "1"
    result = {**gpu_run_info("benchmarks.quant.bench_act_quant", argv), "shape": args.shape,
              "bf16_rounding": "bits" if bits else "conversion", "rows": rows}
    out = write_result(result, args.out_dir, f"act_quant_{args.shape}{'_round-bits' if bits else ''}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
