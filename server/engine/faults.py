"""TEST-ONLY fault injection for the engine step, so reliability tests can make a real server
subprocess fail (or slow down) without monkeypatching it. Off unless the environment variable
`FLASHPAGE_FAULT_INJECT` is set; never set it in production.

Format: comma-separated `key=value` pairs:
- `raise=<token id>`: a step whose batch holds a prompt containing that token raises before the
  model runs (so every request scheduled in that step fails, as a real step failure would);
- `after=<n>`: with `raise`, only once that sequence has generated n tokens (a mid-stream failure);
- `sleep=<seconds>`: every step sleeps that long first (makes timing tests deterministic);
- `compile_sleep=<seconds>`: in the grammar process, a spec whose text holds `compile_marker=<text>`
  (every spec without one) takes that much longer to compile (a compile past the deadline there).
"""

from __future__ import annotations

import os
import time

ENV = "FLASHPAGE_FAULT_INJECT"


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    def __init__(self, raise_token: int | None = None, sleep: float = 0.0, after: int = 0,
                 compile_sleep: float = 0.0, compile_marker: str = "") -> None:
        self.raise_token = raise_token
        self.sleep = sleep
        self.after = after
        self.compile_sleep, self.compile_marker = compile_sleep, compile_marker  # GrammarProcess.slow_compiles

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        spec = os.environ.get(ENV, "").strip()
        if not spec:
            return None
        kv = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
        return cls(int(kv["raise"]) if "raise" in kv else None, float(kv.get("sleep", 0.0)), int(kv.get("after", 0)),
                   float(kv.get("compile_sleep", 0.0)), kv.get("compile_marker", ""))

    def before_step(self, batch) -> None:
        if self.sleep:
            time.sleep(self.sleep)
        if self.raise_token is not None and any(
                self.raise_token in item.seq.prompt_token_ids
                and len(item.seq.output_token_ids) + item.seq.num_pending >= self.after
                for item in batch.scheduled):
            raise InjectedFault(f"injected fault ({ENV}: raise={self.raise_token})")
