"""Prefill attention benchmark: flashpage's Triton kernel vs torch SDPA backends vs eager, one GPU.

    python -m benchmarks.kernels.bench_prefill [--out-dir benchmarks/results] [--check] [--shapes mha64,mha128,gqa128]
                                       [--sweep 512,1024]

Default run: GPU correctness check against kernels/reference.py (prefix, mixed lengths, bf16,
GQA packing, TMA and pointer paths, odd head_dim, NaN in unowned cache slots), then for each
config a numerical check of ours against SDPA, then timings (triton.testing.do_bench medians, two
interleaved rounds per impl, the lower kept; do_bench clears L2 before every call and q+k+v+o are
>= 100 MB anyway), the copy-bandwidth and fp16-matmul ceilings, and prefill_<gpu>.json +
prefill_<gpu>.png (roofline) under --out-dir. --check: only the check. --sweep N,N: instead time
every candidate kernel config (used to fill flash_prefill's tables) beside sdpa_cudnn and
sdpa_flash into sweep_prefill_<gpu>.json.

Shapes (causal, B*N = 16384 tokens, N = 512..16384): "mha64" / "mha128": fp16, 12 heads, head_dim
64 (GPT-2) and 128, plus one packed batch of 16 mixed lengths each (ours: one varlen launch; peers:
one call per sequence ("looped") and, for the SDPA backends, right-padded to the longest
("padded", wasted work counted as zero)); "gqa128": bf16, 32 query / 8 KV heads, head_dim 128
(Llama-3-8B's attention), SDPA with enable_gqa=True (a backend that refuses it gets K/V expanded
to 32 heads outside the timed region; its rows say gqa="expanded"). TFLOP/s = 2*B*H*N^2*D / time
(H = query heads) for every impl (the causal count), so eager, which computes the full square,
gets no credit for its wasted half.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import torch
import torch.nn.functional as F

from kernels.flash_prefill import _tma_ok, flash_prefill  # noqa: E402
from kernels.prefill_config import PrefillConfig, _pick_config  # noqa: E402
from kernels.reference import prefill_attention_ref  # noqa: E402
from models.attention import make_backend  # noqa: E402

TOKENS = 16384
SEQ_LENS = [512, 1024, 2048, 4096, 8192, 16384]
# name -> (query heads, kv heads, head_dim, dtype)
SHAPES = {"mha64": (12, 12, 64, torch.float16), "mha128": (12, 12, 128, torch.float16),
          "gqa128": (32, 8, 128, torch.bfloat16)}
HEADS, HEAD_DIMS = 12, [64, 128]  # the MHA shapes (older result files hold only these)
MIXED = [4096, 3000, 2048, 1800, 1200, 1024, 900, 640, 500, 400, 300, 200, 130, 77, 40, 29]
PEERS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_mem_efficient": "EFFICIENT_ATTENTION"}
IMPLS = ["flashpage", *PEERS, "eager"]
GQA_IMPLS = ["flashpage", *PEERS]  # eager's N^2 scores for 32 heads would not fit at 16k
# Candidate PrefillConfigs (BLOCK_M rows, BLOCK_N, num_warps, num_stages, pack, tma, maxnreg, diag) per
# shape, around flash_prefill's picks (results: benchmarks/results/experiments/sweep_prefill_gqa_h100.json).
# Earlier sweeps (sweep_prefill_h100.json) also had pointer tiles (128,64,4,*), (128,128,8,*),
# (256,64,8,*), (64,32,4,*); the GQA sweep 2-stage TMA tiles without a register cap and 64-row
# packed tiles: all slower. Triton 3.6's Hopper warp specialization (tl.range(warp_specialize=True),
# Q/K/V descriptors, one loop) compiled but hung at run time, so it is not a candidate. Configs
# that do not apply to a shape (pack > group) are skipped. GQA: the 128x64 and 128x128 TMA tiles
# with the diagonal in 32-key tiles (diag=1) too; a third key loop (one loop masking every tile)
# was slower than both at 1k-16k (run c) and is gone.
_T, _R = (1, True), (1, True, 128)
SWEEP = {"mha64": [(64, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3, *_T), (128, 64, 8, 3, *_T), (128, 64, 8, 4, *_T),
                   (128, 64, 8, 3, *_R)],
         "mha128": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 3, *_T), (128, 128, 8, 3, *_T),
                    (128, 32, 8, 3, *_R), (128, 64, 8, 2, *_R)],
         "gqa128": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 3, 4), (128, 64, 8, 3, 4, True),
                    (128, 128, 8, 3, 4, True), (128, 128, 8, 3, *_T), (128, 32, 8, 3, 4, True, 128),
                    (128, 64, 8, 2, 4, True, 128), (128, 64, 8, 2, 4, True, 128, 1),
                    (128, 128, 8, 3, 4, True, None, 1)]}
DEV = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: dry-run of the script


def gpu_slug(device_name: str) -> str:
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name.upper().replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", device_name.lower())).lower()


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def causal_flops(lens: list[int], heads: int, d: int) -> float:
    return sum(2.0 * heads * n * n * d for n in lens)


# ---------------------------------------------------------------- correctness on the GPU
def _check_case(lens, prefix, heads, kv_heads, d, dtype, block_size, seed, cfg=None) -> float:
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = DEV
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
    total = sum(lens)
    q, k, v = rnd(total, heads, d), rnd(total, kv_heads, d), rnd(total, kv_heads, d)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    cache = {}
    if prefix is not None:
        need = [(p + block_size - 1) // block_size for p in prefix]
        nblocks = sum(need) + 2
        kc = torch.full((nblocks, block_size, kv_heads, d), float("nan"), dtype=dtype, device=dev)
        vc = kc.clone()
        perm = torch.randperm(nblocks, generator=g)
        bt = torch.full((len(lens), max(need) + 1), int(perm[-1]), dtype=torch.int32)  # -> NaN block
        used = 0
        for s, (p, nb) in enumerate(zip(prefix, need)):
            bt[s, :nb] = perm[used : used + nb]
            used += nb
            for i in range(nb):
                n = min(block_size, p - i * block_size)
                kc[int(bt[s, i]), :n] = rnd(n, kv_heads, d)
                vc[int(bt[s, i]), :n] = rnd(n, kv_heads, d)
        cache = dict(k_cache=kc, v_cache=vc, block_tables=bt.to(dev),
                     prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev))
    out = torch.full_like(q, float("nan"))
    flash_prefill(q, k, v, cu, max(lens), d**-0.5, out=out, _config=cfg, **cache)
    ref = prefill_attention_ref(q, k, v, cu, d**-0.5, **cache)
    err = rel_err(out, ref)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    if torch.isnan(out).any() or not err < tol:
        raise SystemExit(f"GPU CHECK FAILED lens={lens} prefix={prefix} h={heads}/{kv_heads} d={d} {dtype} cfg={cfg}: "
                         f"err={err:.2e} nan={bool(torch.isnan(out).any())}")
    return err


def gpu_check() -> None:
    cases = [  # lens, prefix, heads, kv_heads, d, dtype, block_size
        ([1, 2, 63, 64, 65, 1000, 129], None, 12, 12, 64, torch.float16, 16),
        ([1, 70, 33, 1, 300], [37, 32, 0, 1000, 5], 12, 12, 64, torch.float16, 16),
        ([1, 70, 33, 1, 300], [37, 32, 0, 1000, 5], 8, 2, 128, torch.bfloat16, 8),
        ([5, 257, 1], [300, 0, 513], 4, 1, 80, torch.bfloat16, 256),
        ([130, 64, 3], [17, 64, 200], 4, 4, 96, torch.float16, 64),
        ([4096], [1000], 12, 12, 64, torch.float16, 16),
        ([2048, 1], None, 16, 16, 128, torch.bfloat16, 16),
        ([700, 3], [90, 0], 2, 1, 256, torch.bfloat16, 32),
        ([1500, 64], [0, 129], 4, 2, 40, torch.float16, 128),
        ([3000, 1, 77, 1200], None, 32, 8, 128, torch.bfloat16, 16),
        ([1, 17, 300], [4000, 0, 33], 32, 8, 128, torch.bfloat16, 16),
        ([5, 900, 64], [64, 3, 0], 16, 2, 64, torch.float16, 32),
        ([2100, 2], None, 8, 1, 64, torch.bfloat16, 16),
    ]
    for i, c in enumerate(cases):
        err = _check_case(*c, seed=1000 + i)
        print(f"check ok  lens={c[0]} prefix={c[1]} h={c[2]}/{c[3]} d={c[4]} {c[5]} bs={c[6]}: rel err {err:.2e}")
    # Every sweep candidate, forced, on a varlen GQA batch with and without a prefix.
    for i, cfg in enumerate(dict.fromkeys(c for cs in SWEEP.values() for c in cs)):
        for prefix in (None, [300, 0, 65, 1]):
            cfg_ = PrefillConfig(*cfg)
            err = _check_case([1, 1000, 130, 2049], prefix, 32, 8, 128, torch.bfloat16, 16, seed=2000 + i, cfg=cfg)
            print(f"check ok  config {tuple(cfg_)} prefix={prefix is not None}: rel err {err:.2e}")


# ---------------------------------------------------------------- implementations
def make_inputs(lens: list[int], shape: tuple, seed: int = 0):
    heads, kv_heads, d, dtype = shape
    g = torch.Generator(device=DEV).manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, heads, d, device=DEV, dtype=dtype, generator=g)
    k, v = (torch.randn(total, kv_heads, d, device=DEV, dtype=dtype, generator=g) for _ in range(2))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    return q, k, v, cu


def _config_of(q, k, v, n) -> list:
    """The PrefillConfig flash_prefill picks for this uniform batch (recorded with each row)."""
    d = q.shape[2]
    return list(_pick_config(max(16, d), n, q.device, q.shape[1] // k.shape[1], _tma_ok(q, k, v, d, max(16, d)), False))


def _bhnd(t: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    """Packed [B*N, H, D] -> [B, H, N, D] view (what a model hands SDPA after its qkv split)."""
    return t.view(batch, n, *t.shape[1:]).transpose(1, 2)


def eager_attention(q, k, v, scale, mask):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def _time_all(cases: list, flops: float, base: dict, rows: list, label: str, rounds: int = 2) -> None:
    """Time every (impl, extra row keys, SDPA backend or None, fn) `rounds` times, interleaved, so a
    transient (clocks settling after a previous heavy kernel, say) cannot land on one impl only;
    each row keeps every round's median and reports the lowest."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    times: dict[int, list] = {i: [] for i in range(len(cases))}
    errors: dict[int, str] = {}
    for _ in range(rounds):
        for i, (impl, _extra, backend, fn) in enumerate(cases):
            if i in errors:
                continue
            try:
                if backend:
                    with sdpa_kernel(getattr(SDPBackend, backend)):
                        times[i].append(bench(fn))
                else:
                    times[i].append(bench(fn))
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # record the miss, keep going
                errors[i] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.empty_cache()
    for i, (impl, extra, _backend, _fn) in enumerate(cases):
        if i in errors:
            row = dict(impl=impl, **base, **extra, ms=None, tflops=None, skipped=errors[i])
        else:
            ms = min(times[i])
            row = dict(impl=impl, **base, **extra, ms=round(ms, 5), tflops=round(flops / ms / 1e9, 2),
                       ms_rounds=[round(t, 5) for t in times[i]])
        rows.append(row)
        print(f"{label} {impl:20s} {extra.get('varlen', ''):7s} {row['ms'] or float('nan'):9.4f} ms "
              f"{row['tflops'] or float('nan'):8.1f} TFLOP/s  rounds {row.get('ms_rounds', '')} "
              f"{row.get('skipped', '')}", flush=True)


