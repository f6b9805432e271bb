"""The engine in its own process, as vLLM's engine core and SGLang's scheduler run: the API side.

Why a process: PyTorch releases the GIL around every op it launches, and a thread that gives the
GIL up waits to get it back behind whatever Python other threads run (with the engine on a thread
of the HTTP server, a tiny CPU engine stepped 8x slower beside one busy Python thread). Under load
the event loop streaming hundreds of responses is that busy thread, so every engine step stretched
with the number of clients. Here the engine loop shares nothing with the HTTP side but two pipes.

- `spawn_engine` (server/bridge/engine_spawn.py, which imports no engine) starts the engine
  process (server/bridge/engine_loop.py) with one channel (a command pipe and an output pipe) per
  API process.
- `EngineClient` (API process) holds one channel. It waits until the model is loaded, then stands
  in for the LLMEngine on the HTTP side (tokenizer, model_name, max_model_len, validate, snapshot)
  and is the core AsyncEngine drives: adds and aborts are batched per event-loop turn into one
  message down the command pipe; the event loop reads step messages off the output pipe
  (`add_reader`, no thread) and gives each RequestOutput its cumulative text and ids.
  `EngineClient.spawn` spawns an engine of its own (one API process, the default); with
  `--api-server-count` N > 1 the server's parent process spawns the engine with N channels and
  each API process attaches to one (server/api/servers.py).

The messages are typed (server/bridge/messages.py). The engine process ignores SIGINT/SIGTERM (the
API processes own shutdown: each drains, then sends StopEngine) and exits once every channel is
closed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from multiprocessing.process import BaseProcess

from models import load_tokenizer, resolve_model_path
from server.bridge.engine_loop import grow_pipe
from server.bridge.engine_spawn import ClientChannel, spawn_engine  # re-exported: where they were
from server.bridge.messages import (AbortRequest, AddRequest, Command, EngineReady, RequestRefused, StepOutputs,
                                    StopEngine, decode_up, encode)
from server.config import EngineConfig
from server.engine import EngineSnapshot, RequestBounds, validate_request
from server.sampling_params import SamplingParams

log = logging.getLogger("flashpage.engine")


class EngineProcessError(RuntimeError):
    """The engine process failed to start or died."""


class EngineClient:
    def __init__(self, config: EngineConfig, channel: ClientChannel, process: BaseProcess | None = None,
                 startup_timeout: float | None = None, id_prefix: str = "") -> None:
        """Attach to the engine on `channel`; `process`: the engine process, when this client owns it
        (then stop() waits for it to exit and a lost engine reports its exit code). `id_prefix`:
        this API process's mark on the request ids it sends, so that two processes never send the
        engine the same id (each keeps its own ids unique; a client may reuse its X-Request-ID)."""
        self.process = process
        self.id_prefix = id_prefix
        # Attached (no process of its own): other API processes share the engine, so the waiting
        # queue is the engine's count plus the adds this process sent since its last snapshot.
        self.shared = process is None
        self.unseen_adds = 0
        self._cmd, self._out = channel.commands, channel.out
        grow_pipe(self._cmd)
        info = self._wait_ready(startup_timeout)
        self.config = config
        self.model_name, self.max_model_len = info.model_name, info.max_model_len
        self.quantization, self.weight_bytes = info.quantization, info.weight_bytes
        self.bounds: RequestBounds = info.bounds
        self._snapshot: EngineSnapshot = info.snapshot
        self.model_path = resolve_model_path(config.model)  # what compile workers load (server/api/controls.py)
        self.tokenizer = load_tokenizer(self.model_path)
        self.stats = None  # server/metrics.EngineStats: replays the engine process's hook calls
        self._text: dict[str, tuple[str, list[int]]] = {}  # text and ids so far, per request in flight
        self._commands: list[Command] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver = self._die = None
        self._closed = False

    @classmethod
    def spawn(cls, config: EngineConfig, log_level: str = "info", log_format: str = "text",
              startup_timeout: float | None = None) -> EngineClient:
        """Spawn an engine process of this client's own (one API process) and wait until it is ready."""
        process, (channel,) = spawn_engine(config, 1, log_level, log_format)
        return cls(config, channel, process, startup_timeout)

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
            if self.process is not None and not self.process.is_alive():
                break
        if self.process is not None:
            self.process.kill()
        raise EngineProcessError(f"the engine process exited during start-up (exit code {self._exitcode()})"
                                 if deadline is None or time.monotonic() < deadline else
                                 f"the engine was not ready within {timeout} s")

    def _exitcode(self) -> int | None:
        return None if self.process is None else self.process.exitcode

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
        # uvloop makes a watched descriptor non-blocking: a step message only partly in the pipe
        # then raised EAGAIN halfway through recv_bytes (read as a lost engine, at 1024 clients).
        # The engine writes each message whole at once, so reading it blocking waits at most for
        # the rest of that one write.
        os.set_blocking(self._out.fileno(), True)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            deadline: float | None = None) -> None:
        request_id = self.id_prefix + request_id
        self._text[request_id] = ("", [])
        self.unseen_adds += 1
        self._send(AddRequest(request_id, prompt_token_ids, params, deadline))

    def abort(self, request_id: str) -> None:
        request_id = self.id_prefix + request_id
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
                    refused.append(RequestRefused(cmd.request_id[len(self.id_prefix):],
                                                  f"the request cannot be sent to the engine: {e}"))
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
        if self.process is None:  # attached: the parent process waits for the engine
            return
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
        self.unseen_adds = 0
        if self.stats is not None and msg.events:
            self.stats.replay(msg.events)
        outputs = []
        texts, n = self._text, len(self.id_prefix)
        for out in msg.outputs:
            rid = out.request_id
            so_far = texts.pop(rid, None) if out.finished else texts.get(rid)
            if so_far is None:
                continue  # aborted here meanwhile: nobody waits for it
            if not out.finished:  # the wire carries only the new text and ids
                out.text, out.token_ids = so_far[0] + out.new_text, so_far[1]
                out.token_ids.extend(out.new_token_ids)
                texts[rid] = (out.text, out.token_ids)
            if n:  # back to the id this process knows it by
                out.request_id = rid[n:]
            outputs.append(out)
        for r in msg.refused:
            texts.pop(r.request_id, None)
            r.request_id = r.request_id[n:]
        if outputs or msg.refused:
            self._deliver(outputs, msg.refused)

    def _lost(self, e: BaseException) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._out.fileno())
        if self.process is not None:
            self.process.join(1)
        code = self._exitcode()
        log.critical("lost the engine process (exit code %s): %s", code, e)
        self._die(e if isinstance(e, EngineProcessError) else
                  EngineProcessError(f"the engine process is gone (exit code {code})"))
