"""make test-fast's selection and tests/conftest.py's guard, on a throwaway test file run by pytest as make test-fast
runs it: an unmarked test that launches a script, a Python process or vLLM fails with the line that says to mark it
(also when it catches the error), a marked one is left out, one that starts no Python runs."""

import os
import re
import subprocess
import sys

import conftest
from launch import ROOT

from testbed.common import CPU_ENV

CASES = """
import os, subprocess, sys
import pytest
from launch import run_script, script_flags
from testbed.common import CPU_ENV


def test_runs_a_script(testbed, tmp_path):
    run_script("grpo_vanilla.py", script_flags(testbed), tmp_path)


def test_starts_python_and_hides_the_error():
    try:
        subprocess.run([sys.executable, "-c", "pass"], env={**os.environ, **CPU_ENV})
    except RuntimeError:
        pass


def test_starts_vllm():
    import vllm  # noqa: F401


def test_starts_no_python():
    subprocess.run(["git", "--version"], capture_output=True, check=True)


@pytest.mark.launches
def test_marked():
    pytest.fail("a marked test ran")


@pytest.mark.vllm
def test_marked_vllm():
    pytest.fail("a vllm test ran")
"""


def test_a_launching_test_is_left_out_or_fails_with_the_line_to_mark_it(tmp_path, monkeypatch):
    selection = re.search(r'^test-fast:.*\n\t.* -m "([^"]+)"', open(os.path.join(ROOT, "Makefile")).read(), re.M)
    (tmp_path / "test_cases.py").write_text(CASES)
    monkeypatch.setitem(conftest.guard, "test", None)  # the one Python process the fast tier starts on purpose
    env = {**os.environ, **CPU_ENV, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])}
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rf"]
    cmd += ["-m", selection.group(1), "test_cases.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert out.strip().splitlines()[-1].startswith("3 failed, 1 passed, 2 deselected"), out[-3000:]
    for name, what in [
        ("test_runs_a_script", r"\S*grpo_vanilla.py --output-dir"),
        ("test_starts_python_and_hides_the_error", re.escape(sys.executable) + " -c pass"),
        ("test_starts_vllm", "vLLM"),
    ]:
        failure = out.split(f" {name} _")[1].split("\n_")[0]  # its section of the report
        assert re.search(rf"this test launches {what}.* \(in its body\): mark it @pytest.mark.launches", failure), out
