"""Schema-driven fuzzing: schemathesis generates requests (valid and invalid) for every operation in
the server's own OpenAPI document and checks each response: no 5xx, a status code, content type,
headers and body that the document declares, and invalid requests rejected with a 4xx.

A real uvicorn server on loopback (tiny random checkpoint, context cut to 64 tokens so that any
generation is short); bounded to 50 examples per operation."""

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from benchmarks.shared.common import ServerProcess  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def fuzz_server(tiny_ckpt, tmp_path_factory):
    srv = ServerProcess.python_server(["--model", str(tiny_ckpt), "--device", "cpu", "--num-blocks", "32",
                                       "--max-model-len", "64", "--max-waiting-requests", "-1"],
                                      tmp_path_factory.mktemp("fuzz") / "server.log").wait_healthy(180)
    yield srv.url
    assert srv.stop(60) == 0


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_openapi_fuzz(case):
    case.call_and_validate(checks=CHECKS, timeout=30)
