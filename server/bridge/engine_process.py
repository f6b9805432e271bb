"""The engine in its own process, as vLLM's engine core and SGLang's scheduler run.

Why a process: PyTorch releases the GIL around every op it launches, and a thread that gives the
GIL up waits to get it back behind whatever Python other threads run (with the engine on a thread
of the HTTP server, a tiny CPU engine stepped 8x slower beside one busy Python thread). Under load
the event loop streaming hundreds of responses is that busy thread, so every engine step stretched
with the number of clients. Here the engine loop shares nothing with the HTTP side but two pipes.

- `EngineClient` (API process): starts the engine process and waits until the model is loaded,
  then stands in for the LLMEngine on the HTTP side (tokenizer, model_name, max_model_len,
  validate, snapshot) and is the core AsyncEngine drives: adds and aborts are batched per event-loop
  turn into one message down the command pipe; the event loop reads step messages off the output
  pipe (`add_reader`, no thread) and gives each RequestOutput its cumulative text and ids.
- `engine_main` (engine process): builds the LLMEngine, then loops: take commands (blocking only
  when idle), step, send the step's outputs. When the output pipe is full (the API process is
  behind) it keeps stepping and merges each request's outputs until the pipe drains, so the engine
  never waits on HTTP and a slow reader gets fewer, larger messages.

The messages are typed (server/bridge/messages.py). The engine process ignores SIGINT/SIGTERM (the
API process owns shutdown: it drains, then sends StopEngine) and exits when the command pipe closes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing as mp
import select
import signal
import time
import traceback

from models import load_tokenizer, resolve_model_path
from server.bridge.messages import (AbortRequest, AddRequest, Command, EngineFailed, EngineReady, RequestRefused,
                                    StepOutputs, StopEngine, apply_commands, decode_down, decode_up, encode)
from server.config import EngineConfig
from server.engine import EngineSnapshot, RequestBounds, RequestOutput, merge_outputs, validate_request
from server.engine.stop import ERROR
from server.sampling_params import SamplingParams

log = logging.getLogger("flashpage.engine")

PIPE_BYTES = 1 << 20  # Linux pipes hold 64 KiB by default; room for a burst of prompts or outputs


class EngineProcessError(RuntimeError):
    """The engine process failed to start or died."""


def _grow_pipe(conn) -> None:
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):  # not Linux, or over /proc/sys/fs/pipe-max-size
        pass


# ------------------------------------------------------------------------------ API process side
class EngineClient:
    def __init__(self, config: EngineConfig, log_level: str = "info", log_format: str = "text",
                 startup_timeout: float | None = None) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        cmd_reader, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_writer = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_main, args=(config, cmd_reader, out_writer, log_level, log_format),
                                   name="flashpage-engine", daemon=True)
        self.process.start()
        cmd_reader.close()
        out_writer.close()
        _grow_pipe(self._cmd)
        info = self._wait_ready(startup_timeout)
        self.config = config
        self.model_name, self.max_model_len = info.model_name, info.max_model_len
        self.bounds: RequestBounds = info.bounds
        self._snapshot: EngineSnapshot = info.snapshot
        self.tokenizer = load_tokenizer(resolve_model_path(config.model))
        self.stats = None  # server/metrics.EngineStats: replays the engine process's hook calls
        self._text: dict[str, tuple[str, list[int]]] = {}  # text and ids so far, per request in flight
        self._commands: list[Command] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver = self._die = None
        self._closed = False

    def _wait_ready(self, timeout: float | None) -> EngineReady:
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            if self._out.poll(0.2):
                try:
                    msg = decode_up(self._out.recv_bytes())
                except EOFError:
                    break
                if isinstance(msg, EngineReady):
                    return msg
                raise EngineProcessError(f"the engine failed to start:\n{msg.traceback}")
            if not self.process.is_alive():
                break
        self.process.kill()
        raise EngineProcessError(f"the engine process exited during start-up (exit code {self.process.exitcode})"
                                 if deadline is None or time.monotonic() < deadline else
                                 f"the engine was not ready within {timeout} s")

    # -- what the HTTP side asks of an engine --------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, self.bounds)

    def limits(self) -> RequestBounds:
        return self.bounds

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot  # as of the engine's last step message

    # -- the core protocol (server/bridge/async_engine.py) -------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, deliver, die) -> None:
        self._loop, self._deliver, self._die = loop, deliver, die
        loop.add_reader(self._out.fileno(), self._on_readable)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            deadline: float | None = None) -> None:
        self._text[request_id] = ("", [])
        self._send(AddRequest(request_id, prompt_token_ids, params, deadline))

    def abort(self, request_id: str) -> None:
        self._text.pop(request_id, None)
        self._send(AbortRequest(request_id))

    def _send(self, cmd: Command) -> None:
        if not self._commands:  # one message per event-loop turn, however many requests arrive in it
            self._loop.call_soon(self._flush)
        self._commands.append(cmd)

    def _flush(self) -> None:
        commands, self._commands = self._commands, []
        if not commands or self._closed:
            return
        try:
            data = encode(commands)
        except Exception:  # a value msgpack cannot carry: refuse that request alone, send the rest
            data = self._encode_each(commands)
        try:
            self._cmd.send_bytes(data)
        except OSError as e:
            self._lost(e)

    def _encode_each(self, commands: list[Command]) -> bytes:
        good, refused = [], []
        for cmd in commands:
            try:
                encode([cmd])
                good.append(cmd)
            except Exception as e:
                if isinstance(cmd, AddRequest):
                    self._text.pop(cmd.request_id, None)
                    refused.append(RequestRefused(cmd.request_id, f"the request cannot be sent to the engine: {e}"))
        if refused:
            self._deliver([], refused)
        return encode(good)

    async def stop(self) -> None:
        if self._loop is not None and not self._closed:
            self._loop.remove_reader(self._out.fileno())
        self._closed = True
        try:
            self._cmd.send_bytes(encode([StopEngine()]))
        except OSError:
            pass
        await asyncio.to_thread(self.process.join, 30)
        if self.process.is_alive():
            log.warning("the engine process did not stop; killing it")
            self.process.kill()

    def _on_readable(self) -> None:
        try:
            for _ in range(16):  # then let the HTTP tasks run; the reader fires again while data waits
                if self._closed or not self._out.poll():
                    break
                msg = decode_up(self._out.recv_bytes())
                if isinstance(msg, StepOutputs):
                    self._on_step(msg)
                else:
                    self._lost(EngineProcessError(f"the engine process failed:\n{msg.traceback}"))
        except (EOFError, OSError) as e:
            self._lost(e)

    def _on_step(self, msg: StepOutputs) -> None:
        self._snapshot = msg.snapshot
        if self.stats is not None and msg.events:
            self.stats.replay(msg.events)
        outputs = []
        texts = self._text
        for out in msg.outputs:
            rid = out.request_id
            so_far = texts.pop(rid, None) if out.finished else texts.get(rid)
            if so_far is None:
                continue  # aborted here meanwhile: nobody waits for it
            if not out.finished:  # the wire carries only the new text and ids
                out.text, out.token_ids = so_far[0] + out.new_text, so_far[1]
                out.token_ids.extend(out.new_token_ids)
                texts[rid] = (out.text, out.token_ids)
            outputs.append(out)
        for r in msg.refused:
            texts.pop(r.request_id, None)
        if outputs or msg.refused:
            self._deliver(outputs, msg.refused)

    def _lost(self, e: BaseException) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._out.fileno())
        self.process.join(1)
        code = self.process.exitcode
        log.critical("lost the engine process (exit code %s): %s", code, e)
        self._die(e if isinstance(e, EngineProcessError) else
                  EngineProcessError(f"the engine process is gone (exit code {code})"))


# ------------------------------------------------------------------------------ engine process side
class _Outbox:
    """Outputs not sent yet. While the API process is behind, a request's outputs merge into one."""

    def __init__(self) -> None:
        self.outputs: dict[str, RequestOutput] = {}
        self.failed: list[RequestOutput] = []  # kept apart, after the tokens before them (as the HTTP side does)
        self.refused: list[RequestRefused] = []
        self.events: list = []
        self.dirty = False

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

    def flush(self, conn, snapshot, block: bool) -> None:
        """Send what waits, unless `block` is off and the pipe is full; `snapshot()` is the
        engine's, taken only when a message goes."""
        if not self.dirty:
            return
        if not block and not select.select([], [conn], [], 0)[1]:
            return  # the pipe is full: keep stepping, send merged later
        outputs = list(self.outputs.values()) + self.failed
        for o in outputs:
            if not o.finished:  # the API side accumulates text and ids; only a final output carries them
                o.text, o.token_ids = "", []
        conn.send_bytes(encode(StepOutputs(outputs, self.refused, self.events, snapshot())))
        self.__init__()


