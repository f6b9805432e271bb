"""ModelRunner's life under tensor parallelism: an engine never closed still closes at exit, its CUDA
graphs before the group (NCCL's destroy hangs while they live), and a closed one is not kept alive."""

from __future__ import annotations

import gc

from server.worker import runner as runner_module
from server.worker.runner import ModelRunner, close_at_exit


class _Peers:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_attach_peers_closes_the_runner_at_exit_graphs_first_and_holds_it_weakly(monkeypatch):
    handlers = []
    monkeypatch.setattr(runner_module.atexit, "register", lambda fn, *args: handlers.append((fn, args)))
    runner = ModelRunner.__new__(ModelRunner)  # the fields close() reads, no model
    runner.graphs = runner.prefill_graphs = runner.choice_graphs = runner.verify_graphs = object()
    runner.kv_caches, runner.grammar, runner.on_cuda = [object()], None, False
    peers = _Peers()
    runner.attach_peers(peers)
    assert runner.peers is peers and len(handlers) == 1
    fn, args = handlers[0]
    seen = []

    def group_close(r=runner):  # what the group's close finds
        seen.append((r.graphs, r.kv_caches))

    peers.close = group_close
    fn(*args)  # the process exits with the engine never closed
    assert seen == [(None, [])] and runner.peers is None

    ref = args[0]
    del runner, fn, args, handlers[:], peers, group_close
    gc.collect()
    assert ref() is None  # the handler did not keep it: a closed engine's weights can be freed
    close_at_exit(ref)  # and at exit, a runner already gone is nothing to close
