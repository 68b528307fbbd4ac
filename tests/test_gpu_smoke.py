"""benchmarks/gpu_smoke.py --cpu, as on a GPU machine without vLLM and with it. Without: vLLM made unimportable in every
process (a sitecustomize on PYTHONPATH), the checks that need no vLLM pass (grpo_vanilla.py on the testbed with HF
generate, the kernels against float64, benchmarks/eval.py, bench_gpu.py --tiny; not the other scripts' runs) and the
vLLM ones say it is not installed. With it: the vLLM checks that run on a CPU pass, the GPU-only ones say so."""

import os
import re
import subprocess
import sys

import pytest
from launch import CPU_ENV, ROOT

# the method runs (aent, klcov, clipcov) are vanilla-zero2's check on another script: the GPU machine runs them, the
# suite, which runs the scripts themselves elsewhere, does not (3 runs, ~45 CPU-s)
WITHOUT_VLLM = {"logprob-kernel", "clamped-entropy", "vanilla-zero2", "zero3-save", "eval", "nan-step2", "bench"}
VLLM = {"train-sleep1", "train-sleep2", "train-sleep0", "train-v1runner-sleep1", "train-zero3-sleep1", "eval-vllm"}
VLLM |= {"memory-sleep", "push-sleep1", "push-sleep2", "push-sleep0"}
HIDE = """import importlib.abc
import sys


class Hide(importlib.abc.MetaPathFinder):  # `import {name}` fails as if it were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "{name}" or name.startswith("{name}."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)


sys.meta_path.insert(0, Hide())
"""


def hiding(tmp_path, module: str) -> dict:
    """The CPU test environment with `module` unimportable in every Python process started with it."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE.format(name=module))
    env = {**os.environ, **CPU_ENV, "PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    hidden = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)
    assert hidden.returncode == 1 and f"ModuleNotFoundError: No module named '{module}'" in hidden.stderr
    return env


def smoke(tmp_path, env, *flags):
    """Run gpu_smoke.py --cpu: (stdout lines, {check: status}), after checking one line per check and the --out file."""
    out = tmp_path / "smoke.txt"
    cmd = [sys.executable, "benchmarks/gpu_smoke.py", "--cpu", "--out", str(out), "--work-dir", str(tmp_path / "w")]
    proc = subprocess.run([*cmd, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = proc.stdout.splitlines()
    checks = [line for line in lines if line.startswith(("PASS ", "FAIL ", "SKIP "))]
    status = {line.split()[1].rstrip(":"): line.split()[0] for line in checks}
    assert proc.returncode == 0 and "FAIL" not in status.values(), proc.stdout + proc.stderr[-3000:]
    assert len(status) == len(checks), checks  # one line per check
    assert all(re.search(r" \[\d+ s\]$", c) for c in checks if not c.startswith("SKIP")), checks  # each one's time
    assert out.read_text().splitlines() == lines  # everything printed is in --out too
    return lines, status


def test_without_vllm_every_other_check_passes(tmp_path):
    groups = "kernels,vanilla-zero2,zero3-save,nan-step2,bench,train-sleep1,train-sleep2,train-sleep0"
    groups += ",train-v1runner-sleep1,train-zero3-sleep1,in-process"
    lines, status = smoke(tmp_path, hiding(tmp_path, "vllm"), "--checks", groups)
    assert status == {**dict.fromkeys(WITHOUT_VLLM, "PASS"), **dict.fromkeys(VLLM, "SKIP")}, lines
    assert all(line.endswith(": vLLM not installed") for line in lines if line.split()[1].rstrip(":") in VLLM)
    assert "vllm not importable" in lines[0] and lines[-1].startswith("SUMMARY: 7 passed, 0 failed, 10 skipped")
    runs = [line for line in lines if line.split()[1].rstrip(":") in {"vanilla-zero2", "zero3-save"}]
    assert all("gradients accumulated in float32 buffers and reduced in float32" in line for line in runs), runs
    rows = {r[0]: r for r in ([c.strip() for c in x.strip("|").split("|")] for x in lines if x.startswith("| "))}
    assert rows["vLLM"][1] == "not installed"  # bench_gpu.py's table, without its vLLM rows
    assert float(rows["training step (ZeRO-2, grad. checkpointing)"][1].split()[0].replace(",", "")) > 0, rows
    mixed = [r for k, r in rows.items() if k.startswith("training step, mixed lengths: packed")]
    assert len(mixed) == 1 and "padding 0%" in mixed[0][2], rows


@pytest.mark.vllm
def test_with_vllm_the_cpu_runnable_vllm_checks_pass(tmp_path):
    # the others ran without vLLM above; train-sleep1 is train-zero3-sleep1's check under ZeRO-2 (the GPU machine runs
    # it, the suite trains ZeRO-2 with vLLM elsewhere)
    checks = "train-zero3-sleep1,in-process,bench"
    lines, status = smoke(tmp_path, {**os.environ, **CPU_ENV}, "--checks", checks, "--steps", "2")
    passed = {"train-zero3-sleep1", "eval-vllm", "push-sleep0", "bench"}
    gpu_only = {"memory-sleep", "push-sleep1", "push-sleep2"}
    assert status == {**dict.fromkeys(passed, "PASS"), **dict.fromkeys(gpu_only, "SKIP")}, lines
    assert lines[0].startswith("hardware: CPU only") and "vllm 0." in lines[0] and "deepspeed " in lines[0]
    assert lines[-1].startswith("SUMMARY: 4 passed, 0 failed, 3 skipped")
    assert any(line.startswith("| vLLM generate (colocated)") for line in lines)  # bench_gpu.py's vLLM rows
    assert any(line.startswith("| sleep / wake / push cycle") and "n/a on CPU" in line for line in lines)


def test_a_missing_package_is_one_error_line_and_the_budget_skips_what_it_cannot_start(tmp_path):
    cmd = [sys.executable, "benchmarks/gpu_smoke.py", "--cpu", "--out", str(tmp_path / "s.txt")]
    proc = subprocess.run(cmd, cwd=ROOT, env=hiding(tmp_path, "deepspeed"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout.splitlines() == [
        "error: not installed: deepspeed (deepspeed, tyro, datasets, math_verify: benchmarks/gpu_wheelhouse.sh) "
        "(README: First GPU run)"
    ]
    cmd += ["--work-dir", str(tmp_path / "w"), "--budget", "0.001", "--checks", "vanilla-zero2,in-process"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CPU_ENV}, capture_output=True, text=True, timeout=120)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIP ")]
    assert proc.returncode == 0 and len(skipped) == 5, proc.stdout  # in-process makes 4 lines
    assert all("not started, the 0 s budget was spent (--checks " in line for line in skipped), skipped
