"""Fixtures the API tests share: the official client on the module's `server` (a module may define
its own `client`), the model it serves, and the tool servers (the plain server the modules that only
send requests share is tests/conftest.py's `plain_server`)."""

import signal

import pytest

from benchmarks.shared.common import ServerProcess
from tests.helpers import openai_client


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


TOOL_SERVERS = {  # name -> (family of tests/server/api/tool_models.py, flags)
    "qwen2.5": ("qwen2.5", ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]),
    "qwen3": ("qwen3", ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3"]),
    "llama3.2": ("llama3.2", ["--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"]),
    "plain": ("llama3.2", []),  # no parser: required and named choices answer in plain JSON, auto is a 400
}


@pytest.fixture(scope="package")
def tool_ckpts(tmp_path_factory):
    """{family: checkpoint} of tests/server/api/tool_models.py."""
    from tests.server.api.tool_models import tool_checkpoint

    return {family: tool_checkpoint(family, tmp_path_factory.mktemp(family.replace(".", "")) / "ckpt")
            for family in sorted({f for f, _ in TOOL_SERVERS.values()})}


@pytest.fixture(scope="package")
def tool_servers(tool_ckpts):
    """{name: url}: random Qwen2.5-, Qwen3- and Llama-3.2-shaped checkpoints with their families' tool
    templates (tests/server/api/tool_models.py), served with their tool and reasoning parsers (and one
    with none), started together and shared by the tool, Responses and agent tests. Their engines
    step on a thread of the server process (--no-engine-process: one Python process each to start,
    not two): what these tests check is the API layer's, and the engine process is the other real
    servers' (test_reliability, test_metrics, test_adversarial, test_structured, ...)."""
    started = {name: ServerProcess.python_server(["--model", str(tool_ckpts[family]), "--device", "cpu", "--num-blocks",
                                                  "128", "--served-model-name", name, "--no-engine-process", *flags])
               for name, (family, flags) in TOOL_SERVERS.items()}
    try:
        yield {name: srv.wait_healthy(180).url for name, srv in started.items()}
    finally:
        for srv in started.values():
            srv.stop(30, sig=signal.SIGKILL)  # their graceful exit is test_reliability's to test
