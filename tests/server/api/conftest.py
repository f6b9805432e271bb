"""Fixtures the API tests share: one plain server for the modules that only send it requests, the
official client on the module's `server` (a module may define its own `client`), and the model it
serves."""

import pytest

from benchmarks.common import ServerProcess
from tests.helpers import openai_client


@pytest.fixture(scope="package")
def plain_server(tiny_ckpt):
    """`python -m server` on the tiny checkpoint with 64 KV blocks and nothing else set, shared by
    test_http, test_openai and test_chat's `bare`: they started three identical servers (~7 s of CPU
    each), and none of them changes what the others see (every request is its own; outputs do not
    depend on what ran before, which the prefix-cache tests check). Its graceful exit is still
    checked, once, when the package's tests are done."""
    srv = ServerProcess.python_server(["--model", str(tiny_ckpt), "--num-blocks", "64"]).wait_healthy(120)
    yield srv.url
    srv.stop(30, must_exit=True)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
