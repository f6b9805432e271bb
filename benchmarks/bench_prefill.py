"""Prefill attention benchmark: flashpage's Triton kernel vs torch SDPA backends vs eager, one GPU.

    python benchmarks/bench_prefill.py [--out-dir benchmarks/results] [--check] [--sweep 512,1024]

Default run: GPU correctness check against kernels/reference.py (prefix, mixed lengths, bf16,
GQA, odd head_dim, NaN in unowned cache slots), then for each config a numerical check of ours
against SDPA, then timings (triton.testing.do_bench medians, two interleaved rounds per impl, the
lower kept; do_bench clears L2 before every call and q+k+v+o are >= 100 MB anyway), the
copy-bandwidth and fp16-matmul ceilings, and prefill_<gpu>.json + prefill_<gpu>.png (roofline)
under --out-dir. --check: only the check. --sweep N,N: also time every candidate kernel config
(used to fill flash_prefill._GPU_CONFIGS) into sweep_prefill_<gpu>.json.

Configs: causal fp16, 12 heads, head_dim 64 (GPT-2) and 128, B*N = 16384 tokens, N = 512..16384,
plus one packed batch of 16 mixed lengths (ours: one varlen launch; peers: one call per sequence
("looped") and, for the SDPA backends, right-padded to the longest ("padded", wasted work counted
as zero)). TFLOP/s = 2*B*H*N^2*D / time for every impl (the causal count), so eager, which
computes the full square, gets no credit for its wasted half.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.flash_prefill import _pick_config, flash_prefill  # noqa: E402
from kernels.reference import prefill_attention_ref  # noqa: E402

HEADS = 12
TOKENS = 16384
SEQ_LENS = [512, 1024, 2048, 4096, 8192, 16384]
HEAD_DIMS = [64, 128]
MIXED = [4096, 3000, 2048, 1800, 1200, 1024, 900, 640, 500, 400, 300, 200, 130, 77, 40, 29]
PEERS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_mem_efficient": "EFFICIENT_ATTENTION"}
IMPLS = ["flashpage", *PEERS, "eager"]
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head_dim. Run 1 (N = 1024, 4096, 16384) also had
# (128,64,4,2|3|4), (128,128,8,2|3), (128,32,4,3), (256,64,8,3) for d=64 and (128,64,8,2|4),
# (128,128,8,2|3), (256,64,8,2), (64,64,4,2) for d=128: all slower than the table's picks.
# 4-warp BLOCK_M=128 with BLOCK_N=128 (d=64) or with d=128 spills registers (cuobjdump -res-usage).
SWEEP = {
    64: [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4), (64, 64, 8, 3),
         (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3)],
    128: [(64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (64, 64, 8, 3), (128, 64, 8, 3), (128, 32, 8, 3),
          (128, 128, 8, 3)],
}
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
def _check_case(lens, prefix, heads, kv_heads, d, dtype, block_size, seed) -> float:
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
    flash_prefill(q, k, v, cu, max(lens), d**-0.5, out=out, **cache)
    ref = prefill_attention_ref(q, k, v, cu, d**-0.5, **cache)
    err = rel_err(out, ref)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    if torch.isnan(out).any() or not err < tol:
        raise SystemExit(f"GPU CHECK FAILED lens={lens} prefix={prefix} d={d} {dtype}: err={err:.2e} "
                         f"nan={bool(torch.isnan(out).any())}")
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
    ]
    for i, c in enumerate(cases):
        err = _check_case(*c, seed=1000 + i)
        print(f"check ok  lens={c[0]} prefix={c[1]} h={c[2]}/{c[3]} d={c[4]} {c[5]} bs={c[6]}: rel err {err:.2e}")


# ---------------------------------------------------------------- implementations
def make_inputs(lens: list[int], d: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    total = sum(lens)
    q, k, v = (torch.randn(total, HEADS, d, device=DEV, dtype=torch.float16, generator=g) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    return q, k, v, cu


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


def time_uniform(n: int, d: int, rows: list) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, scale = TOKENS // n, d**-0.5
    q, k, v, cu = make_inputs([n] * batch, d)
    out = torch.empty_like(q)
    qb, kb, vb = (_bhnd(t, batch, n) for t in (q, k, v))
    ours = lambda: flash_prefill(q, k, v, cu, n, scale, out=out)  # noqa: E731
    ours()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    err = rel_err(_bhnd(out, batch, n), ref)
    if not err < 2e-3 or torch.isnan(out).any():
        raise SystemExit(f"flashpage disagrees with sdpa_flash at N={n} d={d}: rel err {err:.2e}")
    sdpa = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)  # noqa: E731
    mask = torch.ones(n, n, dtype=torch.bool, device=DEV).tril()
    cases = [("flashpage", dict(config=list(_pick_config(d, n, q.device)), max_rel_err_vs_sdpa=round(err, 6)),
              None, ours)]
    cases += [(impl, {}, backend, sdpa) for impl, backend in PEERS.items()]
    cases += [("eager", {}, None, lambda: eager_attention(qb, kb, vb, scale, mask))]
    base = dict(N=n, batch=batch, heads=HEADS, head_dim=d, causal=True, dtype="float16")
    _time_all(cases, causal_flops([n] * batch, HEADS, d), base, rows, f"N={n:6d} B={batch:3d} d={d:3d}")


def time_mixed(d: int, rows: list) -> None:
    lens, scale, nmax = MIXED, d**-0.5, max(MIXED)
    q, k, v, cu = make_inputs(lens, d, seed=1)
    out = torch.empty_like(q)
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    views = [tuple(_bhnd(t[a:b], 1, b - a) for t in (q, k, v)) for a, b in zip(starts, starts[1:])]
    padded = []
    for t in (q, k, v):
        p = torch.zeros(len(lens), nmax, HEADS, d, device=DEV, dtype=t.dtype)
        for i, (a, b) in enumerate(zip(starts, starts[1:])):
            p[i, : b - a] = t[a:b]
        padded.append(p.transpose(1, 2))
    ours = lambda: flash_prefill(q, k, v, cu, nmax, scale, out=out)  # noqa: E731
    ours()
    err = rel_err(out, prefill_attention_ref(q, k, v, cu, scale))
    if not err < 2e-3:
        raise SystemExit(f"flashpage mixed batch wrong: rel err {err:.2e}")
    masks = {n: torch.ones(n, n, dtype=torch.bool, device=DEV).tril() for n in set(lens)}
    sd = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale)  # noqa: E731
    cases = [("flashpage", dict(varlen="packed", config=list(_pick_config(d, nmax, q.device))), None, ours)]
    for impl, backend in PEERS.items():
        cases += [(impl, dict(varlen="looped"), backend, lambda: [sd(*qkv) for qkv in views]),
                  (impl, dict(varlen="padded"), backend, lambda: sd(*padded))]
    cases += [("eager", dict(varlen="looped"), None,
               lambda: [eager_attention(a, b, c, scale, masks[a.shape[2]]) for a, b, c in views])]
    base = dict(N=nmax, batch=len(lens), heads=HEADS, head_dim=d, causal=True, dtype="float16", lengths=lens)
    _time_all(cases, causal_flops(lens, HEADS, d), base, rows, f"mixed d={d:3d}")


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


def sweep(rows: list, seq_lens: list[int]) -> None:
    for d in HEAD_DIMS:
        for n in seq_lens:
            batch = TOKENS // n
            q, k, v, cu = make_inputs([n] * batch, d)
            qb, kb, vb = (_bhnd(t, batch, n) for t in (q, k, v))
            ref = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=d**-0.5)
            flops = causal_flops([n] * batch, HEADS, d)
            for cfg in SWEEP[d]:
                try:
                    out = flash_prefill(q, k, v, cu, n, d**-0.5, _config=cfg)
                    err = rel_err(_bhnd(out, batch, n), ref)
                    ms = bench(lambda: flash_prefill(q, k, v, cu, n, d**-0.5, out=out, _config=cfg)) if err < 2e-3 else None
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is data
                    err, ms = float("nan"), None
                    print(f"sweep d={d} N={n} {cfg}: {type(e).__name__} {str(e)[:120]}")
                tf = flops / ms / 1e9 if ms else None
                rows.append(dict(impl="sweep", N=n, head_dim=d, config=list(cfg), ms=ms, tflops=tf, err=err))
                print(f"sweep d={d:3d} N={n:6d} cfg={cfg}: {tf or float('nan'):7.1f} TFLOP/s err={err:.1e}", flush=True)


# ---------------------------------------------------------------- outputs
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
    for impl in IMPLS:
        for d, marker in ((64, "o"), (128, "s")):
            pts = [(r["N"] / 4, r["tflops"]) for r in rows if r["impl"] == impl and r.get("head_dim") == d
                   and r.get("tflops") and "lengths" not in r]  # intensity 2HN^2D / (8NHD) = N/4
            if pts:
                ax.plot(*zip(*pts), marker=marker, ls="-" if d == 64 else "--", color=colors[impl],
                        label=f"{impl} d={d}", ms=5)
    # Every impl sits at the same intensity: minimal bytes, not what each one moves (eager also
    # writes and rereads the N^2 scores).
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity, FLOP / byte (q,k,v read + o written; = N/4)",
           ylabel="TFLOP/s (causal count)", title=f"Causal prefill attention, fp16, 12 heads - {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(result: dict) -> str:
    """README markdown for one result file: TFLOP/s per impl per config, ratios, roofline link.
    Called by benchmarks/make_report.py for every benchmarks/results/prefill_*.json."""
    rows, slug = result["rows"], gpu_slug(result["device"])
    tf = {(r["impl"], r["N"], r["head_dim"], r.get("varlen")): r.get("tflops") for r in rows if "head_dim" in r and "N" in r}
    fmt = lambda x: f"{x:.0f}" if x else "-"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
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
        for r in sorted((r for r in rows if r["impl"] == "flashpage" and r["head_dim"] == d and "lengths" not in r),
                        key=lambda r: r["N"]):
            vals = [tf.get((i, r["N"], d, None)) for i in IMPLS]
            lines.append(f"| {r['N']} | {r['batch']} | {d} | " + " | ".join(fmt(x) for x in vals)
                         + f" | {ratio(vals[0], vals[1])} | {ratio(vals[0], vals[2])} | {ratio(vals[0], vals[-1])} |")
    skipped = [r for r in rows if r.get("skipped")]
    if skipped:
        lines += [""] + [f"- {r['impl']} N={r['N']} d={r['head_dim']} {r.get('varlen', '')}: not measured "
                         f"({r['skipped'][:120]})" for r in skipped]
    mixed = [r for r in rows if r["impl"] == "flashpage" and "lengths" in r]
    if mixed:
        lines += ["", f"Mixed lengths, one packed batch of {len(mixed[0]['lengths'])} sequences "
                  f"({min(mixed[0]['lengths'])}..{max(mixed[0]['lengths'])} tokens, {sum(mixed[0]['lengths'])} total). "
                  "Ours: one varlen launch; peers: one call per sequence (looped) or right-padded to the longest "
                  "(padded); TFLOP/s counts only the useful causal work.", "",
                  "| head_dim | impl | looped | padded | packed |", "|---:|---|---:|---:|---:|"]
        for r in mixed:
            d = r["head_dim"]
            for i in IMPLS:
                vals = [tf.get((i, r["N"], d, m)) for m in ("looped", "padded", "packed")]
                if any(vals):
                    lines.append(f"| {d} | {i} | " + " | ".join(fmt(x) for x in vals) + " |")
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
    ap.add_argument("--sweep", default="", metavar="N,N,..",
                    help="also time every candidate kernel config at these N (to sweep_prefill_<gpu>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import triton

    gpu_check()
    if args.check:
        return
    name = torch.cuda.get_device_name()
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"prefill_{gpu_slug(name)}")
    meta = dict(device=name, torch=torch.__version__.split("+")[0], triton=triton.__version__,
                date=datetime.date.today().isoformat(), command="python " + " ".join(sys.argv))
    if args.sweep:
        sweep_rows: list = []
        sweep(sweep_rows, [int(x) for x in args.sweep.split(",")])
        # Not prefill_*.json: make_report.py renders every such file with report().
        with open(os.path.join(args.out_dir, f"sweep_prefill_{gpu_slug(name)}.json"), "w") as f:
            json.dump(dict(meta, rows=sweep_rows), f, indent=1)
    rows: list = []
    for d in HEAD_DIMS:
        for n in SEQ_LENS:
            time_uniform(n, d, rows)
        time_mixed(d, rows)
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
