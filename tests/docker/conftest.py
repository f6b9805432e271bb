"""Fixtures for the deployment tests: the external tools they run and a clean environment.

A tool that is missing (hadolint, docker-compose, nginx) skips its test on a developer's machine and
fails it in CI (CI=true), where .ci/run installs them.
"""

import os
import shutil

import pytest


def need_tool(*names: str) -> str:
    """The path of the first of `names` on PATH; skip (fail in CI) when there is none."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    message = f"{' / '.join(names)} is not installed (.ci/run installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def tool():
    return need_tool


def clean_env(**overrides: str) -> dict:
    """This process's environment without any FLASHPAGE_* variable, plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHPAGE_")}
    env.update(overrides)
    return env


@pytest.fixture(scope="session")
def environment():
    return clean_env
