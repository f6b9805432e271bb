"""The paged decode kernel compiled ahead of time for sm_90 on any machine (no GPU needed), 16-bit
and fp8 (e4m3) caches side by side: each config's key-loop copy depth, the loop's instructions per
K/V tile, how its dot operands leave shared memory, registers, spills, shared memory, and the CTAs an
SM holds.

    python -m benchmarks.kernels.decode_ir [--head-dims 128 64] [--new-kv [--tail]]

Issue 46: the fp8 kernel reads 59-80% of the H100's copy bandwidth (fp8 bytes) where the 16-bit one
reads 88-99% (benchmarks/results/fp8_kv_decode_h100.json). The launches compiled are those of that
benchmark on the Llama-3.1-8B shape (32 query heads, 8 KV heads, block 16, bf16 queries; head_dim
128 and 64): the configs decode_config's tables pick for its long-context shapes (K/V >= 256 MB),
and the fp8 sweep's best configs where the JSON holds them. --new-kv: the engine's launch instead
(this step's K/V written by the kernel, NEW_KV), which compiles to another loop.

What it showed (triton 3.6 and 3.9 alike): the copies stay as deep in flight for fp8 as for 16 bits
(async_wait num 3 at 5 stages, 0 at 3 stages, for both; the page ids are committed last), and
nothing spills. The difference is the instructions: Triton fuses the fp8 -> fp16 cast into the dots'
operand reads from shared memory, and V's operand runs across rows, so each thread reads it a byte
at a time (64 ld.shared.b8 a 64-key tile at head_dim 128, where 16 bits take 8 ldmatrix.trans), and
V's copies are 8 bytes wide: 727 instructions a tile against 505 for a 16-bit tile of twice the
bytes (3.6; 3.9: 669 and 428). Casting V through an inline cvt Triton cannot move, staged in fp16
as a 16-bit V is, made that 508 (467) at 127 registers instead of 168, but measured no faster on an
H100 and was removed (kernels/decode_config.py). The engine's launch (--new-kv) is another loop: the
where() that puts this step's K/V into its tile already stages both tiles in fp16, for 16 bits too
(head_dim 128: 738-799 instructions a tile, 168-190 registers, 2-3 CTAs an SM), so the 16-bit
figures the benchmark measured are not the engine's. Compile-time facts, not timings:
bench_fp8_kv.py --fused-write times them.

--new-kv --tail: each engine launch also with decode_config's NEW_KV_TAIL (the step's token added
after the loop, by the last split), a row "... tail" under each. Its loop is the launch without the
write's, instruction for instruction (head_dim 128, 16 bits: 505 and 451 a tile instead of 799 and
749 on triton 3.6, 428 and 393 instead of 738 and 699 on 3.9), at 142 and 128 registers (3.6; the
launch without the write: 127 and 128) instead of 190 and 182: 3-4 CTAs an SM instead of 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.kernels.sm90_ir import compile_sm90, copy_widths, hot_loop, loop_waits, ptxas_info, real_compiler

HEADS, KV_HEADS, BLOCK_SIZE, SMS = 32, 8, 16, 132  # the Llama-3.1-8B shape on an H100
SWEEP_JSON = Path(__file__).resolve().parents[1] / "results" / "fp8_kv_decode_h100.json"
SM_SHARED, SM_REGS = 228 * 1024, 65536  # an H100 SM's shared memory and registers


def table_configs(head_dim: int, fp8: bool) -> list[tuple[dict, str]]:
    """The distinct configs the table picks for bench_fp8_kv's long-context shapes of this head_dim
    (group 4, 16-bit K/V >= 256 MB), each with the first shape that picks it."""
    from benchmarks.kernels.bench_fp8_kv import DECODE_SHAPES
    from kernels.decode_config import choose_fp8_config, choose_gpu_config

    pick = choose_fp8_config if fp8 else choose_gpu_config
    out: dict[tuple, tuple[dict, str]] = {}
    for b, n, h, kvh, d in DECODE_SHAPES:
        if (h, kvh, d) == (HEADS, KV_HEADS, head_dim) and 4 * b * n * kvh * d >= 256 << 20:
            cfg = pick(b, kvh, h // kvh, n, SMS, d)
            key = tuple((k, v) for k, v in sorted(cfg.items()) if k != "num_splits")
            out.setdefault(key, (cfg, f"table, b={b} n={n}"))
    return list(out.values())


def sweep_configs(head_dim: int, path: Path = SWEEP_JSON) -> list[tuple[dict, str]]:
    """The fastest config of each swept GQA shape of this head_dim in the fp8 sweep's JSON (none
    without it), at its split count."""
    if not path.exists():
        return []
    rows = [r for r in json.loads(path.read_text())["rows"] if r["impl"] == "paged_decode fp8 sweep"
            and (r["heads"], r["kv_heads"], r["head_dim"]) == (HEADS, KV_HEADS, head_dim)]
    out: dict[tuple, tuple[dict, str]] = {}
    for shape in sorted({(r["batch"], r["context"]) for r in rows}):
        best = min((r for r in rows if (r["batch"], r["context"]) == shape), key=lambda r: r["ms"])
        cfg = dict(best["default"] if best["config"] == "default" else best["config"], num_splits=best["num_splits"])
        key = tuple((k, v) for k, v in sorted(cfg.items()) if k != "num_splits")
        out.setdefault(key, (cfg, f"sweep best, b={shape[0]} n={shape[1]}"))
    return list(out.values())


def compile_launch(head_dim: int, fp8: bool, cfg: dict, new_kv: bool = False, tail: bool = False):
    """The decode kernel as decode_launch._launch compiles it for this config (q, k_new, v_new, the
    cache and the block tables 16-aligned; strides multiples of 16 but num_splits and the block-table
    row stride, which the kernel does not specialise)."""
    import triton

    from kernels.decode_config import merge_constexprs
    from kernels.decode_kernels import _decode_kernel

    splits = int(cfg["num_splits"])
    split, splits_pad = splits > 1, max(2, triton.next_power_of_2(splits))
    merge, half = merge_constexprs(HEADS // KV_HEADS, splits_pad, head_dim, cfg, split)
    kv = "fp8e4nv" if fp8 else "bf16"
    types = dict(q_ptr="*bf16", k_ptr="*" + kv, v_ptr="*" + kv, bt_ptr="*i32", ctx_ptr="*i32", kn_ptr="*bf16",
                 vn_ptr="*bf16", slot_ptr="*i32", out_ptr="*bf16", po_ptr="*fp32" if split else "*bf16",
                 plse_ptr="*fp32" if split else "*bf16", cnt_ptr="*i32" if split else "*bf16",
                 ks_ptr="*fp32" if fp8 else "*i32", vs_ptr="*fp32" if fp8 else "*i32", scale_log2="fp32")
    names = [n for n in _decode_kernel.arg_names if n.islower()]
    types.update({n: "i32" for n in names if n not in types})
    const = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, GROUP=HEADS // KV_HEADS, GROUP_PAD=16,
                 BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=cfg["BLOCK_N"], SPLIT=split, DOT_F32=False,
                 PREFETCH=cfg.get("PREFETCH", 0), LANES=False, FUSED_MERGE=split, SPLITS_PAD=splits_pad,
                 NEW_KV=new_kv, MERGE_HEADS=merge, MERGE_HALF=half, KV_FP8=fp8, NEW_KV_TAIL=new_kv and tail, PDL=False)
    return compile_sm90(_decode_kernel, types, const,
                        lambda n: types[n].startswith("*") or n not in ("num_splits", "stride_bts", "scale_log2"),
                        {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})


def describe(k, warps: int) -> dict:
    """What one compiled launch shows: copy depth per cp.async loop, the main loop's instructions
    and operand reads, registers, spills, shared memory, CTAs per SM (registers, shared memory)."""
    ops = hot_loop(k.asm["ptx"])
    regs, spill = ptxas_info(k.asm["ptx"]) or (0, -1)
    shared = k.metadata.shared
    by_regs = SM_REGS // (-(-regs // 8) * 8 * 32 * warps) if regs else 0
    by_shared = SM_SHARED // (shared + 1024)
    pick = lambda s: sum(n for op, n in ops.items() if s in op)  # noqa: E731
    return dict(waits=loop_waits(k.asm["ttgir"]), instructions=sum(ops.values()), regs=regs, spill=spill,
                shared_kib=shared // 1024, ctas=min(by_regs, by_shared, 32), ld_shared_b8=pick("ld.shared.b8"),
                ldmatrix_trans=pick("ldmatrix.sync.aligned.m8n8.x4.trans"), ldmatrix=pick("ldmatrix"),
                cvt_fp8=pick(".e4m3x2"), copies={w: n for w, n in sorted(copy_widths(k.asm["ptx"]).items())})


def line(name: str, cfg: dict, d: dict) -> str:
    tile = f"BLOCK_N {cfg['BLOCK_N']} w{cfg['num_warps']} st{cfg['num_stages']} splits {cfg['num_splits']}"
    return (f"  {name:14s} {tile:30s} wait {','.join(d['waits']) or '-'}; loop {d['instructions']} instr/tile, "
            f"ld.shared.b8 {d['ld_shared_b8']}, ldmatrix {d['ldmatrix']} ({d['ldmatrix_trans']} .trans), "
            f"cvt {d['cvt_fp8']}; copies {d['copies']} B x n; {d['regs']} regs, {d['spill']} B spilled, "
            f"{d['shared_kib']} KiB, {d['ctas']} CTAs/SM")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], choices=[128, 64])
    ap.add_argument("--new-kv", action="store_true", help="the engine's launch (the step's K/V written in-kernel)")
    ap.add_argument("--no-sweep", action="store_true", help="the tables' configs only")
    ap.add_argument("--tail", action="store_true",
                    help="with --new-kv, the option NEW_KV_TAIL too (the step's token after the loop) beside each row")
    args = ap.parse_args(argv)
    real_compiler("decode_ir")  # before the kernel modules' first import
    import triton

    print(f"triton {triton.__version__}, sm_90, {HEADS}/{KV_HEADS} heads, block {BLOCK_SIZE}, bf16 queries, "
          f"{'the engine launch (NEW_KV)' if args.new_kv else 'the benchmark launch (no K/V write)'}; per config: "
          "async_wait depth of the key loop, its PTX instructions per tile (per thread) and operand reads, "
          "cp.async widths over the kernel, ptxas registers/spills, shared memory, CTAs per SM", flush=True)
    for hd in args.head_dims:
        print(f"head_dim {hd}:", flush=True)
        tails = (False, True) if args.new_kv and args.tail else (False,)
        for cfg, why in table_configs(hd, False):
            for tail in tails:
                d = describe(compile_launch(hd, False, cfg, new_kv=args.new_kv, tail=tail), cfg["num_warps"])
                print(line("16-bit" + " tail" * tail, cfg, d) + f" ({why})", flush=True)
        fp8_cfgs = table_configs(hd, True) + ([] if args.no_sweep else sweep_configs(hd))
        for cfg, why in fp8_cfgs:
            for tail in tails:
                d = describe(compile_launch(hd, True, cfg, args.new_kv, tail), cfg["num_warps"])
                print(line("fp8" + " tail" * tail, cfg, d) + f" ({why})", flush=True)


if __name__ == "__main__":
    main()
