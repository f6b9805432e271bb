"""The decode GEMVs (kernels/gemv.py) compiled ahead of time for sm_90 on any machine (no GPU needed):
for each linear of the Llama-3.1-8B shape at one row, with kernels/gemv.config's tiles, the K loop's
PTX instructions per thread and per weight, ptxas registers and spills, for the int4 GEMV's default
loop (fp32), its half2 option (kernels/gemv_int4.py) and the FP8 GEMV (input quantized before, per
channel) for reference.

    python -m benchmarks.kernels.gemv_ir [--loops int4 half2 half2_prescale fp8] [--x-dtype bf16|fp16]

Issue 47: at one row the int4 GEMV read 1.1 TB/s of weight bytes on gate_up where the FP8 GEMV read
2.8 (benchmarks/results/quant_gemv_h100.json). Compiled here (bf16 rows, group 128; SASS of the K loop,
by the bundled nvdisasm, per weight a thread holds a step), gate_up's default int4 loop takes 7.45
instructions a weight on triton 3.9 and 9.94 on 3.6 (which also stages x through shared memory), the
half2 loop 4.25 and 4.19 (QKV and down_proj alike; o_proj's 4 x 512 tiles, 32 weights a thread: 8.97
and 10.97 against 5.06 and 5.31), the FP8 loop 4.25 and 4.12 for a weight of twice the bytes. What
is left of the half2 loop's ~4 beyond its ~2.2 of arithmetic is per step: addresses, the scales and
zeros, x's pairs moved into the words' layout through shared memory. Compile-time facts, not
timings: bench_quant.py's gemm step times `ours_int4` and `ours_int4_half2` side by side.
"""

from __future__ import annotations

import argparse

from benchmarks.kernels.sm90_ir import compile_sm90, hot_loop, ptxas_info, real_compiler, sass_loop

SMS = 132  # an H100's
LOOPS = ("int4", "half2", "half2_prescale", "fp8", "fp8_w8a16")


