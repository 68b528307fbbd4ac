"""benchmarks/checks/gpu_wheelhouse.sh, without network: what it downloads (TOP, WHEELS) and what it assumes the offline
GPU machine has (IMAGE) hold every distribution that the scripts, utils/ and the smoke test import on the --no-use-vllm
path, and every requirement of what it downloads (read from the installed CPU stack's metadata, markers evaluated for
CPython 3.12 on Linux x86_64); its pins are the CPU stack's, which CI tests."""

import ast
import glob
import importlib.metadata as md
import os
import re
import subprocess
import sys

from launch import ROOT
from packaging.markers import default_environment
from packaging.requirements import Requirement

SCRIPT = os.path.join(ROOT, "benchmarks", "checks", "gpu_wheelhouse.sh")
# what the smoke test runs without vLLM: the scripts, utils/, itself and the files it launches
PATH_FILES = ["grpo_*.py", "utils/*.py", "tests/inject.py"]
PATH_FILES += ["benchmarks/checks/gpu_smoke.py", "benchmarks/eval.py"]
PATH_FILES += [f"benchmarks/experiments/{name}.py" for name in ("bench_gpu", "bench_logprob_memory")]
OFF_PATH = {"vllm": "the vLLM checks and --use-vllm", "wandb": "--track"}  # imported only where these are asked for
TARGET = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
TARGET |= {"platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def shell_list(name: str) -> dict:
    """A bash array of the script (`NAME=(a b==1 ...)`) as {normalised name: pinned version or None}."""
    with open(SCRIPT) as f:
        (body,) = re.findall(rf"^{name}=\(([^)]*)\)", f.read(), re.M)
    return {norm(item.split("==")[0]): (item.split("==") + [None])[1] for item in body.split()}


def imported_modules() -> set:
    """Top-level modules imported anywhere in the files on the path (function-level imports included)."""
    ours = [glob.glob(os.path.join(ROOT, d, "*.py")) for d in ("", "utils", "benchmarks", "tests")]
    local = {os.path.splitext(os.path.basename(p))[0] for paths in ours for p in paths}
    modules = set()
    for pattern in PATH_FILES:
        for path in glob.glob(os.path.join(ROOT, pattern)):
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - local - {"utils", "benchmarks", "testbed"}


def requirements(dist: str) -> dict:
    """{normalised name: Requirement} that `dist` (installed) has on the target, extras not asked for."""
    reqs = [Requirement(r) for r in md.requires(dist) or []]
    return {norm(r.name): r for r in reqs if r.marker is None or r.marker.evaluate({**TARGET, "extra": ""})}


def test_every_imported_distribution_is_in_the_image_or_the_wheelhouse():
    have = set(shell_list("IMAGE")) | set(shell_list("TOP")) | set(shell_list("WHEELS"))
    owners = md.packages_distributions()
    modules = imported_modules()
    assert {"torch", "deepspeed", "tyro", "datasets", "math_verify", "safetensors"} <= modules  # the scan sees them
    missing = {m: owners.get(m) for m in modules - set(OFF_PATH) if not {norm(d) for d in owners.get(m, [])} & have}
    assert not missing, f"imported on the --no-use-vllm path, in neither IMAGE nor the wheelhouse: {missing}"


def test_the_wheelhouse_is_the_closure_of_its_top_packages_beyond_the_image():
    image, top, wheels = shell_list("IMAGE"), shell_list("TOP"), shell_list("WHEELS")
    reached, todo = set(), list(top)
    while todo:
        name = todo.pop()
        if name in reached or name in image:
            continue
        reached.add(name)
        todo += requirements(name)
    assert reached == set(top) | set(wheels), (
        f"needed but not downloaded: {sorted(reached - set(top) - set(wheels))}; "
        f"downloaded but not needed: {sorted((set(top) | set(wheels)) - reached)}"
    )
    pinned = {**top, **wheels}
    assert {n: md.version(n) for n in pinned} == pinned  # the CPU stack's versions, which CI runs


def test_bounds_are_image_packages_that_the_wheelhouse_bounds_and_their_pins_fit():
    image, bounds = shell_list("IMAGE"), shell_list("BOUNDS")
    reqs = [r for n in {**shell_list("TOP"), **shell_list("WHEELS")} for r in requirements(n).values()]
    for name, pinned in bounds.items():
        specs = [r.specifier for r in reqs if norm(r.name) == name and r.specifier]
        assert name in image and specs and all(s.contains(pinned) for s in specs), (name, pinned, specs)


def test_top_matches_requirements_txt_and_the_script_parses():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = dict(re.findall(r"^([\w.-]+)==([\w.]+)", f.read(), re.M))
    assert shell_list("TOP") == {n: pins[n] for n in shell_list("TOP")}
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
