"""benchmarks/shared/common.py's free_port: a bindable port, never the same one twice in a process,
from each pytest-xdist worker's own range, so that two servers never share one."""

import socket

import pytest

from benchmarks.shared import common


def test_free_port_never_repeats_and_skips_bound_ports(monkeypatch):
    monkeypatch.setattr(common, "_HANDED_OUT", set())
    monkeypatch.setattr(common, "PORT_BASE", 29990)  # (a range no test server takes)
    monkeypatch.setattr(common, "PORTS_PER_WORKER", 8)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 29993))  # taken by someone else: never handed out
        held.listen()
        ports = [common.free_port() for _ in range(7)]
        assert sorted(ports) == [29990, 29991, 29992, 29994, 29995, 29996, 29997]
        with pytest.raises(RuntimeError, match="no free loopback port"):
            common.free_port()


def test_free_ports_follow_the_xdist_worker(monkeypatch):
    monkeypatch.setattr(common, "_HANDED_OUT", set())
    for worker, lo in (("gw0", common.PORT_BASE), ("gw1", common.PORT_BASE + 1000), ("gw3", common.PORT_BASE + 3000)):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        ports = {common.free_port() for _ in range(20)}
        assert len(ports) == 20 and all(lo <= p < lo + common.PORTS_PER_WORKER for p in ports)
