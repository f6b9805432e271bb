"""Plots of load-test result rows (benchmarks/serving/load_test.py): throughput and latency percentiles against
concurrency or request rate, one line per impl. `python -m benchmarks.serving.load_test plot ...` calls `plot`.
Rows of an API-process sweep (`api_server_count`, benchmarks/serving/compare.py --api-server-counts) are
left out there and drawn against the process count by `plot_api_servers`; `plot_result` draws both."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.serving.load_metrics import LATENCY_METRICS


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

    rows = [r for r in _rows(results) if _x_of(r)[1] is not None and r.get("api_server_count") is None]
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



def plot_api_servers(result: dict, out_prefix: str | Path, title: str | None = None) -> str:
    """Output tok/s (and the offline reference, if the result has one), TTFT p50/p99 and ITL p50/p99 /
    TPOT p50 against the API process count, one line per concurrency; `<out_prefix>_api_servers.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("api_server_count") is not None and r.get("concurrency")]
    if not rows:
        raise ValueError("no rows with an api_server_count to plot")
    counts = sorted({r["api_server_count"] for r in rows})
    levels = sorted({r["concurrency"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))

    def series(impl, c, key):
        pts = sorted((r["api_server_count"], r.get(key)) for r in rows if r["impl"] == impl and r["concurrency"] == c)
        return [n for n, v in pts if v is not None], [v for n, v in pts if v is not None]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = ((axes[0], "output tokens / s", [("output_tokens_per_s", "-", "")]),
              (axes[1], "TTFT ms", [("ttft_p50_ms", "-", "p50"), ("ttft_p99_ms", "--", "p99")]),
              (axes[2], "ms", [("itl_p50_ms", "-", "ITL p50"), ("itl_p99_ms", "--", "ITL p99"),
                               ("tpot_p50_ms", ":", "TPOT p50")]))
    k = 0
    for impl in impls:
        for c in levels:
            name = (f"{impl} " if len(impls) > 1 else "") + f"{c} clients"
            for ax, _, keys in panels:
                for key, ls, stat in keys:
                    xs, ys = series(impl, c, key)
                    ax.plot(xs, ys, marker="o", ls=ls, color=f"C{k}", label=f"{name} {stat}".strip())
            k += 1
    off = (result.get("offline") or {}).get("output_tokens_per_s")
    if off:
        axes[0].axhline(off, color="gray", ls="--", label=f"offline engine ({off:,.0f})")
    for ax, ylabel, _ in panels:
        ax.set_xticks(counts)
        ax.set_xlabel("API processes (--api-server-count)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("throughput")
    axes[1].set_title("time to first token")
    axes[2].set_title("inter-token latency, time per output token")
    fig.suptitle("API processes" + (f" - {title}" if title else ""))
    fig.tight_layout()
    path = str(out_prefix) + "_api_servers.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_result(result: dict, out_prefix: str | Path, title: str | None = None) -> list[str]:
    """Every plot a compare.py result has rows for: `plot`'s two, and `plot_api_servers`'."""
    paths = []
    if any(r.get("api_server_count") is None for r in result["rows"]):
        paths += plot(result, out_prefix, title)
    if any(r.get("api_server_count") is not None for r in result["rows"]):
        paths.append(plot_api_servers(result, out_prefix, title))
    return paths