def _peer_inputs(qb, kb, vb):
    """{impl: (k, v, gqa)} for each SDPA backend: native GQA (enable_gqa=True) where the backend
    takes it, else K/V expanded to the query heads (built here, outside the timed region)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = qb.shape[1] // kb.shape[1]
    if group == 1:
        return {impl: (kb, vb, None) for impl in PEERS}
    got, expanded = {}, None
    for impl, backend in PEERS.items():
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
            got[impl] = (kb, vb, "native")
        except RuntimeError:
            if expanded is None:
                expanded = tuple(t.repeat_interleave(group, dim=1) for t in (kb, vb))
            got[impl] = (*expanded, "expanded")
    return got


def _sdpa(qb, k, v, gqa, scale):
    kw = dict(enable_gqa=True) if gqa == "native" else {}
    return lambda: F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, **kw)


def _uniform(n: int, shape: tuple):
    """Inputs of one uniform batch of B = TOKENS / n sequences of n tokens, SDPA's views of them,
    and SDPA flash's output (the numerical reference for ours)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads, d, dtype = shape
    batch, scale = TOKENS // n, d**-0.5
    q, k, v, cu = make_inputs([n] * batch, shape)
    qb, kb, vb = (_bhnd(t, batch, n) for t in (q, k, v))
    peers = _peer_inputs(qb, kb, vb)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = _sdpa(qb, *peers["sdpa_flash"], scale)()
    return q, k, v, cu, qb, peers, ref