def engine_main(config: EngineConfig, commands, out, log_level: str, log_format: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group: the API
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # process drains, then stops us
    from server.logs import setup_logging

    setup_logging(log_level, log_format)
    import torch

    from server.engine import LLMEngine
    from server.engine.stats import StatsRecorder

    _grow_pipe(out)
    try:
        torch.manual_seed(config.seed)
        engine = LLMEngine(config)
    except BaseException:
        out.send_bytes(encode(EngineFailed(traceback.format_exc())))
        return
    engine.stats = recorder = StatsRecorder()
    gc.collect()
    gc.freeze()  # what start-up built lives for good: no collection need scan it again (see server/cli.py)
    out.send_bytes(encode(EngineReady(engine.model_name, engine.max_model_len, engine.limits(), engine.snapshot())))
    outbox = _Outbox()
    try:
        while True:
            idle = not engine.has_unfinished()
            if idle:
                outbox.flush(out, engine.snapshot, block=True)
            batches = [commands.recv_bytes()] if idle else []  # idle: sleep until there is something to do
            while commands.poll():
                batches.append(commands.recv_bytes())
            cmds = [c for batch in batches for c in decode_down(batch)]
            if any(isinstance(c, StopEngine) for c in cmds):
                return
            refused = apply_commands(engine, cmds)
            outputs = engine.step() if engine.has_unfinished() else []
            if cmds or outputs or refused or recorder.events:
                outbox.add(outputs, refused, recorder.take())
            outbox.flush(out, engine.snapshot, block=False)
    except EOFError:  # the API process is gone
        return
    except BaseException:
        log.exception("engine loop died")
        try:
            out.send_bytes(encode(EngineFailed(traceback.format_exc())))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        gc.unfreeze()  # as in server/cli.py: let exit free what start-up froze
