"""A long prompt's prefill as the engine runs it: in chunks, each attending to the cached prefix
through the paged cache. Where issue 45's side by side lost (Llama-3.1-8B shape, a 32k-token prompt:
TTFT 1,747 ms against vLLM's 1,240; at 8k the two tie), this times the attention of each chunk.

    python -m benchmarks.kernels.bench_prefill_chunks [--prompt 32768] [--chunk 8192] [--out-dir benchmarks/results]

For a prompt of N tokens cut into chunks of C (the engine's --max-num-batched-tokens), chunk i is C
new tokens whose keys are the chunk's own (causal) plus the i·C before it, read from a paged KV cache
(block 16, blocks in a shuffled order as a long-running server's are). Rows, per chunk:
- flashpage: kernels/flash_prefill.py with the paged prefix, as the engine calls it (the first chunk,
  no prefix yet, without the cache, as the engine's has_prefix does);
- flashpage_contiguous: the whole prompt so far (i·C + C tokens, no page table) in one call, only the
  last C queries' outputs kept: the kernel's contiguous path over the same keys, but it also runs the
  i·C earlier queries, so its `tflops` (the chunk's useful work) understates it; `tflops_run` counts
  the work it ran;
- *_tiles_fastest: the same two with PrefillConfig.order "tiles_fastest" (the query tiles vary fastest
  in the grid, so the programs resident at once stream one or two kv heads' prefix, not all eight:
  the L2 hypothesis of issue 45), the same output bits;
- flashpage_load_ids / _split / _prefix_n32 / _prefix_n128 / _stages4 / _asm_ids* (chunks with a
  prefix): the paged prefix loop's options (PrefillConfig.prefix_split, prefix_n, num_stages,
  prefix_ids), see PREFIX_OPTIONS (flashpage_load_ids: the table's loop until 2026-11-27); one the GPU
  cannot compile is skipped with a line saying why;
- flashpage_tile_map, flashpage_gathered_tile_map: flashpage and flashpage_gathered launched with
  the tile map the engine's eager steps build (prefill_arrays), as the engine launches them;
- flashpage_gathered (chunks with a prefix): the prefix's blocks copied out of the cache back to back
  (index_select), then the kernel reads the copy in whole tiles (flash_prefill's prefix_starts), as
  the engine runs a long chunk (models/attention/triton_backend.py gather_plan), the copy timed too;
  flashpage_gathered_kernel: the same kernel over a copy made before the timing;
- vllm_fa3 (only where vLLM's site is importable, VLLM_SITE): vLLM's FlashAttention-3
  `flash_attn_varlen_func` with the same block table, what `vllm serve` runs on Hopper;
and one whole-prompt row per impl (the prompt in one call, the cuDNN SDPA backend as the contiguous
ceiling; flashpage in both orders). TFLOP/s counts the useful causal work: 4·H·D·C·(i·C + C/2) per
chunk (H query heads).
Time: triton.testing.do_bench medians. Before timing, each impl's chunk output is checked against
kernels/reference.py's prefill_attention_ref on the last chunk, the first kv head's query heads (a
failed check stops the run).
Writes prefill_chunks_<gpu>.json; `--smoke` runs tiny sizes anywhere (the CPU under the interpreter).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.shared.common import gpu_run_info, write_result
from kernels.flash_prefill import block_m, flash_prefill, tile_map
from kernels.reference import prefill_attention_ref

SHAPE = dict(heads=32, kv_heads=8, head_dim=128, block_size=16)  # Llama-3.1-8B's attention
SMOKE = dict(heads=4, kv_heads=2, head_dim=16, block_size=4)
# The paged prefix loop's options (kernels/prefill_config.py PrefillConfig), each spelled out whole,
# not on top of the table's pick (128-key tiles, page ids through the inline load, 3 stages, since
# 2026-11-27): LOAD is the table's loop before (64-key tiles, tl.load's ids), alone and with
# unmasked whole tiles, narrower tiles or a deeper pipeline (the whole launch's num_stages); each
# half of the table's change alone; the table's loop with unmasked whole tiles.
LOAD, ASM = {"prefix_ids": "load", "prefix_n": 64}, {"prefix_ids": "asm", "prefix_n": 64}
PREFIX_OPTIONS = {"flashpage_load_ids": LOAD, "flashpage_split": {**LOAD, "prefix_split": True},
                  "flashpage_prefix_n32": {**LOAD, "prefix_n": 32},
                  "flashpage_prefix_n128": {**LOAD, "prefix_n": 128}, "flashpage_stages4": {**LOAD, "num_stages": 4},
                  "flashpage_asm_ids": ASM, "flashpage_asm_ids_stages4": {**ASM, "num_stages": 4},
                  "flashpage_asm_ids_n128_split": {"prefix_ids": "asm", "prefix_n": 128, "prefix_split": True}}

# The gathered prefix's kernel (over a copy made before the timing) with other launch options than
# the table's (kernels/prefill_config.py: 128x128 tiles, 3 stages, query tiles fastest): the
# table's tile for an 8k chunk without a prefix (what the copy had until 2026-11-28), and the table's
# tile in the other program order.
GATHERED_OPTIONS = {"flashpage_gathered_chunk_tile": {"block_n": 64, "num_stages": 2, "maxnreg": 128, "diag": 1,
                                                      "order": "heads_fastest"},
                    "flashpage_gathered_heads_fastest": {"order": "heads_fastest"}}


def chunk_flops(start: int, n: int, heads: int, d: int) -> float:
    """Useful causal work of n queries at positions [start, start + n): each attends to every
    earlier position and itself (2 matmuls of 2 flops per multiply-add)."""
    return 4.0 * heads * d * n * (start + (n + 1) / 2)


def run_flops(impl: str, start: int, n: int, heads: int, d: int) -> float:
    """The work a row's call runs: the chunk's, or for a contiguous row every query up to its end."""
    return chunk_flops(0, start + n, heads, d) if "contiguous" in impl else chunk_flops(start, n, heads, d)


def paged(k: torch.Tensor, v: torch.Tensor, prefix: int, block_size: int, gen: torch.Generator):
    """The first `prefix` tokens of k/v in a paged cache (shuffled blocks, the rest NaN, one spare
    block): (k_cache, v_cache, block_table [1, blocks])."""
    nb = -(-max(prefix, 1) // block_size)
    perm = torch.randperm(nb + 1, generator=gen).to(k.device)
    shape = (nb + 1, block_size, *k.shape[1:])
    kc = torch.full(shape, float("nan"), dtype=k.dtype, device=k.device)
    vc = kc.clone()
    pos = torch.arange(prefix, device=k.device)
    kc[perm[pos // block_size], pos % block_size] = k[:prefix]
    vc[perm[pos // block_size], pos % block_size] = v[:prefix]
    return kc, vc, perm[:nb].to(torch.int32).unsqueeze(0)


def chunk_impls(q, k, v, start: int, c: int, cache, scale: float) -> dict:
    """Callables running chunk [start, start + c) by each impl, each returning the chunk's output."""
    dev = q.device
    qc, kc, vc = q[start : start + c], k[start : start + c], v[start : start + c]
    cu = torch.tensor([0, c], dtype=torch.int32, device=dev)
    k_cache, v_cache, bt = cache
    prefix = torch.tensor([start], dtype=torch.int32, device=dev)
    paged_kw = dict(k_cache=k_cache, v_cache=v_cache, block_tables=bt, prefix_lens=prefix) if start else {}
    n = start + c
    cu_all = torch.tensor([0, n], dtype=torch.int32, device=dev)
    impls = {}
    # the engine's eager launch: a tile map (models/attention/triton_backend.py prefill_arrays)
    seqs, firsts = tile_map([c], [start], block_m(q.shape[2], c, dev, q.shape[1] // k.shape[1]))
    tiles = torch.from_numpy(seqs).to(dev), torch.from_numpy(firsts).to(dev)
    impls["flashpage_tile_map"] = lambda: flash_prefill(qc, kc, vc, cu, c, scale, tiles=tiles, **paged_kw)
    for suffix, order in (("", None), ("_tiles_fastest", {"order": "tiles_fastest"})):
        impls["flashpage" + suffix] = lambda o=order: flash_prefill(qc, kc, vc, cu, c, scale, _config=o, **paged_kw)
        impls["flashpage_contiguous" + suffix] = \
            lambda o=order: flash_prefill(q[:n], k[:n], v[:n], cu_all, n, scale, _config=o)[start:]
    if start:  # the prefix's blocks copied out first, as the engine's long chunks do (prefix_starts)
        ids = bt[0, : -(-start // k_cache.shape[1])].long()
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        gathered = lambda kg, vg, o=None: flash_prefill(qc, kc, vc, cu, c, scale, k_cache=kg, v_cache=vg,  # noqa: E731
                                                        prefix_lens=prefix, prefix_starts=zero, _config=o)
        impls["flashpage_gathered"] = lambda: gathered(k_cache.index_select(0, ids), v_cache.index_select(0, ids))
        copies = k_cache.index_select(0, ids), v_cache.index_select(0, ids)
        impls["flashpage_gathered_kernel"] = lambda: gathered(*copies)
        impls["flashpage_gathered_tile_map"] = lambda: flash_prefill(
            qc, kc, vc, cu, c, scale, k_cache=k_cache.index_select(0, ids), v_cache=v_cache.index_select(0, ids),
            prefix_lens=prefix, prefix_starts=zero, tiles=tiles)
        for name, opts in GATHERED_OPTIONS.items():
            impls[name] = lambda o=opts: gathered(*copies, o)
    for name in [n for n in impls if n in GATHERED_OPTIONS]:
        try:  # an option the GPU cannot compile (shared memory, registers) loses its row, not the run
            impls[name]()
        except Exception as e:  # noqa: BLE001
            print(f"{name} skipped: {type(e).__name__}: {str(e)[:200]}", flush=True)
            del impls[name]
    for name, opts in PREFIX_OPTIONS.items() if start else ():
        fn = lambda o=opts: flash_prefill(qc, kc, vc, cu, c, scale, _config=o, **paged_kw)  # noqa: E731
        try:  # an option the GPU cannot compile (shared memory, registers) loses its row, not the run
            fn()
        except Exception as e:  # noqa: BLE001
            print(f"{name} skipped: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        impls[name] = fn
    fa3 = vllm_fa3()
    if fa3 is not None:
        seqused = torch.tensor([n], dtype=torch.int32, device=dev)
        # FA3 reads the chunk's own keys from the cache too: write them there first (outside the timing)
        kcache, vcache, table = paged(k, v, n, k_cache.shape[1], torch.Generator().manual_seed(1))
        impls["vllm_fa3"] = lambda: fa3(qc, kcache, vcache, max_seqlen_q=c, cu_seqlens_q=cu, max_seqlen_k=n,
                                        seqused_k=seqused, softmax_scale=scale, causal=True, block_table=table,
                                        fa_version=3)
    return impls


def vllm_fa3():
    """vLLM's FlashAttention-3 varlen entry point, if its site is importable (VLLM_SITE) and on Hopper."""
    site = os.environ.get("VLLM_SITE")
    if not site or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return None
    if site not in sys.path:
        sys.path.append(site)  # after ours: vLLM's pinned packages must not shadow the server's
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # a missing library: say so, time the rest
        print(f"vllm_fa3 skipped: {type(e).__name__}: {e}", flush=True)
        return None
    return flash_attn_varlen_func


def run(prompt: int, chunk: int, shape: dict, dtype: torch.dtype, device: str, timer,
        impls_kept: list[str] | None = None) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    h, kvh, d, bs = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["block_size"]
    q = torch.randn(prompt, h, d, generator=gen).to(device, dtype)
    k = torch.randn(prompt, kvh, d, generator=gen).to(device, dtype)
    v = torch.randn(prompt, kvh, d, generator=gen).to(device, dtype)
    scale, rows = d**-0.5, []
    for start in range(0, prompt, chunk):
        c = min(chunk, prompt - start)
        cache = paged(k, v, start, bs, gen)
        impls = {n: f for n, f in chunk_impls(q, k, v, start, c, cache, scale).items()
                 if impls_kept is None or n in impls_kept}
        if start + c == prompt:  # the last chunk: every impl against the reference before any timing
            # (the first kv head's group of query heads only: the reference's fp32 scores of all 32
            # heads over a 32k prompt's last chunk are 32 GiB, past an H100's free memory)
            g = h // kvh
            cu = torch.tensor([0, c], dtype=torch.int32, device=device)
            ref = prefill_attention_ref(q[start:, :g], k[start:, :1], v[start:, :1], cu, scale,
                                        k_cache=cache[0][:, :, :1], v_cache=cache[1][:, :, :1], block_tables=cache[2],
                                        prefix_lens=torch.tensor([start], dtype=torch.int32, device=device)).float()
            for name, fn in impls.items():
                err = ((fn()[:, :g].float() - ref).norm() / ref.norm()).item()
                if not err < 2e-2:
                    raise SystemExit(f"CHECK FAILED: {name} on the chunk at {start}: relative error {err:.2e}")
        for name, fn in impls.items():
            ms = timer(fn)
            rows.append(dict(impl=name, chunk_start=start, chunk_len=c, ms=ms,
                             tflops=chunk_flops(start, c, h, d) / ms / 1e9,
                             tflops_run=run_flops(name, start, c, h, d) / ms / 1e9))
        print(" ".join(f"{r['impl']} {r['ms']:.2f} ms {r['tflops']:.0f} TFLOP/s" for r in rows[-len(impls):]),
              f"(chunk at {start})", flush=True)
    cu = torch.tensor([0, prompt], dtype=torch.int32, device=device)
    whole = {"flashpage": lambda: flash_prefill(q, k, v, cu, prompt, scale),
             "flashpage_tiles_fastest": lambda: flash_prefill(q, k, v, cu, prompt, scale,
                                                              _config={"order": "tiles_fastest"})}
    if device != "cpu":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                                                        enable_gqa=True)

        whole["sdpa_cudnn"] = cudnn
    for name, fn in whole.items() if impls_kept is None else ():
        ms = timer(fn)
        rows.append(dict(impl=name, chunk_start=0, chunk_len=prompt, ms=ms, whole=True,
                         tflops=chunk_flops(0, prompt, h, d) / ms / 1e9))
    return rows


def report(result: dict) -> str:
    w = result["workload"]
    lines = [f"A {w['prompt']:,}-token prompt in chunks of {w['chunk']:,} (heads {w['heads']}/{w['kv_heads']}, head_dim "
             f"{w['head_dim']}, {w['dtype']}, cache blocks of {w['block_size']}); ms and TFLOP/s of useful causal work "
             "per chunk (run: of the work the call ran, which for the contiguous rows includes the earlier "
             "chunks' queries); the last rows run the whole prompt in one call.", "",
             "| chunk at | impl | ms | TFLOP/s | TFLOP/s run |", "|---:|---|---:|---:|---:|"]
    for r in result["rows"]:
        where = "whole prompt" if r.get("whole") else f"{r['chunk_start']:,}"
        # (computed here, not read: files from before tflops_run was recorded render alike)
        ran = r["tflops"] * run_flops(r["impl"], r["chunk_start"], r["chunk_len"], 1, 1) / chunk_flops(
            r["chunk_start"], r["chunk_len"], 1, 1)
        lines.append(f"| {where} | {r['impl']} | {r['ms']:.2f} | {r['tflops']:.0f} | {ran:.0f} |")
    total = {}
    for r in result["rows"]:
        if not r.get("whole"):
            total[r["impl"]] = total.get(r["impl"], 0.0) + r["ms"]
    lines += ["", "Sum over the chunks: " + ", ".join(f"{k} {v:.1f} ms" for k, v in total.items()) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192, help="the engine's --max-num-batched-tokens")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, any device (a check of this script)")
    ap.add_argument("--impls", nargs="+", default=None, help="time only these chunk rows (and no whole-prompt row)")
    args = ap.parse_args(argv)
    if args.smoke:
        import time

        def timer(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

        device = "cuda" if torch.cuda.is_available() else "cpu"
        rows = run(args.prompt, args.chunk, SMOKE, torch.float16 if device == "cpu" else torch.bfloat16, device, timer,
                   args.impls)
        print(report(dict(workload=dict(prompt=args.prompt, chunk=args.chunk, dtype="smoke", **SMOKE), rows=rows)))
        return
    import triton.testing

    def timer(fn):
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))

    rows = run(args.prompt, args.chunk, SHAPE, torch.bfloat16, "cuda", timer, args.impls)
    result = dict(gpu_run_info("benchmarks.kernels.bench_prefill_chunks", argv),
                  workload=dict(prompt=args.prompt, chunk=args.chunk, dtype="bfloat16", **SHAPE), rows=rows)
    path = write_result(result, args.out_dir, "prefill_chunks")
    print(report(result))
    print("wrote", path)


if __name__ == "__main__":
    main()