def time_uniform(n: int, name: str, rows: list) -> None:
    heads, kv_heads, d, dtype = shape = SHAPES[name]
    batch, scale = TOKENS // n, d**-0.5
    q, k, v, cu, qb, peers, ref = _uniform(n, shape)
    out = torch.empty_like(q)
    ours = lambda: flash_prefill(q, k, v, cu, n, scale, out=out)  # noqa: E731
    ours()
    err = rel_err(_bhnd(out, batch, n), ref)
    if not err < (2e-3 if dtype == torch.float16 else 1e-2) or torch.isnan(out).any():
        raise SystemExit(f"flashpage disagrees with sdpa_flash at N={n} {name}: rel err {err:.2e}")
    cases = [("flashpage", dict(config=_config_of(q, k, v, n), max_rel_err_vs_sdpa=round(err, 6)), None, ours)]
    for impl, backend in PEERS.items():
        kx, vx, gqa = peers[impl]
        cases.append((impl, dict(gqa=gqa) if gqa else {}, backend, _sdpa(qb, kx, vx, gqa, scale)))
    if heads == kv_heads:
        mask = torch.ones(n, n, dtype=torch.bool, device=DEV).tril()
        kb, vb = peers["sdpa_flash"][:2]
        cases += [("eager", {}, None, lambda: eager_attention(qb, kb, vb, scale, mask))]
    base = dict(N=n, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=d, causal=True, dtype=str(dtype)[6:])
    _time_all(cases, causal_flops([n] * batch, heads, d), base, rows, f"N={n:6d} B={batch:3d} {name}")


