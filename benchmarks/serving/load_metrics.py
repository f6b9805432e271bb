"""Per-request records of a load test and the result row they make (benchmarks/serving/load_test.py runs the
load; this module defines what is measured and how it is aggregated).

Metrics (one row per run; latencies in ms, each with mean, p50, p90, p99)
- ttft: request sent -> first SSE event that carries tokens.
- tpot: per request, (e2e - ttft) / (n_out - 1), over requests with n_out > 1.
- itl: gaps between SSE events that carry tokens, counted per token: an event carrying k tokens
  contributes one gap (time since the previous token-carrying event) and then k - 1 zeros, so a
  request contributes n_out - 1 values whose sum is its last-token time minus its ttft. (The first
  event's gap is the ttft, not an itl; its remaining k - 1 tokens count as zeros.)
- e2e: request sent -> `data: [DONE]`.
  ttft/tpot/itl/e2e are taken over successful requests only.
- requests_per_s: successful requests / elapsed; output_tokens_per_s: every output token received
  during the run (those of requests cancelled at the deadline included) / elapsed, where elapsed runs
  from the first request sent to the last one ended. (With no deadline cut the two token counts are
  equal; `output_tokens` counts successful requests only.)
- errors: non-200 answers by status (`errors_by_status`), transport failures by exception type
  (`errors_by_exception`: ConnectError, ReadTimeout, ...; a stream that ends without `[DONE]` is
  `IncompleteStream`, an unparsable event `BadEvent`).
- output tokens are counted from the stream and cross-checked against the final event's
  `usage.completion_tokens` (`usage_mismatches`, with examples); with ignore_eos, every successful
  request should also have exactly its `max_tokens` (`length_mismatches`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from benchmarks.shared.common import summarize

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    index: int
    max_tokens: int
    input_len: int | None
    start: float = 0.0  # perf_counter when the request was sent
    status: int | None = None
    error: str | None = None  # "http_400", or an exception type name
    error_detail: str | None = None
    cancelled: bool = False
    done: bool = False  # saw data: [DONE]
    ttft: float | None = None  # seconds
    e2e: float | None = None
    n_out: int = 0  # tokens counted from the stream
    usage_completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.done

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.n_out < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.n_out - 1)


def summarize_records(records: list[RequestRecord], elapsed: float) -> dict:
    ok = [r for r in records if r.ok]
    errors = [r for r in records if r.error is not None and not r.cancelled]
    by_status: dict[str, int] = {}
    by_exc: dict[str, int] = {}
    for r in errors:
        if r.error.startswith("http_"):
            by_status[r.error[5:]] = by_status.get(r.error[5:], 0) + 1
        else:
            by_exc[r.error] = by_exc.get(r.error, 0) + 1
    mismatches = [r for r in ok if r.usage_completion_tokens != r.n_out]
    length_mismatches = [r for r in ok if r.n_out != r.max_tokens]
    out_tokens = sum(r.n_out for r in ok)
    all_tokens = sum(r.n_out for r in records)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else (r.input_len or 0) for r in ok)
    elapsed = max(elapsed, 1e-9)
    row = {
        "num_requests": len(records), "completed": len(ok), "cancelled": sum(r.cancelled for r in records),
        "errors": len(errors), "errors_by_status": by_status, "errors_by_exception": by_exc,
        "error_examples": sorted({f"{r.error}: {r.error_detail}" for r in errors})[:5],
        "duration_s": elapsed,
        "requests_per_s": len(ok) / elapsed,
        "output_tokens_per_s": all_tokens / elapsed,
        "completed_output_tokens_per_s": out_tokens / elapsed,
        "input_tokens_per_s": in_tokens / elapsed,
        "output_tokens": out_tokens, "output_tokens_received": all_tokens, "input_tokens": in_tokens,
        "usage_mismatches": len(mismatches),
        "usage_mismatch_examples": [{"index": r.index, "stream": r.n_out, "usage": r.usage_completion_tokens}
                                    for r in mismatches[:5]],
        "length_mismatches": len(length_mismatches),
        "mean_in_flight": sum(r.e2e for r in records if r.e2e is not None) / elapsed,
    }
    values = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for t in (r.tpot for r in ok) if t is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    for name in LATENCY_METRICS:
        for stat, v in summarize(values[name], scale=1000.0).items():
            row[f"{name}_{stat}_ms"] = v
    return row


def print_row(row: dict, file=sys.stderr) -> None:
    """One human-readable line for a result row (plus a warning when the client was near saturation)."""
    x = f"c={row['concurrency']}" if row.get("concurrency") is not None else f"rate={row.get('request_rate')}"

    def ms(key):
        v = row.get(key)
        return "-" if v is None else f"{v:.1f}"

    who = row.get("impl") if row.get("api_server_count") is None else f"{row.get('impl')}, {row['api_server_count']} API"
    print(f"[{who}] {x}: {row['completed']}/{row['num_requests']} ok, {row['errors']} errors, "
          f"{row['cancelled']} cancelled | {row['output_tokens_per_s']:.1f} tok/s, {row['requests_per_s']:.2f} req/s | "
          f"ttft p50 {ms('ttft_p50_ms')} p99 {ms('ttft_p99_ms')} ms, tpot p50 {ms('tpot_p50_ms')} ms, "
          f"itl p99 {ms('itl_p99_ms')} ms, e2e p50 {ms('e2e_p50_ms')} ms"
          + (f" | usage mismatches {row['usage_mismatches']}" if row.get("usage_mismatches") else "")
          + (f" | errors {row['errors_by_status']} {row['errors_by_exception']}" if row.get("errors") else ""),
          file=file)
    if (row.get("client_cpu_util") or 0) > 0.8:
        print(f"   warning: a client process was {row['client_cpu_util']:.0%} busy: the load generator may be the "
              "bottleneck; use more client processes (--workers)", file=file)

