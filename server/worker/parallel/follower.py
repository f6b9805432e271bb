"""A tensor-parallel rank other than 0: the same runner over its own shard, running each forward
rank 0 sends, in order.

`main` is the process's entry (peers.py starts it): it reads its `Start`, joins the group, and
brings the worker up as rank 0 does (server/worker/setup.py `bring_up`: the same model build,
profile run, KV-cache size, the group's smallest, warm-up and graph captures, so that the
collectives in them meet). Then, until `Stop` or until rank 0's end of the socket closes, it runs
each message (server/worker/parallel/messages.py): a graph replay over rank 0's inputs, or an eager
forward and its LM-head calls; a speculative step's verification is one of those (its own graphs),
and the draft is rank 0's alone (server/worker/spec/parallel.py). The logits every rank gets are
rank 0's to choose from; the ids it chooses reach this rank in the next forward's embedding
(models/parallel/layers.py).

A failure goes back over the socket as a traceback (rank 0 then ends the engine) and ends this
process with code 1; so does rank 0's process going away (a thread checks the parent).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch
from torch.distributed import TCPStore

from models import close_tensor_parallel, init_tensor_parallel
from server.config import NCCL_ENV
from server.logs import setup_logging
from server.worker.inputs import step_inputs
from server.worker.parallel.messages import EagerStep, GraphStep, Start, Stop, decode
from server.worker.parallel.peers import rank_device
from server.worker.runner import ModelRunner
from server.worker.setup import bring_up

log = logging.getLogger("flashpage.parallel")


def follow(runner: ModelRunner, conn: Connection) -> bool:
    """Run rank 0's forwards until Stop (True) or until its socket closes (False)."""
    with torch.inference_mode():
        while True:
            try:
                op = decode(conn.recv_bytes())
            except EOFError:
                return False
            if isinstance(op, Stop):
                return True
            words = np.frombuffer(op.words, dtype=np.int32)
            if isinstance(op, GraphStep):
                graphs = runner.verify_graphs if op.verify else runner.prefill_graphs if op.prefill else runner.graphs
                graphs.replay_exported(op.size, op.rows, op.width, words)
            else:
                _eager(runner, op, words)


def _eager(runner: ModelRunner, op: EagerStep, words: np.ndarray) -> None:
    """ModelRunner._eager's forward and LM-head calls, over rank 0's packed step."""
    step = step_inputs(runner.packer.load(words, op.spans), op.num_prefill_tokens, op.chunk_lens, op.chunk_prefix,
                       op.extra)
    hidden = runner.forward(runner.kv_caches, step.input_ids, step.positions, step.rows, sampled_ids=runner.last_ids)
    for lo, hi in op.head_slices:
        runner.model.lm_head(hidden[lo:hi])
    if len(step.ends):
        runner.model.lm_head(hidden[step.ends])


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C and docker's SIGTERM are for the API side,
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # which drains; rank 0 going away ends this one
    conn = Connection(int(argv[0]))
    start: Start = conn.recv()
    setup_logging(start.log_level, start.log_format)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="flashpage-tp-parent", daemon=True).start()
    try:
        os.environ.update(NCCL_ENV)
        config = start.config
        device = rank_device(config, start.rank)
        store = TCPStore("127.0.0.1", start.store_port, config.tensor_parallel_size, is_master=False)
        init_tensor_parallel(start.rank, config.tensor_parallel_size, store, device,
                             custom_all_reduce=not config.disable_custom_all_reduce)
        if device.type == "cpu":  # N ranks of C threads each on C cores would take turns at every collective
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
        torch.manual_seed(config.seed)
        worker = bring_up(config, Path(start.path), device)
        if follow(worker.runner, conn):  # Stop (else rank 0 is gone: nothing to leave)
            worker.runner.close()  # its graphs first: destroying the group while they live hangs
            close_tensor_parallel()
    except BaseException:
        log.exception("tensor-parallel rank %d failed", start.rank)
        try:
            conn.send(traceback.format_exc())
        except OSError:
            pass
        logging.shutdown()
        os._exit(1)
    logging.shutdown()
    os._exit(0)  # nothing to tear down: the device memory goes with the process
