"""The engine process's main loop: one engine, one or more API processes, each on its own channel.

`engine_main` builds the LLMEngine, sends `EngineReady` on every channel, then loops: take the
commands waiting on every channel (blocking only when idle), step, send each channel the outputs of
its own requests. A request belongs to the channel that added it (`owner`); an id already in flight
from another channel is refused as a duplicate, as one API process refuses its own, so request ids
stay unique server-wide whatever process a client reaches.

- When a channel's pipe is full (its API process is behind) the engine keeps stepping and merges
  each request's outputs until the pipe drains: the engine never waits on HTTP, and a slow reader
  gets fewer, larger messages (`_Outbox`). Idle, it sleeps until a command comes or a full pipe
  with messages waiting for it drains: it never blocks on one API process's pipe (one that is
  restarting reads nothing for seconds: issue 44, where the engine then stalled every request).
- Engine statistics (server/engine/stats.py) go to one channel only, the first still open whose API
  process has spoken (one restarted reads nothing until it has started), so that metrics summed
  across API processes count each event once (server/api/metrics.py).
- Every channel hears from the engine at least every SNAPSHOT_EVERY_S while it is busy and once
  when it goes idle, so every API process's snapshot (/metrics gauges, /debug/kv, the waiting-queue
  bound) is fresh even when none of its requests produced output.
- A channel whose API process sent StopEngine or went away (EOF on its commands, or a broken pipe
  on any write to it: every send is guarded) is closed and its requests are aborted, freeing their
  KV blocks; the engine and the other channels carry on. The loop returns once every channel is
  closed and no API process can be restarted.
- With several API processes the parent (server/api/servers.py) holds a control pipe to the loop:
  when an API process dies it sends the engine's ends of a new channel for its index (the pipes'
  descriptors, passed over the socket), and the loop reopens the channel with them and sends
  EngineReady on it for the API process that replaces the dead one.

The engine process ignores SIGINT/SIGTERM: the API processes own shutdown (they drain, then send
StopEngine).
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from server.bridge.messages import (AbortRequest, AddRequest, EngineFailed, EngineReady, RequestRefused, StepOutputs,
                                    StopEngine, add_request, decode_down, encode)
from server.config import EngineConfig, engine_threads
from server.engine import RequestOutput, merge_outputs
from server.engine.stop import ERROR

log = logging.getLogger("flashpage.engine")

PIPE_BYTES = 1 << 20  # Linux pipes hold 64 KiB by default; room for a burst of prompts or outputs
SNAPSHOT_EVERY_S = 0.05  # while busy, the longest an API process goes without a fresh snapshot


def grow_pipe(conn: Connection) -> None:
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):  # not Linux, or over /proc/sys/fs/pipe-max-size
        pass


@dataclass
class EngineChannel:
    """The engine process's ends of one API process's two pipes."""

    commands: Connection  # API -> engine: lists of Commands
    out: Connection  # engine -> API: EngineReady, StepOutputs, EngineFailed


class _Outbox:
    """Outputs not sent yet. While the API process is behind, a request's outputs merge into one."""

    def __init__(self) -> None:
        self.outputs: dict[str, RequestOutput] = {}
        self.failed: list[RequestOutput] = []  # kept apart, after the tokens before them (as the HTTP side does)
        self.refused: list[RequestRefused] = []
        self.events: list = []
        self.dirty = False
        self.sent_at = 0.0

    def add(self, outputs: list[RequestOutput], refused: list[RequestRefused], events: list) -> None:
        self.dirty = True
        self.events += events
        self.refused += refused
        for o in outputs:
            if o.finish_reason == ERROR:
                self.failed.append(o)
                continue
            prev = self.outputs.get(o.request_id)
            self.outputs[o.request_id] = o if prev is None else merge_outputs(prev, o)

    def flush(self, conn: Connection, snapshot, block: bool) -> bool:
        """Send what waits, unless `block` is off and the pipe is full; `snapshot()` is the
        engine's, taken only when a message goes. False: the pipe is broken (its API process is
        gone; what waited is dropped)."""
        if not self.dirty:
            return True
        if not block and not select.select([], [conn], [], 0)[1]:
            return True  # the pipe is full: keep stepping, send merged later
        outputs = list(self.outputs.values()) + self.failed
        for o in outputs:
            if not o.finished:  # the API side accumulates text and ids; only a final output carries them
                o.text, o.token_ids = "", []
        message = encode(StepOutputs(outputs, self.refused, self.events, snapshot()))
        self.outputs, self.failed, self.refused, self.events = {}, [], [], []
        self.dirty = False
        try:
            conn.send_bytes(message)
        except OSError:  # EPIPE: nobody reads this channel any more
            return False
        self.sent_at = time.monotonic()
        return True


