"""What the paged-decode benchmark (benchmarks/kernels/bench_decode.py) reports, none of it needing a GPU:
the head geometry of the MHA rows, the docs/benchmarks.md section for a decode_<gpu>.json (`report`, which
make_report.py reaches as `benchmarks.kernels.bench_decode.report`) and its bandwidth plot.

Rows carry heads, kv_heads and head_dim; a row without kv_heads (older files) is MHA. The MHA rows
(GPT-2 geometry) and the GQA rows (Llama family) get a table each.
"""

from __future__ import annotations

import re

HEADS, HEAD_DIM, BLOCK_SIZE = 12, 64, 16
GQA_HEAD_DIMS = (128, 64)  # the Llama family's head sizes, timed and checked at GQA shapes
IMPLS = ("flashpage", "sdpa_flash_contiguous", "eager_paged")
GQA_TARGET, GQA_TARGET_BYTES = 0.85, 256e6  # issue 18: >= 85% of copy bandwidth wherever K/V >= 256 MB


def gpu_slug(device_name: str) -> str:
    m = re.search(r"(GH200|H200|H100|H20|B200|A100|A10G|L40S|L4)", device_name, re.I)
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def _is_gqa(r: dict) -> bool:
    return r.get("kv_heads", r.get("heads")) != r.get("heads")


