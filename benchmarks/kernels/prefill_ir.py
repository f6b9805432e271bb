"""The flash prefill kernel compiled ahead of time for sm_90 on any machine (no GPU needed): how deep
each key loop's async copies stay in flight, and the registers and spills ptxas reports.

    python -m benchmarks.kernels.prefill_ir [--configs default asm split ...] [--pointers]

Issue 45's paged-prefix chunks run at ~240 TFLOP/s where the contiguous kernel runs at ~580. Compiled
here (triton 3.6 and 3.9 alike, the engine's launch on the Llama-3.1-8B shape: 128-row tiles of 4
heads, head_dim 128, 128x64 tiles, 3 stages, new-token K/V through TMA descriptors), the prefix loop
waits for every copy in flight at the top of each iteration (`async_wait {num = 0}`), because Triton
pipelines the page-id load as an async copy committed after the K/V copies of the tiles ahead. With
PrefillConfig.prefix_ids "asm" (the ids through an inline ld.global) it waits with num = 2: two tiles
ahead stay in flight, as in the new-token loops when they too go through pointers (--pointers shows
them). A compile-time fact, not a timing: bench_prefill_chunks.py has the rows that say what it is
worth. Each config prints the depth of each cp.async loop (the prefix loop first), then registers,
spills and shared memory. Needs triton's NVIDIA backend (its bundled ptxas), not a GPU.
"""

from __future__ import annotations

import argparse

from benchmarks.kernels.sm90_ir import compile_sm90, loop_waits, real_compiler, regs_text

# name -> (constexpr overrides, launch options): the prefix tile the tables pick and its options
CONFIGS = {
    "default": ({}, {}),
    "asm": ({"PREFIX_CLAMP_IDS": True, "PREFIX_ASM_IDS": True}, {}),
    "split": ({"PREFIX_SPLIT": True}, {}),
    "asm_split": ({"PREFIX_CLAMP_IDS": True, "PREFIX_ASM_IDS": True, "PREFIX_SPLIT": True}, {}),
    "stages4": ({}, {"num_stages": 4}),
    "asm_stages4": ({"PREFIX_CLAMP_IDS": True, "PREFIX_ASM_IDS": True}, {"num_stages": 4}),
}
BASE = dict(HEAD_DIM=128, GROUP=4, PACK=4, CACHE_BLOCK=16, HAS_PREFIX=True, BLOCK_M=128, BLOCK_N=64, BLOCK_D=128,
            UPCAST_DOT=False, WHILE_LOOPS=False, TILE_MAP=False, USE_TMA=True, DIAG=0, DIAG_N=64, KV_FP8=False,
            TILES_FASTEST=False, PREFIX_N=64, PREFIX_SPLIT=False, PREFIX_CLAMP_IDS=False, PREFIX_ASM_IDS=False,
            K_DESC_D=None, V_DESC_D=None,  # (the diagonal's own descriptors only where DIAG_N != BLOCK_N)
            PREFIX_TMA=False, PK_DESC=None, PV_DESC=None)  # (a paged prefix: no gathered copy's descriptors)


def compile_config(constexprs: dict, options: dict, pointers: bool = False):
    """The kernel for sm_90 with the launcher's specialisations (16-aligned pointers, strides
    multiples of 16 but the block-table row stride); pointers: new-token K/V through pointers."""
    from kernels.flash_prefill_kernels import _flash_prefill_kernel

    const = {**BASE, **constexprs}
    if pointers:
        const.update(USE_TMA=False, K_DESC=None, V_DESC=None)

    def kind(n: str) -> str:
        if n in ("K_DESC", "V_DESC"):
            return "tensordesc<bf16[64, 128]>"  # BLOCK_N x head_dim tiles of [tokens, kv_heads * head_dim]
        if n in ("Q", "K", "V", "O", "K_CACHE", "V_CACHE"):
            return "*bf16"
        if n.isupper():
            return "*i32"  # sequence tables; the fp8 scales (unused: KV_FP8 False)
        return "fp32" if n == "qk_scale" else "i32"

    names = [n for n in _flash_prefill_kernel.arg_names if n not in const]
    types = {n: kind(n) for n in names}
    return compile_sm90(_flash_prefill_kernel, types, const,
                        lambda n: types[n].startswith("*") or (n.startswith("stride") and n != "stride_bts"),
                        {"num_warps": 8, "num_stages": 3, **options})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["default", "asm"], choices=list(CONFIGS))
    ap.add_argument("--pointers", action="store_true", help="new-token K/V through pointers (cp.async loops too)")
    args = ap.parse_args(argv)
    real_compiler("prefill_ir")  # before the kernel module's first import
    import triton

    print(f"triton {triton.__version__}, sm_90, head_dim 128, 128 rows of 4 heads, prefix tile 64 keys, new-token "
          f"K/V through {'pointers' if args.pointers else 'TMA'}")
    for name in args.configs:
        k = compile_config(*CONFIGS[name], pointers=args.pointers)
        waits = loop_waits(k.asm["ttgir"])
        print(f"{name}: async_wait depth per cp.async loop (prefix first) {', '.join(waits)}; "
              f"{regs_text(k.asm['ptx'])}; {k.metadata.shared // 1024} KiB shared", flush=True)


if __name__ == "__main__":
    main()
