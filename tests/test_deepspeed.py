"""The policy's DeepSpeed setup in the real DeepSpeed engine, 2 CPU ranks (gloo): ZeRO-3 loading straight into shards,
fp32 gradient accumulation and communication under the bf16 GPU config, overlap_comm with a reduce bucket smaller than
the embedding (tests/ds_probe.py)."""

import os

import pytest
from launch import ROOT, free_port, run_python

from utils.testbed import CPU_ENV


@pytest.mark.parametrize("stage, modes", [(3, "load,bf16,bucket"), (2, "bf16,bucket")])
def test_deepspeed_setup(testbed, stage, modes):
    """Each ZeRO stage's checks in one pair of ranks, one after the other (ds_probe.py: `load` runs first)."""
    cmd = [os.path.join(ROOT, "tests", "ds_probe.py"), modes, testbed.model_dir, str(stage)]
    proc = run_python(cmd, {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port())}, nproc=2, timeout=300)
    passed = [f"OK {mode} zero-{stage}" for mode in modes.split(",")]
    done = [line for line in proc.stdout.splitlines() if line.startswith("OK ")]
    assert proc.returncode == 0 and done == passed, proc.stdout[-2000:] + proc.stderr[-3000:]
