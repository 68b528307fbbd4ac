"""Shared fixtures: the CPU testbed (built once per machine, cached; see utils/testbed.py)."""
import pytest

from utils.testbed import build_testbed


@pytest.fixture(scope="session")
def testbed():
    return build_testbed()