def _splits(n: int, k: int, cfg) -> int:
    """kernels.tiles.splits_for on an H100 (the launch's SPLIT constexpr)."""
    tiles, steps, s = -(-n // cfg.block_n), -(-k // cfg.block_k), 1
    while tiles * s < 4 * SMS and steps >= 4 * s:
        s *= 2
    return s if not cfg.split_k else cfg.split_k


def compile_gemv(loop: str, n: int, k: int, x_dtype: str = "bf16", pdl: bool = False):
    """(compiled kernel, its config) of wo_gemv (int4, group 128; half2: its option) or fp8_gemv
    (fp8 input and weight, per channel) at [1, k] x [n, k], as the launcher specialises it (pointers
    and N, K, the split's K 16-aligned)."""
    from kernels import gemv

    cfg = gemv.config(n, k, not loop.startswith("fp8"), loop == "fp8_w8a16")
    common = dict(SPLIT=_splits(n, k, cfg) > 1, HAS_BIAS=False, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=pdl)
    out = "*" + x_dtype
    if loop.startswith("fp8"):  # fp8_w8a16: the row in x_dtype, not quantized (weight_only)
        kernel = gemv._fp8_gemv_kernel
        types = dict(x_ptr="*fp8e4nv" if loop == "fp8" else out, xs_ptr="*fp32", static_ptr="*fp32",
                     w_ptr="*fp8e4nv", ws_ptr="*fp32", stride_ws="i32")
        act = gemv.ACT_FP8 if loop == "fp8" else gemv.ACT_NONE
        const = dict(ACT=act.value, GROUP=gemv.PER_CHANNEL.value, CVT=True, **common)  # (sm_90: by conversion)
        out = "*bf16"
    elif loop == "int4":
        kernel = gemv._wo_gemv_kernel
        types = dict(x_ptr=out, w_ptr="*i32", s_ptr="*fp32", z_ptr="*u8", gidx_ptr="*fp32", groups="i32")
        const = dict(INT4=True, GROUP=128, HAS_GIDX=False, **common)
    else:
        from kernels.gemv_int4 import _int4_half2_kernel as kernel

        types = dict(x_ptr="*i32", w_ptr="*i32", s_ptr="*fp32", z_ptr="*u8", groups="i32")
        const = dict(X_BF16=x_dtype == "bf16", GROUP=128, PRESCALE=loop == "half2_prescale", **common)
    types.update(bias_ptr=out, out_ptr=out, part_ptr="*fp32" if common["SPLIT"] else out,
                 count_ptr="*i32" if common["SPLIT"] else out, N="i32", K="i32", k_per_split="i32")
    aligned = lambda a: types[a].startswith("*") or a in ("N", "K", "k_per_split")  # noqa: E731
    options = {"num_warps": cfg.num_warps, "num_stages": 3, **({"launch_pdl": True} if pdl else {})}
    return compile_sm90(kernel, types, const, aligned, options), cfg


def describe(compiled, cfg) -> dict:
    """The K loop (the longest loop with a global load): instructions per thread a step and per
    weight (BLOCK_N x BLOCK_K weights over the warps' threads), the commonest opcodes, registers."""
    ops = hot_loop(compiled.asm["ptx"], marker="ld.global")
    sass = sass_loop(compiled.asm["cubin"])
    regs, spill = ptxas_info(compiled.asm["ptx"]) or (0, -1)
    weights = cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
    total, total_sass = sum(ops.values()), sum(sass.values())
    return dict(instructions=total, weights=weights, per_weight=round(total / weights, 2), sass=total_sass,
                sass_per_weight=round(total_sass / weights, 2), regs=regs, spill=spill,
                top=", ".join(f"{op} {c}" for op, c in sass.most_common(6)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS)
    ap.add_argument("--x-dtype", default="bf16", choices=["bf16", "fp16"], help="the int4 GEMVs' row (x) dtype")
    ap.add_argument("--linears", nargs="+", default=None, help="of the Llama-3.1-8B shape (default: all four)")
    ap.add_argument("--pdl", action="store_true", help="as launched with PDL (kernels/pdl.py): also print the "
                    "prologue's prefetches and grid-dependency instructions")
    args = ap.parse_args(argv)
    real_compiler("gemv_ir")  # before the kernel modules' first import
    import triton

    from benchmarks.quant.bench_quant import linear_shapes

    print(f"triton {triton.__version__}, sm_90, one row of the Llama-3.1-8B shape, int4 group 128 with "
          f"{args.x_dtype} rows, fp8 per channel; per loop: the K loop's PTX instructions a thread a step, a "
          "weight, ptxas registers/spills, the commonest opcodes", flush=True)
    for name, (n, k) in linear_shapes("llama-3.1-8b").items():
        if args.linears and name not in args.linears:
            continue
        for loop in args.loops:
            compiled, cfg = compile_gemv(loop, n, k, args.x_dtype, args.pdl)
            d = describe(compiled, cfg)
            if args.pdl:
                ptx = compiled.asm["ptx"]
                print(f"  {name:12s} {loop}: PDL prologue: {ptx.count('prefetch.global.L2')} L2 prefetches, "
                      f"{ptx.count('griddepcontrol.launch_dependents')} launch_dependents, "
                      f"{ptx.count('griddepcontrol.wait')} wait", flush=True)
            tile = f"{cfg.block_n} x {cfg.block_k} w{cfg.num_warps}"
            print(f"  {name:12s} {n:5d} x {k:5d} {loop:14s} {tile:14s} {d['weights']} weights a thread a step: "
                  f"PTX {d['instructions']} = {d['per_weight']:.2f} a weight, SASS {d['sass']} = "
                  f"{d['sass_per_weight']:.2f} a weight; {d['regs']} regs, {d['spill']} B spilled; SASS {d['top']}",
                  flush=True)


if __name__ == "__main__":
    main()