class _Router:
    """Which channel each request belongs to; applies each channel's commands in order."""

    def __init__(self, engine, channels: list[EngineChannel], control: Connection | None = None) -> None:
        """`control`: the parent's pipe that hands over new channels (server/api/servers.py), if any."""
        self.engine = engine
        self.channels = channels
        self.control = control
        self.outboxes = [_Outbox() for _ in channels]
        self.open = list(range(len(channels)))  # channels whose API process has not stopped
        self.heard = set(self.open)  # channels whose API process reads them (a reopened one: once it spoke)
        self.owner: dict[str, int] = {}

    def greet(self, i: int) -> None:
        """Send channel i EngineReady (its API process waits for it before it serves)."""
        e = self.engine
        try:
            self.channels[i].out.send_bytes(encode(EngineReady(e.model_name, e.max_model_len, e.limits(), e.snapshot(),
                                                               e.quantization, e.weight_bytes)))
        except OSError:
            log.warning("API process %d went away before the engine was ready", i)
            self.close(i)

    def receive(self, block: bool) -> None:
        """Apply every command waiting on the open channels (and a new channel from the parent);
        with `block`, wait for one first, or for the pipe of a channel with messages waiting for it
        to take them (then return: the caller flushes)."""
        conns = [self.channels[i].commands for i in self.open] + ([self.control] if self.control else [])
        if block:
            waiting = [self.channels[i].out for i in self.open if self.outboxes[i].dirty]
            ready = select.select(conns, waiting, [])[0]
        else:
            ready = [c for c in conns if c.poll()]
        for conn in ready:
            if conn is self.control:
                self._reopen()
                continue
            i = next((i for i in self.open if self.channels[i].commands is conn), None)
            if i is None:  # closed by a reopen just now
                continue
            self.heard.add(i)
            try:
                while conn.poll():
                    if self._apply(i, decode_down(conn.recv_bytes())):
                        break
            except (EOFError, OSError):  # the API process is gone
                log.warning("API process %d went away: aborting its requests", i)
                self.close(i)

    def _reopen(self) -> None:
        """The parent started an API process in place of a dead one: take its channel's ends."""
        try:
            i = self.control.recv()
            commands, out = Connection(recv_handle(self.control), writable=False), \
                Connection(recv_handle(self.control), readable=False)
        except (EOFError, OSError):  # the parent is gone: no more restarts
            self.control = None
            return
        self.close(i)  # the dead process's requests, if its end of the pipes was not seen closed yet
        self.channels[i], self.outboxes[i] = EngineChannel(commands, out), _Outbox()
        grow_pipe(out)
        self.open = sorted(self.open + [i])
        self.heard.discard(i)
        log.info("API process %d restarted: its channel is open again", i)
        self.greet(i)

    def _apply(self, i: int, commands: list) -> bool:
        """Returns True when the channel closed (StopEngine)."""
        engine, owner, refused = self.engine, self.owner, []
        for cmd in commands:
            if isinstance(cmd, AddRequest):
                rid = cmd.request_id
                if rid in owner:  # in flight from another API process (each refuses its own duplicates)
                    refused.append(RequestRefused(rid, f"request id {rid!r} is already in flight"))
                    continue
                owner[rid] = i
                if (r := add_request(engine, cmd)) is not None:
                    del owner[rid]
                    refused.append(r)
            elif isinstance(cmd, AbortRequest):
                if owner.get(cmd.request_id) == i:
                    del owner[cmd.request_id]
                    engine.abort_request(cmd.request_id)
            elif isinstance(cmd, StopEngine):
                self.close(i)
                return True
        if refused:
            self.outboxes[i].add([], refused, [])
        return False

    def close(self, i: int) -> None:
        """Close channel i: its requests are aborted (their blocks freed at once) and its pipes closed."""
        if i not in self.open:
            return
        self.open.remove(i)
        for rid in [rid for rid, o in self.owner.items() if o == i]:
            del self.owner[rid]
            self.engine.abort_request(rid)
        self.outboxes[i] = _Outbox()
        for conn in (self.channels[i].commands, self.channels[i].out):
            try:
                conn.close()
            except OSError:
                pass

    def route(self, outputs: list[RequestOutput], events: list) -> None:
        owner, boxes = self.owner, self.outboxes
        mine: dict[int, list[RequestOutput]] = {}
        for o in outputs:
            i = owner.pop(o.request_id, None) if o.finished else owner.get(o.request_id)
            if i is not None:  # None: aborted meanwhile, or its API process is gone
                mine.setdefault(i, []).append(o)
        for i, outs in mine.items():
            boxes[i].add(outs, [], [])
        if events and self.open:
            boxes[next((i for i in self.open if i in self.heard), self.open[0])].add([], [], events)

    def flush(self, block: bool, fresh: bool) -> None:
        """Send each open channel what waits for it (see _Outbox.flush); `fresh`: every channel
        gets a message, a snapshot alone if nothing else; otherwise so does any channel that has
        heard nothing for SNAPSHOT_EVERY_S."""
        now = time.monotonic()
        for i in list(self.open):
            box = self.outboxes[i]
            if not box.dirty and (fresh or now - box.sent_at > SNAPSHOT_EVERY_S):
                box.dirty = True
            if not box.flush(self.channels[i].out, self.engine.snapshot, block):
                log.warning("API process %d went away (its pipe broke): aborting its requests", i)
                self.close(i)