def time_mixed(name: str, rows: list) -> None:
    heads, kv_heads, d, dtype = shape = SHAPES[name]
    lens, scale, nmax = MIXED, d**-0.5, max(MIXED)
    q, k, v, cu = make_inputs(lens, shape, seed=1)
    out = torch.empty_like(q)
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    views = [tuple(_bhnd(t[a:b], 1, b - a) for t in (q, k, v)) for a, b in zip(starts, starts[1:])]
    padded = []
    for t in (q, k, v):
        p = torch.zeros(len(lens), nmax, *t.shape[1:], device=DEV, dtype=t.dtype)
        for i, (a, b) in enumerate(zip(starts, starts[1:])):
            p[i, : b - a] = t[a:b]
        padded.append(p.transpose(1, 2))
    # The engine's launch: a host-built tile map listing each query tile once (no idle programs).
    arrays = make_backend("triton", d, heads // kv_heads).prefill_arrays(lens, [0] * len(lens), q.device)
    tiles = tuple(torch.from_numpy(arrays[name]).to(DEV) for name in ("tile_seq", "tile_start"))
    ours = lambda: flash_prefill(q, k, v, cu, nmax, scale, out=out, tiles=tiles)  # noqa: E731
    ours()
    err = rel_err(out, prefill_attention_ref(q, k, v, cu, scale))
    if not err < 2e-3:
        raise SystemExit(f"flashpage mixed batch wrong: rel err {err:.2e}")
    masks = {n: torch.ones(n, n, dtype=torch.bool, device=DEV).tril() for n in set(lens)}
    sd = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale)  # noqa: E731
    cases = [("flashpage", dict(varlen="packed", config=_config_of(q, k, v, nmax), tile_map=True), None, ours)]
    for impl, backend in PEERS.items():
        cases += [(impl, dict(varlen="looped"), backend, lambda: [sd(*qkv) for qkv in views]),
                  (impl, dict(varlen="padded"), backend, lambda: sd(*padded))]
    cases += [("eager", dict(varlen="looped"), None,
               lambda: [eager_attention(a, b, c, scale, masks[a.shape[2]]) for a, b, c in views])]
    base = dict(N=nmax, batch=len(lens), heads=heads, kv_heads=kv_heads, head_dim=d, causal=True,
                dtype=str(dtype)[6:], lengths=lens)
    _time_all(cases, causal_flops(lens, heads, d), base, rows, f"mixed {name}")