def _cells(rows: list[dict], gqa: bool) -> dict[tuple, dict[str, dict]]:
    """(geometry..., batch, context) -> impl -> row, for the MHA or the GQA rows."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["impl"] != "copy" and _is_gqa(r) == gqa:
            key = (-r["head_dim"], -r["heads"], r["batch"], r["context"]) if gqa else (r["batch"], r["context"])
            cells.setdefault(key, {})[r["impl"]] = r
    return cells


def _gqa_section(rows: list[dict], copy: dict) -> list[str]:
    cells = _cells(rows, gqa=True)
    if not cells:
        return []
    big = [c["flashpage"]["tbps"] / copy["tbps"] for c in cells.values()
           if "flashpage" in c and c["flashpage"]["kv_bytes"] >= GQA_TARGET_BYTES]
    met = sum(p >= GQA_TARGET for p in big)
    zero = [c["flashpage"]["kv_bytes"] / c["flashpage"]["ms_zero_flush"] / 1e9 / copy["tbps"] for c in cells.values()
            if "ms_zero_flush" in c.get("flashpage", {}) and c["flashpage"]["kv_bytes"] >= GQA_TARGET_BYTES]
    first = next(iter(cells.values()))["flashpage"]
    out = [
        "",
        f"#### GQA shapes ({first.get('dtype', 'bf16')}, Llama family)",
        "",
        "One program per (sequence, kv head, split) reads each K/V tile once for all the query heads "
        "of its group (tensor cores). "
        f"Where K/V >= {GQA_TARGET_BYTES / 1e6:.0f} MB, {met} of {len(big)} shapes reach "
        f"{100 * GQA_TARGET:.0f}% of copy bandwidth"
        + (f" (lowest {100 * min(big):.0f}%)." if big else ".")
        + (f" Timed after do_bench's own zero-fill flush they measure {100 * min(zero):.0f}-{100 * max(zero):.0f}%: "
           "see the note above the MHA table." if zero else ""),
        "",
        "| heads / kv | head_dim | batch | context | KV MB | flashpage µs | flashpage TB/s | % of copy BW "
        "| sdpa_flash TB/s | eager_paged TB/s | vs sdpa | vs eager |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells.values():
        ours = c.get("flashpage")
        if ours is None:
            continue
        sdpa, eager = c.get("sdpa_flash_contiguous"), c.get("eager_paged")
        tb = lambda r: f"{r['tbps']:.2f}" if r else "—"  # noqa: E731
        vs = lambda r: f"{r['ms'] / ours['ms']:.2f}x" if r else "—"  # noqa: E731
        out.append(f"| {ours['heads']} / {ours['kv_heads']} | {ours['head_dim']} | {ours['batch']} | {ours['context']} "
                   f"| {ours['kv_bytes'] / 1e6:.1f} | {ours['ms'] * 1e3:.1f} | {ours['tbps']:.2f} "
                   f"| {100 * ours['tbps'] / copy['tbps']:.0f}% | {tb(sdpa)} | {tb(eager)} | {vs(sdpa)} | {vs(eager)} |")
    return out


def report(result: dict) -> str:
    """docs/benchmarks.md section for one result file (tables + plot link)."""
    rows = result["rows"]
    copy = next(r for r in rows if r["impl"] == "copy")
    cells = _cells(rows, gqa=False)
    impls = [i for i in IMPLS if any(i in c for c in cells.values())]
    slug = gpu_slug(result["device"])
    out = [
        f"### Paged decode on {result['device']}",
        "",
        f"One query token per sequence, {HEADS} heads x {HEAD_DIM}, block size {BLOCK_SIZE}, fp16, "
        "scattered block tables. TB/s = K/V bytes that must be read / median time "
        f"(torch {result['torch']}, triton {result['triton']}, {result['date']}). "
        f"Copy bandwidth (device-to-device, read + write): **{copy['tbps']:.2f} TB/s**."
        + (" L2 is evicted before every timed call by reading a 256 MB buffer, for every impl and the copy "
           "alike: do_bench's default zero-fills it, and the dirty zeros it leaves in L2 are written back "
           "while the next kernel streams its K/V. That cost each timed kernel of 128 MB or more of K/V "
           "~10 us (ms_zero_flush in the JSON), a tenth of a 268 MB decode." if copy.get("flush") == "read" else ""),
        "",
        "| batch | context | KV MB | " + " | ".join(f"{i} TB/s" for i in impls)
        + " | flashpage % of copy BW | flashpage / sdpa |",
        "|---:|---:|---:|" + "---:|" * len(impls) + "---:|---:|",
    ]
    for (b, n), c in sorted(cells.items()):
        kv_mb = next(iter(c.values()))["kv_bytes"] / 1e6
        vals = [f"{c[i]['tbps']:.2f}" if i in c and "tbps" in c[i] else "—" for i in impls]
        ours, sdpa = c.get("flashpage"), c.get("sdpa_flash_contiguous")
        pct = f"{100 * ours['tbps'] / copy['tbps']:.0f}%" if ours else "—"
        ratio = f"{sdpa['ms'] / ours['ms']:.2f}x" if ours and sdpa else "—"
        out.append(f"| {b} | {n} | {kv_mb:.1f} | " + " | ".join(vals) + f" | {pct} | {ratio} |")
    out += _gqa_section(rows, copy)
    out += ["", f"![paged decode bandwidth](benchmarks/results/decode_{slug}.png)", ""]
    return "\n".join(out)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    copy = next(r for r in rows if r["impl"] == "copy")
    gqa = [r for r in rows if r["impl"] == "flashpage" and _is_gqa(r)]
    fig, axes = plt.subplots(1, 2 if gqa else 1, figsize=(15 if gqa else 8, 5), squeeze=False)
    ax = axes[0][0]
    for impl, marker in zip(IMPLS, "osd"):
        pts = sorted((r["kv_bytes"], r["batch"], r["tbps"]) for r in rows
                     if r["impl"] == impl and "tbps" in r and not _is_gqa(r))
        if pts:
            ax.plot([p[0] / 1e6 for p in pts], [p[2] for p in pts], marker=marker, label=impl, alpha=0.85)
    ax.set_title(f"MHA {HEADS}x{HEAD_DIM} heads, fp16")
    if gqa:  # one series per head geometry; several (batch, context) share a size, hence points
        ax = axes[0][1]
        for geo, marker in zip(sorted({(r["heads"], r["kv_heads"], r["head_dim"]) for r in gqa}, reverse=True), "os^v"):
            pts = sorted((r["kv_bytes"], r["tbps"]) for r in gqa if (r["heads"], r["kv_heads"], r["head_dim"]) == geo)
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], marker=marker, ls="none", alpha=0.85,
                    label=f"flashpage {geo[0]}/{geo[1]} heads, d {geo[2]}")
        ax.axhline(GQA_TARGET * copy["tbps"], color="g", ls=":", lw=1, label=f"{100 * GQA_TARGET:.0f}% of copy BW")
        ax.axvline(GQA_TARGET_BYTES / 1e6, color="g", ls=":", lw=0.8)
        ax.set_title(f"GQA, {gqa[0].get('dtype', 'bf16')}")
        ax.set_ylim(bottom=0)
    for ax in axes[0]:
        ax.axhline(copy["tbps"], color="k", ls="--", lw=1, label=f"copy BW {copy['tbps']:.2f} TB/s")
        ax.set_xscale("log")
        ax.set_xlabel("K/V bytes read per step (MB, log)")
        ax.set_ylabel("achieved TB/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Paged decode — {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
