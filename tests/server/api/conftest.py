"""Fixtures the OpenAI-API tests share: the official client on the module's `server` (a module
may define its own `client`), and the model it serves."""

import pytest

from tests.helpers import openai_client


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
