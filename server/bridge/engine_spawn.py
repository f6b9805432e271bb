"""Starting the engine process without importing the engine (server/bridge/engine_process.py says
why it is a process).

This module imports nothing but the standard library and server/config.py, so a process can start
the engine before it imports torch, transformers and the HTTP stack itself: `python -m server`
spawns the engine first and does its own imports (~3 s of CPU) while the engine process does its
imports and loads the model (server/cli.py), and the parent of several API processes never imports
torch at all (server/api/servers.py). The engine process imports the engine loop when it starts
(`_engine_entry`).
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import send_handle

from server.config import EngineConfig


@dataclass
class ClientChannel:
    """An API process's ends of its two pipes to the engine process."""

    commands: Connection  # API -> engine
    out: Connection  # engine -> API


def channel_pipes(count: int, ctx=mp) -> tuple[list[ClientChannel], list[tuple[Connection, Connection]]]:
    """`count` channels of two one-way pipes each: the API processes' ends, and the engine's ends
    (commands reader, outputs writer) in the same order."""
    ours, theirs = [], []
    for _ in range(count):
        cmd_reader, cmd_writer = ctx.Pipe(duplex=False)
        out_reader, out_writer = ctx.Pipe(duplex=False)
        ours.append(ClientChannel(cmd_writer, out_reader))
        theirs.append((cmd_reader, out_writer))
    return ours, theirs


def spawn_engine(config: EngineConfig, count: int, log_level: str = "info", log_format: str = "text",
                 control: Connection | None = None) -> tuple[BaseProcess, list[ClientChannel]]:
    """Start the engine process with `count` channels; returns it and the API ends of the channels.
    `control`: the engine's end of a duplex pipe over which the caller hands it new channels
    (`reopen_channel`; the caller keeps the other end, this one is closed here once passed on)."""
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    ours, theirs = channel_pipes(count, ctx)
    # The target is this module's function, not engine_main itself: pickling a function by name
    # imports its module here, and server/bridge/engine_loop.py imports the engine (torch).
    process = ctx.Process(target=_engine_entry, args=(config, theirs, log_level, log_format, control),
                          name="flashpage-engine", daemon=True)
    process.start()
    for pipes in theirs:  # the child has its copies; ours would keep the pipes open after it exits
        for end in pipes:
            end.close()
    if control is not None:
        control.close()
    return process, ours


def reopen_channel(control: Connection, index: int, engine_pid: int, ctx=mp) -> ClientChannel:
    """A new channel for API process `index` (in place of a dead one's): the engine's ends go to the
    engine process over `control` (their descriptors passed on the socket); returns the API's ends.
    The engine answers on it with EngineReady."""
    [ours], [(commands, out)] = channel_pipes(1, ctx)
    control.send(index)
    for end in (commands, out):
        send_handle(control, end.fileno(), engine_pid)
        end.close()
    return ours


def _engine_entry(config: EngineConfig, pipes: list[tuple[Connection, Connection]], log_level: str,
                  log_format: str, control: Connection | None = None) -> None:
    """The engine process's entry point: the engine loop over one EngineChannel per API process."""
    from server.bridge.engine_loop import EngineChannel, engine_main

    engine_main(config, [EngineChannel(commands, out) for commands, out in pipes], log_level, log_format, control)
