"""The performance benchmarks run and print well-formed tables (correctness only: timings are not checked)."""

import json
import os
import re
import subprocess
import sys

import pytest
from launch import CPU_ENV, ROOT, free_port, run_python

pytestmark = pytest.mark.launches  # every test here launches a run (conftest.py)


def run_benchmark(args, timeout=120):
    env = {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port())}
    proc = run_python(args, env, timeout=timeout)
    assert proc.returncode == 0, f"{args[1]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def table_rows(out: str) -> list:
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("|") and "---" not in line
    ]


def test_bench_logprob_memory_agrees_with_naive():
    out = run_benchmark(
        [
            "-m",
            "benchmarks.experiments.bench_logprob_memory",
            "--tokens",
            "64",
            "256",
            "--hidden",
            "32",
            "--vocab",
            "1024",
            "--chunk-size",
            "32",
            "--check-tokens",
            "96",
            "--in-process",
        ]
    )
    rows = table_rows(out)
    assert rows[0][0] == "tokens" and [r[0] for r in rows[1:]] == ["64", "256"]
    for row in rows[1:]:
        assert len(row) == 7 and float(row[1]) >= 0 and float(row[4]) >= 0 and float(row[5]) >= 0
    diffs = re.search(r"log-prob (\S+), entropy (\S+), hidden grad (\S+), head grad (\S+)", out).groups()
    assert all(float(d) < 1e-4 for d in diffs), diffs
    assert "agree to 1e-3: yes" in out


def test_bench_logprob_memory_skips_over_budget():
    out = run_benchmark(
        [
            "-m",
            "benchmarks.experiments.bench_logprob_memory",
            "--tokens",
            "64",
            "4096",
            "--hidden",
            "32",
            "--vocab",
            "1024",
            "--chunk-size",
            "32",
            "--check-tokens",
            "64",
            "--in-process",
            "--max-gb",
            "0.001",
        ]
    )
    (row,) = [r for r in table_rows(out) if r[0] == "4096"]
    assert row[2].startswith("skipped: estimated")


def test_heap_probe_sees_live_tensors_and_growing_types(tmp_path):
    """heap_probe.py runs a script with its probe beside it: a script that keeps allocating shows up in live tensors
    and in the types that grew; the probe's malloc_trim never raises RSS (give or take the script's own allocations)."""
    script = tmp_path / "grow.py"
    script.write_text(
        "import time, torch\n"
        "class Kept: pass\n"
        "kept = []\n"
        "for _ in range(30):\n"
        "    kept.append((torch.ones(256, 1024), Kept()))  # 1 MB and one object per 0.1 s\n"
        "    time.sleep(0.1)\n"
    )
    out = tmp_path / "probe.jsonl"
    env = {**os.environ, **CPU_ENV, "HEAP_PROBE_OUT": str(out), "HEAP_PROBE_INTERVAL": "0.5"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.experiments.heap_probe", str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 3
    assert rows[-1]["tensor_mb"] - rows[0]["tensor_mb"] >= 1 and rows[-1]["tensors"] > rows[0]["tensors"]
    assert rows[-1]["grown_types"].get("Kept", 0) >= 2
    assert all(r["rss_after_trim_mb"] <= r["rss_mb"] + 3 and r["malloc_in_use_mb"] > 0 for r in rows)


def test_bench_trl_varlen_ours_packed_vs_fixed():
    """bench_trl.py --varlen on ours only (TRL is not a requirement): the calibrated model stops (mean length below
    the maximum), the same seeded samples in both variants, no padding packed, padding with fixed micro-batches."""
    out = run_benchmark(
        [
            "-m",
            "benchmarks.experiments.bench_trl",
            "--varlen",
            "--max-response-length",
            "64",
            "--num-prompts",
            "1",
            "--group-size",
            "8",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--max-tokens-per-micro-batch",
            "256",
            "--variants",
            "ours-hf",
            "ours-hf-packed",
        ],
        timeout=240,
    )
    rows = {r[0]: r for r in table_rows(out)}
    fixed, packed = rows["ours-hf"], rows["ours-hf-packed"]
    assert fixed[3] == packed[3]  # real tokens per step: the same samples
    assert float(packed[6]) == 0 and float(fixed[6]) > 0  # padding fraction
    means = [float(m) for m in re.findall(r"- ours-hf\S*: 2 steps x 8 samples: mean ([\d.]+)", out)]
    assert len(means) == 2 and means[0] == means[1] and 2 <= means[0] < 48, out
