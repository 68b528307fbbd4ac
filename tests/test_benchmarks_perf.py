"""The performance benchmarks run and print well-formed tables (correctness only: timings are not checked)."""
import os
import re
import subprocess
import sys

from launch import CPU_ENV, ROOT, free_port


def run_benchmark(args, timeout=120):
    env = {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def table_rows(out: str) -> list:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("|") and "---" not in line]


def test_bench_gpu_tiny_runs_on_cpu():
    out = run_benchmark(["benchmarks/bench_gpu.py", "--tiny", "--no-vllm"])
    rows = {r[0]: r for r in table_rows(out)}
    train = rows["training step (ZeRO-2, grad. checkpointing)"]
    assert float(train[1].split()[0].replace(",", "")) > 0
    assert any(k.startswith("log-prob + entropy pass") for k in rows)
    assert float(rows["HF generate"][1].split()[0].replace(",", "")) > 0


def test_bench_logprob_memory_agrees_with_naive():
    out = run_benchmark(["benchmarks/bench_logprob_memory.py", "--tokens", "64", "256", "--hidden", "32", "--vocab",
                         "1024", "--chunk-size", "32", "--check-tokens", "96", "--in-process"])
    rows = table_rows(out)
    assert rows[0][0] == "tokens" and [r[0] for r in rows[1:]] == ["64", "256"]
    for row in rows[1:]:
        assert len(row) == 7 and float(row[1]) >= 0 and float(row[4]) >= 0 and float(row[5]) >= 0
    diffs = re.search(r"log-prob (\S+), entropy (\S+), hidden grad (\S+), head grad (\S+)", out).groups()
    assert all(float(d) < 1e-4 for d in diffs), diffs
    assert "agree to 1e-3: yes" in out


def test_bench_logprob_memory_skips_over_budget():
    out = run_benchmark(["benchmarks/bench_logprob_memory.py", "--tokens", "64", "4096", "--hidden", "32", "--vocab",
                         "1024", "--chunk-size", "32", "--check-tokens", "64", "--in-process", "--max-gb", "0.001"])
    (row,) = [r for r in table_rows(out) if r[0] == "4096"]
    assert row[2].startswith("skipped: estimated")
