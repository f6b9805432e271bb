"""Rank 0's side of tensor parallelism: the other ranks' processes, and each forward's inputs sent
to them.

`start_peers` starts ranks 1..N-1, each a `python -c` of server/worker/parallel/follower.py holding
one end of a socket pair (started as the grammar process is, by subprocess: the engine process is
a daemon, which multiprocessing does not let have children), sends it its `Start`, and joins the
group with them (models.init_tensor_parallel: at a TCPStore this process serves on 127.0.0.1; NCCL
on CUDA, gloo on the CPU). Rank r runs on cuda:(i + r) for --device cuda:i (cuda:0 by default).
Then the runner calls `eager` before each eager forward, and the graphs their `replayer` before each
replay: one message down every socket, which each rank runs as it arrives, while this one runs its
own forward; their collectives meet inside the forwards.

Every process of the group, this one included, has NCCL_ENV before NCCL starts: the GPU machines
require NVLink multicast (NVLS) off, whatever NCCL or torch's symmetric memory would pick. Unless
--disable-custom-all-reduce, every rank also sets up the one-shot all-reduce over symmetric
memory as it joins (models/parallel/symm_all_reduce.py: each rank's `Start` carries the config).

A rank that dies while the group runs (a crash, the OOM killer) would leave this one waiting in a
collective for good: a thread here waits on every socket, and when one speaks (a rank's traceback,
or EOF when its process is gone) it logs that and ends this process with exit code 1, which the API
side sees as the engine's death. The other ranks exit when their socket closes, whatever ended this
process; they ignore SIGINT and SIGTERM, as the engine process does (shutdown is the API side's).
When this process exits normally it stops them first and waits for them (`close`), so that a server
that has exited holds no GPU memory any more.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
from torch.distributed import TCPStore

from models import StepRows, close_tensor_parallel, init_tensor_parallel
from server.config import NCCL_ENV, EngineConfig
from server.logs import JsonFormatter
from server.worker.inputs import Packer
from server.worker.parallel.messages import EagerStep, GraphStep, Start, Stop, encode

log = logging.getLogger("flashpage.parallel")
ENTRY = "import sys; from server.worker.parallel.follower import main; main(sys.argv[1:])"
STOP_TIMEOUT_S = 30.0  # how long close() waits for the ranks to exit before it kills them


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank `rank`'s device: cuda:(i + rank) for --device cuda:i (or cuda), else the CPU."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


class Peers:
    """Ranks 1..N-1 as rank 0 sees them: their processes, and a socket to each."""

    def __init__(self, procs: list[subprocess.Popen], conns: list[Connection], store: TCPStore | None) -> None:
        self.procs, self.conns, self.store = procs, conns, store
        self.closing = False
        self.watcher: threading.Thread | None = None

    def watch(self) -> None:
        """From now on, a rank that stops ends this process (see the module's docstring)."""
        self.watcher = threading.Thread(target=self._watch, name="flashpage-tp-watch", daemon=True)
        self.watcher.start()

    def send(self, op: EagerStep | GraphStep | Stop) -> None:
        data = encode(op)
        for conn in self.conns:
            conn.send_bytes(data)

    def eager(self, packer: Packer, rows: StepRows, head_slices: list[tuple[int, int]]) -> None:
        """The eager forward of the step `packer` packed last (its rows `rows`), then the LM head over
        each of `head_slices` and over the rows that sample (server/worker/runner.py `_eager`)."""
        words, spans = packer.packed()
        self.send(EagerStep(memoryview(words), {name: (o, tuple(shape)) for name, (o, shape) in spans.items()},
                            rows.num_prefill_tokens, rows.chunk_lens, rows.chunk_prefix, list(rows.extra),
                            head_slices))

    def replayer(self, graphs, prefill: bool, verify: bool = False):
        """The graphs' on_replay: the inputs they filled, to replay on every rank (`verify`: a
        speculative step's verification graphs, prefill graphs of their own)."""
        def replay(size: int, rows: int, width: int) -> None:
            self.send(GraphStep(prefill, size, rows, width, memoryview(graphs.exported(rows, width)), verify))
        return replay

    def close(self, graceful: bool = True) -> None:
        """Stop every rank (killed if it does not exit in STOP_TIMEOUT_S; at once, not `graceful`:
        after a failure they may wait in a collective for good) and leave the group."""
        if self.closing:
            return
        self.closing = True
        for conn in self.conns:
            try:
                conn.send_bytes(encode(Stop()))
            except OSError:
                pass
        deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.watcher is not None:
            self.watcher.join(timeout=5)
        for conn in self.conns:
            conn.close()
        close_tensor_parallel()

    def _watch(self) -> None:
        while not self.closing:
            ready = wait(self.conns, timeout=1.0)
            if self.closing or not ready:
                continue
            rank = self.conns.index(ready[0]) + 1
            try:
                report = ready[0].recv()  # the rank's traceback
            except (EOFError, OSError):
                report = "(no report: the process is gone)"
            if self.closing:
                return
            try:
                code = self.procs[rank - 1].wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            log.critical("tensor-parallel rank %d stopped (exit code %s); the engine cannot run without it:\n%s",
                         rank, code, report)
            logging.shutdown()
            os._exit(1)


def start_peers(config: EngineConfig, path: Path) -> Peers:
    """Start ranks 1..N-1 (N = config.tensor_parallel_size) and join the group with them as rank 0;
    returns when every rank has joined."""
    size = config.tensor_parallel_size
    device = rank_device(config, 0)
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {size} from {device} needs cuda:{device.index or 0}.."
                         f"cuda:{(device.index or 0) + size - 1}; this host has {torch.cuda.device_count()} GPUs")
    os.environ.update(NCCL_ENV)
    store = TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)  # port 0: a free one
    root = logging.getLogger()
    fmt = "json" if any(isinstance(h.formatter, JsonFormatter) for h in root.handlers) else "text"
    level = logging.getLevelName(max(root.getEffectiveLevel(), logging.WARNING))  # rank 0 logs what they'd repeat
    procs, conns = [], []
    try:
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            procs.append(subprocess.Popen([sys.executable, "-c", ENTRY, str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), env={**os.environ, **NCCL_ENV}))
            theirs.close()
            conns.append(Connection(ours.detach()))
            conns[-1].send(Start(config, str(path), rank, store.port, level.lower(), fmt))
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    peers = Peers(procs, conns, store)
    peers.watch()
    atexit.register(peers.close)  # this process's exit waits for theirs: their GPU memory is free once it is gone
    log.info("started %d more tensor-parallel ranks (%s)", size - 1, "NCCL" if device.type == "cuda" else "gloo")
    try:
        init_tensor_parallel(0, size, store, device, custom_all_reduce=not config.disable_custom_all_reduce)
    except BaseException:
        peers.close()
        raise
    return peers
