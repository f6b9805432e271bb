"""What the paged-decode benchmark (benchmarks/bench_decode.py) reports, none of it needing a GPU:
the head geometry every measured shape shares, the README section for a decode_<gpu>.json
(`report`, which make_report.py reaches as `benchmarks.bench_decode.report`) and its bandwidth plot.
"""

from __future__ import annotations

import re

HEADS, HEAD_DIM, BLOCK_SIZE = 12, 64, 16
IMPLS = ("flashpage", "sdpa_flash_contiguous", "eager_paged")


def gpu_slug(device_name: str) -> str:
    m = re.search(r"(GH200|H200|H100|H20|B200|A100|A10G|L40S|L4)", device_name, re.I)
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def report(result: dict) -> str:
    """README markdown section for one result file (table + plot link)."""
    rows = result["rows"]
    copy = next(r for r in rows if r["impl"] == "copy")
    cells: dict[tuple[int, int], dict[str, dict]] = {}
    for r in rows:
        if r["impl"] != "copy":
            cells.setdefault((r["batch"], r["context"]), {})[r["impl"]] = r
    impls = [i for i in IMPLS if any(i in c for c in cells.values())]
    slug = gpu_slug(result["device"])
    out = [
        f"### Paged decode on {result['device']}",
        "",
        f"One query token per sequence, {HEADS} heads x {HEAD_DIM}, block size {BLOCK_SIZE}, fp16, "
        "scattered block tables. TB/s = K/V bytes that must be read / median time "
        f"(torch {result['torch']}, triton {result['triton']}, {result['date']}). "
        f"Copy bandwidth (device-to-device, read + write): **{copy['tbps']:.2f} TB/s**.",
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
    out += ["", f"![paged decode bandwidth](benchmarks/results/decode_{slug}.png)", ""]
    return "\n".join(out)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    copy = next(r for r in rows if r["impl"] == "copy")
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl, marker in zip(IMPLS, "osd"):
        pts = sorted((r["kv_bytes"], r["batch"], r["tbps"]) for r in rows if r["impl"] == impl and "tbps" in r)
        if pts:
            ax.plot([p[0] / 1e6 for p in pts], [p[2] for p in pts], marker=marker, label=impl, alpha=0.85)
    ax.axhline(copy["tbps"], color="k", ls="--", lw=1, label=f"copy BW {copy['tbps']:.2f} TB/s")
    ax.set_xscale("log")
    ax.set_xlabel("K/V bytes read per step (MB, log)")
    ax.set_ylabel("achieved TB/s")
    ax.set_title(f"Paged decode, {HEADS}x{HEAD_DIM} heads, fp16 — {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
