"""The policy's DeepSpeed setup in the real DeepSpeed engine, 2 CPU ranks (gloo): ZeRO-3 loading straight into shards,
fp32 gradient accumulation and communication under the bf16 GPU config, overlap_comm with a reduce bucket smaller than
the embedding (tests/ds_probe.py); the config's dtype and ZeRO-3 persistence by device."""

import os

import pytest
import torch
from launch import ROOT, free_port, run_python

from grpo_vanilla import Args
from testbed.common import CPU_ENV
from utils import models
from utils.engine import make_args


@pytest.mark.launches
@pytest.mark.parametrize("stage, modes", [(3, "load,bf16,bucket"), (2, "bf16,bucket")])
def test_deepspeed_setup(testbed, stage, modes):
    """Each ZeRO stage's checks in one pair of ranks, one after the other (ds_probe.py: `load` runs first)."""
    cmd = [os.path.join(ROOT, "tests", "ds_probe.py"), modes, testbed.model_dir, str(stage)]
    proc = run_python(cmd, {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port())}, nproc=2, timeout=300)
    passed = [f"OK {mode} zero-{stage}" for mode in modes.split(",")]
    done = [line for line in proc.stdout.splitlines() if line.startswith("OK ")]
    assert proc.returncode == 0 and done == passed, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float32"])
def test_config_by_device(dtype):
    """--dtype: auto is bf16 on GPUs and fp32 on the CPU, the bf16 flag follows the weights' dtype; ZeRO-3 partitions
    every parameter on the CPU only (the tiny test models), a GPU keeps DeepSpeed's persistence threshold."""
    args = make_args(Args, zero_stage=3, dtype=dtype)  # the field the scripts' --dtype sets
    for on_gpu in (False, True):
        expected = torch.bfloat16 if dtype == "bfloat16" or (dtype == "auto" and on_gpu) else torch.float32
        config = models.deepspeed_config(args, on_gpu, 1)
        assert models.train_dtype(args, on_gpu) == expected
        assert config["bf16"]["enabled"] == (expected == torch.bfloat16)
        assert ("stage3_param_persistence_threshold" in config["zero_optimization"]) == (not on_gpu)
    assert models.train_dtype(Args(), True) == torch.bfloat16 and models.train_dtype(Args(), False) == torch.float32