def turn(router: _Router, engine, recorder, stepped: bool) -> bool:
    """One turn of the engine loop: take the commands (idle: sleep until one comes, or a full pipe
    with messages waiting drains), step, send. `stepped`: the last turn stepped. Returns whether
    this one did."""
    busy = engine.has_unfinished()
    if not busy:  # send what may go now (and, just gone idle, every channel the idle snapshot)
        router.flush(block=False, fresh=stepped)
    router.receive(block=not busy)
    stepped = engine.has_unfinished()
    outputs = engine.step() if stepped else []
    router.route(outputs, recorder.take())
    router.flush(block=False, fresh=False)
    return stepped


def engine_main(config: EngineConfig, channels: list[EngineChannel], log_level: str, log_format: str,
                control: Connection | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group: the API
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # processes drain, then stop us
    from server.logs import setup_logging

    setup_logging(log_level, log_format)
    import torch

    from server.engine import LLMEngine
    from server.engine.stats import StatsRecorder

    for ch in channels:
        grow_pipe(ch.out)
    if "OMP_NUM_THREADS" not in os.environ:  # cores left for the API processes (server/config.py says why)
        torch.set_num_threads(engine_threads(len(channels)))
    try:
        torch.manual_seed(config.seed)
        engine = LLMEngine(config)
    except BaseException:
        failed = encode(EngineFailed(traceback.format_exc()))
        for ch in channels:
            try:
                ch.out.send_bytes(failed)
            except OSError:
                pass
        return
    engine.stats = recorder = StatsRecorder()
    gc.collect()
    gc.freeze()  # what start-up built lives for good: no collection need scan it again (see server/api/lifecycle.py)
    router = _Router(engine, channels, control)
    for i in range(len(channels)):
        router.greet(i)
    stepped = False
    try:
        while router.open:
            stepped = turn(router, engine, recorder, stepped)
    except BaseException:
        log.exception("engine loop died")
        failed = encode(EngineFailed(traceback.format_exc()))
        for i in router.open:
            try:
                router.channels[i].out.send_bytes(failed)
            except OSError:
                pass
        raise SystemExit(1)
    finally:
        gc.unfreeze()  # as in server/api/lifecycle.py: let exit free what start-up froze
        try:  # the graphs before the tensor-parallel group (runner.close): NCCL's destroy hangs while they live
            engine.close()
        except Exception:
            log.exception("closing the engine failed")
