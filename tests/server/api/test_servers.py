"""Several API processes in front of one engine (server/api/servers.py). Served end to end, the
whole reliability suite runs with four API processes (tests/server/api/test_reliability.py: there
Ctrl+C to the process group is one drain, and an API process that dies takes the server down with
exit code 1, leaving no process behind), and so do the metrics tests (test_metrics.py) and the soak
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
