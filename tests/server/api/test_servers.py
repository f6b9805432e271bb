"""Several API processes in front of one engine (server/api/servers.py). Served end to end, the
whole reliability suite runs with four API processes (tests/server/api/test_reliability.py: there
Ctrl+C to the process group is one drain, and an API process that dies is replaced while the others
serve on; tests/server/api/test_hardening.py kills one under load), and so do the metrics tests
(test_metrics.py) and the soak
(tests/benchmarks/test_soak.py); the engine side of several channels is tested in
tests/server/bridge/test_engine_loop.py."""

import pytest

from server.api.servers import default_api_server_count


def test_default_count_follows_the_cores():
    assert [default_api_server_count(c) for c in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 3, 4, 4]


@pytest.mark.parametrize("argv,words", [(["--api-server-count", "2", "--no-engine-process"], ["own process"])])
def test_several_processes_need_the_engine_process(argv, words, capsys):
    from server.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and all(w in capsys.readouterr().err for w in words)


def _exit_now(code: int) -> None:
    import os
    os._exit(code)


def test_dead_api_processes_are_restarted_within_a_budget_then_the_server_stops():
    """Issue 44, case 2: an API process that dies while the engine runs is replaced (the engine has
    aborted its requests); one that keeps dying stops the server with exit code 1."""
    import multiprocessing as mp
    import time

    from server.api.servers import RestartBudget, _supervise

    ctx = mp.get_context("fork")
    engine = ctx.Process(target=time.sleep, args=(3,))  # runs on, then exits as the engine would once stopped
    engine.start()
    restarted = []

    def restart(i, dead):
        assert dead.exitcode == 3
        restarted.append(i)
        p = ctx.Process(target=_exit_now, args=(3,), name=f"api-{i}")
        p.start()
        return p

    apis = [ctx.Process(target=_exit_now, args=(3,), name="api-0"), ctx.Process(target=time.sleep, args=(60,))]
    for p in apis:
        p.start()
    assert _supervise(apis, engine, [], patience=5, restart=restart, budget=RestartBudget(2, 60)) == 1
    assert restarted == [0, 0]  # two restarts in the window; the third death stopped the server
    budget = RestartBudget(2, 10)
    assert [budget.take(t) for t in (0, 1, 2, 5, 10.5)] == [True, True, False, False, True]
