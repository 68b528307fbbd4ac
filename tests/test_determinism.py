"""--full-determinism (utils/distributed.py full_determinism): what it sets, and that on the CPU it changes no number
of a run (CPU runs repeat bit for bit without it). Whether GPU runs then repeat bit for bit, and what it costs there,
is benchmarks/checks/gpu_smoke.py's check `determinism`."""

import json
import os
import subprocess
import sys

import pytest
import torch
from launch import read_metrics, run_dir, run_script, script_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = """
import json, os, sys, torch
from utils import distributed
distributed.full_determinism(sys.argv[1] == "on", on_gpu=sys.argv[2] == "gpu")
print(json.dumps({
    "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "vllm": os.environ.get("VLLM_BATCH_INVARIANT"),
    "deterministic": torch.are_deterministic_algorithms_enabled(),
    "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(), "benchmark": torch.backends.cudnn.benchmark,
}))
"""


@pytest.mark.launches
@pytest.mark.launches
@pytest.mark.parametrize("switch, hardware", [("on", "gpu"), ("on", "cpu"), ("off", "gpu")])
def test_the_switch_sets_what_bitwise_repeatable_gpu_runs_need(switch, hardware):
    """On: torch's deterministic algorithms (warnings, not errors, for an op without one), cuBLAS's fixed workspace,
    cudnn's benchmark off, and on a GPU vLLM's batch-invariant kernels; off: nothing at all."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG", "VLLM_BATCH_INVARIANT")}
    cmd = [sys.executable, "-c", PROBE, switch, hardware]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    if switch == "off":
        assert state == {"cublas": None, "vllm": None, "deterministic": False, "warn_only": False, "benchmark": False}
        return
    assert state["cublas"] == ":4096:8" and state["deterministic"] and state["warn_only"]
    assert state["vllm"] == ("1" if hardware == "gpu" else None)


def run_metrics(testbed, tmp_path, script, *extra) -> list:
    flags = script_flags(testbed, **{"total-steps": 2, "num-mini-batches": 2, "micro-batch-size": 4})
    run_script(script, [*flags, *extra], tmp_path)
    return [
        {k: v for k, v in row.items() if not k.startswith(("time/", "charts/tokens_per"))}
        for row in read_metrics(run_dir(tmp_path))
    ]


@pytest.mark.vllm
def test_the_switch_changes_no_number_on_the_cpu(testbed, tmp_path):
    """GSPO (its sequence sums by index_add, which the switch makes deterministic on CUDA) with and without the switch:
    every metric equal. Deterministic mode also fills memory that torch.empty leaves uninitialised (NaN for floats):
    a loss or metric that read such memory would differ here."""
    plain = run_metrics(testbed, tmp_path / "plain", "grpo_gspo.py")
    switched = run_metrics(testbed, tmp_path / "switched", "grpo_gspo.py", "--full-determinism")
    assert plain == switched
    assert not torch.are_deterministic_algorithms_enabled()  # the test process itself untouched
