"""Plots of load-test result rows (benchmarks/load_test.py): throughput and latency percentiles against
concurrency or request rate, one line per impl. `python benchmarks/load_test.py plot ...` calls `plot`."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.load_metrics import LATENCY_METRICS


def _rows(results) -> list[dict]:
    if isinstance(results, dict):
        results = [results]
    rows = []
    for r in results:
        if isinstance(r, (str, Path)):
            r = json.loads(Path(r).read_text())
        rows += r.get("rows", [r]) if isinstance(r, dict) else list(r)
    return rows


def _x_of(row: dict) -> tuple[str, float | None]:
    if row.get("concurrency") is not None:
        return "concurrency", row["concurrency"]
    return "request_rate", row.get("request_rate")


def plot(results, out_prefix: str | Path, title: str | None = None) -> list[str]:
    """Throughput vs concurrency (or request rate) and latency percentiles vs concurrency, one line per
    impl, from result dicts / rows / JSON file paths. Writes `<out_prefix>_throughput.png` and
    `<out_prefix>_latency.png`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in _rows(results) if _x_of(r)[1] is not None]
    if not rows:
        raise ValueError("no rows with a concurrency or request_rate to plot")
    xname = _x_of(rows[0])[0]
    rows = [r for r in rows if _x_of(r)[0] == xname]
    impls = list(dict.fromkeys(r.get("impl", "server") for r in rows))
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    xlabel = "concurrent clients" if xname == "concurrency" else "request rate (req/s)"
    suffix = f" - {title}" if title else ""

    def series(impl, key):
        pts = sorted((_x_of(r)[1], r.get(key)) for r in rows if r.get("impl", "server") == impl)
        return [p[0] for p in pts if p[1] is not None], [p[1] for p in pts if p[1] is not None]

    def style_x(ax):
        xs = sorted({_x_of(r)[1] for r in rows})
        if min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)

    out_prefix = str(out_prefix)
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, ylabel in ((axes[0], "output_tokens_per_s", "output tokens / s"),
                            (axes[1], "requests_per_s", "requests / s")):
        for impl in impls:
            xs, ys = series(impl, key)
            ax.plot(xs, ys, marker="o", color=colors[impl], label=impl)
        style_x(ax)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(f"Throughput{suffix}")
    fig.tight_layout()
    paths.append(out_prefix + "_throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    names = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency",
             "e2e": "end-to-end latency"}
    for ax, metric in zip(axes.flat, LATENCY_METRICS):
        for impl in impls:
            for stat, ls in (("p50", "-"), ("p99", "--")):
                xs, ys = series(impl, f"{metric}_{stat}_ms")
                ax.plot(xs, ys, marker="o", ls=ls, color=colors[impl], label=impl if stat == "p50" else None)
        style_x(ax)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log)")
        ax.set_title(f"{names[metric]} (solid p50, dashed p99)")
        ax.legend(fontsize=7)
    fig.suptitle(f"Latency{suffix}")
    fig.tight_layout()
    paths.append(out_prefix + "_latency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths

