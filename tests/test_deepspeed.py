"""The policy's DeepSpeed setup in the real DeepSpeed engine, 2 CPU ranks (gloo): ZeRO-3 loading straight into shards,
fp32 gradient accumulation and communication under the bf16 GPU config, overlap_comm with a reduce bucket smaller than
the embedding (tests/ds_probe.py)."""

import os
import subprocess
import sys

import pytest
from launch import ROOT, free_port

from utils.testbed import CPU_ENV


@pytest.mark.parametrize("mode, stage", [("load", 3), ("bf16", 2), ("bf16", 3), ("bucket", 2), ("bucket", 3)])
def test_deepspeed_setup(testbed, mode, stage):
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    cmd += [os.path.join(ROOT, "tests", "ds_probe.py"), mode, testbed.model_dir, str(stage)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CPU_ENV}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"OK {mode} zero-{stage}" in proc.stdout, proc.stderr[-3000:]