def ceilings(rows: list) -> None:
    src = torch.randn(2**29, device=DEV, dtype=torch.float16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()
    rows.append(dict(impl="copy", bytes=nbytes, ms=round(ms, 5), tb_per_s=round(nbytes / ms / 1e9, 3)))
    del src, dst
    a, b = (torch.randn(8192, 8192, device=DEV, dtype=torch.float16) for _ in range(2))
    ms = bench(lambda: a @ b)
    rows.append(dict(impl="matmul", size=8192, dtype="float16", ms=round(ms, 5), tflops=round(2 * 8192**3 / ms / 1e9, 1)))
    print(f"ceilings: copy {rows[-2]['tb_per_s']} TB/s (read+write), fp16 matmul {rows[-1]['tflops']} TFLOP/s")


def sweep(rows: list, seq_lens: list[int], names: list[str], save) -> None:
    """Every candidate config of each shape at each N, with sdpa_cudnn and sdpa_flash timed in
    the same process (one do_bench median each); save() after each N keeps what a cut-off run got."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name in names:
        heads, kv_heads, d, dtype = shape = SHAPES[name]
        for n in seq_lens:
            batch, scale = TOKENS // n, d**-0.5
            q, k, v, cu, qb, peers, ref = _uniform(n, shape)
            flops = causal_flops([n] * batch, heads, d)
            base = dict(N=n, heads=heads, kv_heads=kv_heads, head_dim=d, dtype=str(dtype)[6:])
            for impl in ("sdpa_cudnn", "sdpa_flash"):
                try:
                    with sdpa_kernel(getattr(SDPBackend, PEERS[impl])):
                        ms = bench(_sdpa(qb, *peers[impl], scale))
                except RuntimeError as e:
                    print(f"sweep {name} N={n} {impl}: {str(e)[:160]}")
                    continue
                rows.append(dict(impl=impl, **base, ms=ms, tflops=flops / ms / 1e9, gqa=peers[impl][2]))
                print(f"sweep {name} N={n:6d} {impl}: {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
            for cfg in SWEEP[name]:
                if heads // kv_heads % PrefillConfig(*cfg).pack:
                    continue
                try:
                    out = flash_prefill(q, k, v, cu, n, scale, _config=cfg)
                    err = rel_err(_bhnd(out, batch, n), ref)
                    ok = err < (2e-3 if dtype == torch.float16 else 1e-2)
                    ms = bench(lambda: flash_prefill(q, k, v, cu, n, scale, out=out, _config=cfg)) if ok else None
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is data
                    err, ms = float("nan"), None
                    print(f"sweep {name} N={n} {cfg}: {type(e).__name__} {str(e)[:160]}")
                tf = flops / ms / 1e9 if ms else None
                rows.append(dict(impl="sweep", **base, config=list(PrefillConfig(*cfg)), ms=ms, tflops=tf, err=err))
                print(f"sweep {name} N={n:6d} cfg={cfg}: {tf or float('nan'):7.1f} TFLOP/s err={err:.1e}", flush=True)
            torch.cuda.empty_cache()
            save()


# ---------------------------------------------------------------- outputs
def _shape_of(r: dict) -> tuple:
    """(heads, kv_heads, head_dim) of a row; rows of older files carry no kv_heads: MHA, 12 heads."""
    return r.get("heads", HEADS), r.get("kv_heads", r.get("heads", HEADS)), r["head_dim"]


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    bw = next(r["tb_per_s"] for r in rows if r["impl"] == "copy") * 1e12
    peak = next(r["tflops"] for r in rows if r["impl"] == "matmul") * 1e12
    fig, ax = plt.subplots(figsize=(10.5, 5.5))
    xs = [2**i for i in range(5, 14)]
    ax.plot(xs, [min(peak, x * bw) / 1e12 for x in xs], "k-", lw=1.5,
            label=f"roofline: copy {bw / 1e12:.2f} TB/s, fp16 matmul {peak / 1e12:.0f} TFLOP/s (measured)")
    colors = dict(zip(IMPLS, ["C3", "C0", "C2", "C1", "C7"]))
    for (h, kvh, d, dt), marker, ls in (((12, 12, 64, "fp16"), "o", "-"), ((12, 12, 128, "fp16"), "s", "--"),
                                        ((32, 8, 128, "bf16"), "^", ":")):
        for impl in IMPLS:
            # Intensity 2HN^2D / (2ND(2H + 2KV)) = N*H / (2(H + KV)): N/4 for MHA, N*32/80 for 32/8 GQA.
            pts = [(r["N"] * h / (2 * (h + kvh)), r["tflops"]) for r in rows if r["impl"] == impl
                   and "head_dim" in r and _shape_of(r) == (h, kvh, d) and r.get("tflops") and "lengths" not in r]
            if pts:
                ax.plot(*zip(*pts), marker=marker, ls=ls, color=colors[impl], ms=5,
                        label=f"{impl} {h}/{kvh} heads d={d} {dt}")
    # Every impl sits at the same intensity: minimal bytes, not what each one moves (eager also
    # writes and rereads the N^2 scores).
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity, FLOP / byte (q,k,v read + o written once)",
           ylabel="TFLOP/s (causal count)", title=f"Causal prefill attention - {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(result: dict) -> str:
    """docs/benchmarks.md markdown for one result file: TFLOP/s per impl per config, ratios, roofline link.
    Called by benchmarks/make_report.py for every benchmarks/results/prefill_*.json."""
    rows, slug = result["rows"], gpu_slug(result["device"])
    tf = {(r["impl"], r["N"], _shape_of(r), r.get("varlen")): r.get("tflops")
          for r in rows if "head_dim" in r and "N" in r}
    fmt = lambda x: f"{x:.0f}" if x else "-"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
    ours = sorted((r for r in rows if r["impl"] == "flashpage" and "lengths" not in r), key=lambda r: r["N"])
    # make_report.py prints the section title and the device/versions/command line above this.
    lines = [
        f"Causal, fp16, {HEADS} heads, B·N = {TOKENS} tokens; TFLOP/s = 2·B·H·N²·D / time, the causal "
        "count for every impl; time = the lower of two interleaved triton `do_bench` medians (L2 cleared "
        "before each call). Ours: one launch over the packed [B·N, H, D] batch; SDPA and eager get "
        "[B, H, N, D] views of the same tensors.",
        "",
        "| N | batch | head_dim | " + " | ".join(IMPLS) + " | ours / sdpa_flash | ours / sdpa_cudnn | ours / eager |",
        "|---:|---:|---:|" + "---:|" * (len(IMPLS) + 3),
    ]
    for d in HEAD_DIMS:
        for r in (r for r in ours if _shape_of(r) == (HEADS, HEADS, d)):
            vals = [tf.get((i, r["N"], _shape_of(r), None)) for i in IMPLS]
            lines.append(f"| {r['N']} | {r['batch']} | {d} | " + " | ".join(fmt(x) for x in vals)
                         + f" | {ratio(vals[0], vals[1])} | {ratio(vals[0], vals[2])} | {ratio(vals[0], vals[-1])} |")
    gqa = [r for r in ours if _shape_of(r)[0] != _shape_of(r)[1]]
    if gqa:
        h, kvh, d = _shape_of(gqa[0])
        expanded = sorted({r["impl"] for r in rows if r.get("gqa") == "expanded"})
        lines += ["", f"Grouped-query attention: causal, {gqa[0]['dtype']}, {h} query / {kvh} KV heads, head_dim {d}, "
                  f"B·N = {TOKENS} tokens, TFLOP/s counted over the query heads; SDPA with `enable_gqa=True`"
                  + (f" ({', '.join(expanded)}: refused it, timed on K/V expanded to {h} heads)" if expanded else "")
                  + ".", "",
                  "| N | batch | " + " | ".join(GQA_IMPLS) + " | ours / sdpa_flash | ours / sdpa_cudnn |",
                  "|---:|---:|" + "---:|" * (len(GQA_IMPLS) + 2)]
        for r in gqa:
            vals = [tf.get((i, r["N"], _shape_of(r), None)) for i in GQA_IMPLS]
            lines.append(f"| {r['N']} | {r['batch']} | " + " | ".join(fmt(x) for x in vals)
                         + f" | {ratio(vals[0], vals[1])} | {ratio(vals[0], vals[2])} |")
    skipped = [r for r in rows if r.get("skipped")]
    if skipped:
        lines += [""] + [f"- {r['impl']} N={r['N']} heads {'/'.join(map(str, _shape_of(r)[:2]))} d={r['head_dim']} "
                         f"{r.get('varlen', '')}: not measured ({r['skipped'][:120]})" for r in skipped]
    mixed = [r for r in rows if r["impl"] == "flashpage" and "lengths" in r]
    if mixed:
        lines += ["", f"Mixed lengths, one packed batch of {len(mixed[0]['lengths'])} sequences "
                  f"({min(mixed[0]['lengths'])}..{max(mixed[0]['lengths'])} tokens, {sum(mixed[0]['lengths'])} total). "
                  "Ours: one varlen launch over a host-built tile map (what the engine launches); peers: one call "
                  "per sequence (looped) or right-padded to the longest (padded); TFLOP/s counts only the useful "
                  "causal work.", "",
                  "| head_dim | impl | looped | padded | packed |", "|---:|---|---:|---:|---:|"]
        for r in mixed:
            for i in IMPLS:
                vals = [tf.get((i, r["N"], _shape_of(r), m)) for m in ("looped", "padded", "packed")]
                if any(vals):
                    lines.append(f"| {r['head_dim']} | {i} | " + " | ".join(fmt(x) for x in vals) + " |")
    cp = [r for r in rows if r["impl"] == "copy"]
    mm = [r for r in rows if r["impl"] == "matmul"]
    if cp and mm:
        lines += ["", f"Measured ceilings: device copy {cp[0]['tb_per_s']:.2f} TB/s (read + write), "
                  f"fp16 8192³ matmul {mm[0]['tflops']:.0f} TFLOP/s."]
    lines += ["", f"![prefill roofline](benchmarks/results/prefill_{slug}.png)", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--check", action="store_true", help="only the GPU correctness check")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--sweep", default="", metavar="N,N,..",
                    help="instead time every candidate kernel config at these N (to sweep_prefill_<gpu>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import triton

    names = args.shapes.split(",")
    if not args.sweep:  # a sweep checks each config against SDPA itself
        gpu_check()
    if args.check:
        return
    name = torch.cuda.get_device_name()
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"prefill_{gpu_slug(name)}")
    meta = dict(device=name, torch=torch.__version__.split("+")[0], triton=triton.__version__,
                date=datetime.date.today().isoformat(), command="python -m benchmarks.kernels.bench_prefill " + " ".join(sys.argv[1:]))
    if args.sweep:
        sweep_rows: list = []

        def save() -> None:  # not prefill_*.json: make_report.py renders every such file with report()
            with open(os.path.join(args.out_dir, f"sweep_prefill_{gpu_slug(name)}.json"), "w") as f:
                json.dump(dict(meta, rows=sweep_rows), f, indent=1)

        sweep(sweep_rows, [int(x) for x in args.sweep.split(",")], names, save)
        return
    rows: list = []
    for shape in names:
        for n in SEQ_LENS:
            time_uniform(n, shape, rows)
        if SHAPES[shape][0] == SHAPES[shape][1]:
            time_mixed(shape, rows)
    # Ceilings last: in one run the first kernel timed right after them came out ~30% slower than
    # the same kernel timed earlier in the run (cause not pinned down; clocks suspected).
    ceilings(rows)
    result = dict(meta, rows=rows)
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, base + ".png")
    print(report(result))


if __name__ == "__main__":
    main()
