"""Shared fixtures: the CPU testbed (built once per machine, cached; see testbed/build_arithmetic.py), the uninterrupted
runs of the fault tests; the `launches` marker and its guard (make test-fast)."""

import multiprocessing.util
import os
import sys

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
    for item in items:  # these launch by definition: make test-fast's -m "not launches" leaves them out
        if item.get_closest_marker("vllm") or item.get_closest_marker("bf16_all"):
            item.add_marker("launches")
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "vllm: starts the real vLLM-CPU engine (select with -m vllm, skip with -m 'not vllm')"
    )
    config.addinivalue_line("markers", "bf16_all: the bf16 rehearsal of every method file (make test-bf16)")
    config.addinivalue_line(
        "markers", "launches: starts a Python process or vLLM (make test-fast skips it with -m 'not launches')"
    )


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


# make test-fast runs the tests without the `launches` marker. The marker is set by hand (on the test, or as its
# module's pytestmark; vllm and bf16_all imply it), and this guard keeps it honest in every tier: an unmarked test that
# starts a Python process (python, torchrun, deepspeed, multiprocessing's spawn; tests/launch.py's runs and fork
# server) or imports vLLM fails with the line that says to mark it, even if it catches the error. An automatic marker
# (from the fixtures a test uses) would miss the run_script calls in test bodies, and a guard that skipped would let a
# misfiled test pass unseen.
LAUNCHERS = ("python", "torchrun", "deepspeed")
SHELLS = ("bash", "sh", "make")  # they may start Python out of the guard's sight: a launch unless -n or DRY_RUN=1
guard = {"test": None, "launched": None}  # the unmarked test now running; what it launched


def launched(event, args):
    """What an audit event launches (a command line, or vLLM), else None."""
    if event == "import":
        return "vLLM" if args[0] == "vllm" else None
    command, env = (args[0], None) if event in ("os.system", "tests.launch") else (args[1], args[-1])
    words = os.fsdecode(command).split() if isinstance(command, (str, bytes)) else [os.fsdecode(w) for w in command]
    program = os.path.basename(words[0])
    dry = "-n" in words[1:2] or (os.environ if env is None else env).get("DRY_RUN") == "1"
    if event == "tests.launch" or program.startswith(LAUNCHERS) or (program in SHELLS and not dry):
        return " ".join(words)[:200]
    return None


def audit(event, args):
    events = ("subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "tests.launch", "import")
    if guard["test"] is not None and event in events and (what := launched(event, args)):
        guard["launched"] = guard["launched"] or what
        raise RuntimeError(f"{guard['test']} launches {what}: mark it @pytest.mark.launches")


sys.addaudithook(audit)  # for the life of the process (a hook cannot be removed), on only while an unmarked test runs
spawnv_passfds = multiprocessing.util.spawnv_passfds


def spawn(path, args, passfds):
    """multiprocessing's start of a Python process (spawn, forkserver): it raises no audit event of its own."""
    sys.audit("tests.launch", args)
    return spawnv_passfds(path, args, passfds)


multiprocessing.util.spawnv_passfds = spawn


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    guard.update(test=None if item.get_closest_marker("launches") else item.nodeid, launched=None)
    try:
        return (yield)
    finally:
        guard.update(test=None, launched=None)


def fail_if_launched(where):
    if guard["launched"]:
        what, guard["launched"] = guard["launched"], None
        message = f"this test launches {what} ({where}): mark it @pytest.mark.launches"
        raise pytest.fail.Exception(message, pytrace=False) from None  # one line, not the guard's error before it


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    try:
        return (yield)
    finally:
        fail_if_launched("in a fixture")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    finally:
        fail_if_launched("in its body")
