"""benchmarks/checks/gpu_smoke.py --cpu, as on a GPU machine without vLLM and with it. Without: vLLM made unimportable
in every process (a sitecustomize on PYTHONPATH), the checks that need no vLLM pass (grpo_vanilla.py and grpo_cegppo.py
with its SFT term on the testbed with HF generate, the kernels against float64, benchmarks/eval.py, bench_gpu.py
--tiny, the long-context child's ZeRO-2/ZeRO-3 buffers and log-probs; not the other scripts' runs) and the vLLM ones
say it is not installed. With it: the vLLM checks that run on a CPU pass (the long-context child's gaps and push
cycles, rollout-ranks on 2 CPU processes), the GPU-only ones say so. The verdicts that only a GPU reaches (a bf16
inv_freq, the sleep-level advice, the memory a sleep frees, rollout-ranks' GPU count) on made-up inputs."""

import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from launch import CPU_ENV, ROOT

from benchmarks.checks import gpu_smoke

# the method runs (aent, klcov, clipcov) are vanilla-zero2's check on another script: the GPU machine runs them, the
# suite, which runs the scripts themselves elsewhere, does not (3 runs, ~45 CPU-s); cegppo-sft is run: its verdict is
# new (issue 57), and its crash was a GPU one
LONG_WITHOUT_VLLM = {"zero2-buffers", "zero3-buffers", "zero3-logprobs"}
WITHOUT_VLLM = {"logprob-kernel", "clamped-entropy", "vanilla-zero2", "zero3-save", "eval", "nan-step2", "bench"}
WITHOUT_VLLM |= {"cegppo-sft"} | LONG_WITHOUT_VLLM
LONG_VLLM = {"long-gap-zero2", "long-gap-zero3", "sleep-cycles0"}
LONG_GPU_ONLY = {"sleep-cycles1", "sleep-cycles2", "sleep-default"}
VLLM = {"train-sleep1", "train-sleep2", "train-sleep0", "train-v1runner-sleep1", "train-zero3-sleep1", "eval-vllm"}
VLLM |= {"memory-sleep", "push-sleep1", "push-sleep2", "push-sleep0", "rollout-ranks"} | LONG_VLLM | LONG_GPU_ONLY
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
    cmd = [sys.executable, "-m", "benchmarks.checks.gpu_smoke", "--cpu", "--out", str(out)]
    cmd += ["--work-dir", str(tmp_path / "w")]
    proc = subprocess.run([*cmd, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = proc.stdout.splitlines()
    checks = [line for line in lines if line.startswith(("PASS ", "FAIL ", "SKIP "))]
    status = {line.split()[1].rstrip(":"): line.split()[0] for line in checks}
    assert proc.returncode == 0 and "FAIL" not in status.values(), proc.stdout + proc.stderr[-3000:]
    assert len(status) == len(checks), checks  # one line per check
    assert all(re.search(r" \[\d+ s\]$", c) for c in checks if not c.startswith("SKIP")), checks  # each one's time
    assert out.read_text().splitlines() == lines  # everything printed is in --out too
    return lines, status


@pytest.mark.launches
def test_without_vllm_every_other_check_passes(tmp_path):
    groups = "kernels,vanilla-zero2,cegppo-sft,zero3-save,nan-step2,bench,long-context,rollout-ranks,train-sleep1"
    groups += ",train-sleep2,train-sleep0,train-v1runner-sleep1,train-zero3-sleep1,in-process"
    lines, status = smoke(tmp_path, hiding(tmp_path, "vllm"), "--checks", groups)
    assert status == {**dict.fromkeys(WITHOUT_VLLM, "PASS"), **dict.fromkeys(VLLM, "SKIP")}, lines
    assert all(line.endswith(": vLLM not installed") for line in lines if line.split()[1].rstrip(":") in VLLM)
    assert "vllm not importable" in lines[0] and lines[-1].startswith("SUMMARY: 11 passed, 0 failed, 17 skipped")
    buffers = [line for line in lines if line.split()[1].rstrip(":") in {"zero2-buffers", "zero3-buffers"}]
    assert all("model.rotary_emb.inv_freq float32" in line for line in buffers), buffers  # each buffer by name
    (sft,) = [line for line in lines if line.startswith("PASS cegppo-sft:")]
    assert re.search(r"cegppo/sft_nll [\d.e-]+, [\d.e-]+ \[", sft), sft  # both steps' SFT term
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
    # it, the suite trains ZeRO-2 with vLLM elsewhere); rollout-ranks on 2 CPU processes (1 trainer, 1 rollout rank)
    checks = "train-zero3-sleep1,in-process,bench,long-context,rollout-ranks"
    flags = ("--checks", checks, "--steps", "2", "--rollout-ranks-on-cpu")
    lines, status = smoke(tmp_path, {**os.environ, **CPU_ENV}, *flags)
    passed = (
        {"train-zero3-sleep1", "eval-vllm", "push-sleep0", "bench", "rollout-ranks"} | LONG_WITHOUT_VLLM | LONG_VLLM
    )
    gpu_only = {"memory-sleep", "push-sleep1", "push-sleep2"} | LONG_GPU_ONLY
    assert status == {**dict.fromkeys(passed, "PASS"), **dict.fromkeys(gpu_only, "SKIP")}, lines
    assert lines[0].startswith("hardware: CPU only") and "vllm 0." in lines[0] and "deepspeed " in lines[0]
    assert lines[-1].startswith("SUMMARY: 11 passed, 0 failed, 6 skipped")
    (cycles,) = [line for line in lines if line.startswith("PASS sleep-cycles0:")]
    assert "engine parameters equal to the trainer's after each push, engine awake" in cycles, cycles
    # the step moved the trainer's log-probs far beyond the gap: a missed push would have failed the cycle
    moved = re.search(r"moved the trainer's log-probs by ([\d.e-]+), ([\d.e-]+), ([\d.e-]+)", cycles)
    assert moved and min(float(x) for x in moved.groups()) > 100 * gpu_smoke.LONG_GAP["cpu"][0], cycles
    (rollout,) = [line for line in lines if line.startswith("PASS rollout-ranks:")]
    assert "vllm_logprob_gap " in rollout and "and > 10 x step 1" in rollout, rollout
    assert any(line.startswith("| vLLM generate (colocated)") for line in lines)  # bench_gpu.py's vLLM rows
    assert any(line.startswith("| sleep / wake / push cycle") and "n/a on CPU" in line for line in lines)


@pytest.mark.vllm
def test_the_head_dtype_and_determinism_checks_run_their_comparisons(tmp_path):
    """head-dtype (bf16 on the CPU: float32 heads' gap below bf16 heads') and determinism (two seeded runs with
    --full-determinism equal bit for bit, the cost against a run without) on the CPU, as the GPU will run them."""
    flags = ("--checks", "head-dtype,determinism", "--steps", "2")
    lines, status = smoke(tmp_path, {**os.environ, **CPU_ENV}, *flags)
    assert status == {"head-dtype": "PASS", "determinism": "PASS"}, lines
    (head,) = [line for line in lines if line.startswith("PASS head-dtype:")]
    assert re.search(r"float32: mean \|gap\| [\d.e-]+, max [\d.e-]+, mismatch KL [\d.e-]+, step [\d.]+ s", head), head
    (same,) = [line for line in lines if line.startswith("PASS determinism:")]
    assert "equal bit for bit (2 steps)" in same and "differ in 0 of 2 steps" in same, same  # the CPU: no change


@pytest.mark.launches
def test_a_missing_package_is_one_error_line_and_the_budget_skips_what_it_cannot_start(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.checks.gpu_smoke", "--cpu", "--out", str(tmp_path / "s.txt")]
    proc = subprocess.run(cmd, cwd=ROOT, env=hiding(tmp_path, "deepspeed"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout.splitlines() == [
        "error: not installed: deepspeed (deepspeed, tyro, datasets, math_verify: benchmarks/checks/gpu_wheelhouse.sh) "
        "(README: First GPU run)"
    ]
    cmd += ["--work-dir", str(tmp_path / "w"), "--budget", "0.001", "--checks", "vanilla-zero2,in-process"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CPU_ENV}, capture_output=True, text=True, timeout=120)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIP ")]
    assert proc.returncode == 0 and len(skipped) == 5, proc.stdout  # in-process makes 4 lines
    assert all("not started, the 0 s budget was spent (--checks " in line for line in skipped), skipped


def test_a_bf16_rotary_buffer_fails_the_buffer_check():
    """What zero3-buffers reports when ZeRO-3 loading changed inv_freq (issue 57): its dtype, or (an fp32 buffer that
    went through bf16 and back: DeepSpeed's keep_in_fp32 upcast) its value; a missing buffer; equal buffers pass."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    reference = {"model.rotary_emb.inv_freq": inv_freq}
    problems, text = gpu_smoke.buffer_mismatches(reference, {"model.rotary_emb.inv_freq": inv_freq.clone()})
    assert problems == [] and "1 buffers" in text and "model.rotary_emb.inv_freq float32 0e+00" in text
    (problem,) = gpu_smoke.buffer_mismatches(reference, {"model.rotary_emb.inv_freq": inv_freq.bfloat16()})[0]
    assert problem == "model.rotary_emb.inv_freq is bfloat16 (64,), not float32 (64,)"
    (problem,) = gpu_smoke.buffer_mismatches(reference, {"model.rotary_emb.inv_freq": inv_freq.bfloat16().float()})[0]
    error = float(re.search(r"off by ([\d.e-]+) of its largest value", problem).group(1))
    assert 1e-4 < error < 4e-3, problem  # bf16's rounding, far above BUFFER_RTOL
    assert gpu_smoke.buffer_mismatches(reference, {})[0] == ["model.rotary_emb.inv_freq missing"]


def test_the_sleep_level_advice():
    hw, ok, fail = "gpu", {0: True, 1: True, 2: True}, {0: True, 1: True, 2: False}
    keep, advice = gpu_smoke.sleep_advice({0: 0.02, 1: 0.02, 2: 0.03}, ok, hw)
    assert keep and advice.startswith("keep --vllm-sleep-level 2 (the default)"), advice
    # level 2 passes its own bounds but drifts from level 1's: level 1
    keep, advice = gpu_smoke.sleep_advice({0: 0.02, 1: 0.02, 2: 0.08}, ok, hw)
    assert not keep and advice.startswith("set --vllm-sleep-level's default to 1"), advice
    keep, advice = gpu_smoke.sleep_advice({0: 0.02, 1: 0.02, 2: math.inf}, fail, hw)  # level 2 raised
    assert not keep and advice.startswith("set --vllm-sleep-level's default to 1") and "level 2: worst" in advice
    keep, advice = gpu_smoke.sleep_advice({0: 0.02, 1: 0.5, 2: 0.5}, {0: True, 1: False, 2: False}, hw)
    assert not keep and advice.startswith("set --vllm-sleep-level's default to 0"), advice
    keep, advice = gpu_smoke.sleep_advice({0: 0.5, 1: 0.5, 2: 0.5}, {0: False, 1: False, 2: False}, hw)
    assert not keep and advice.startswith("no advice on the level"), advice


def test_memory_sleep_counts_the_weights_not_the_kv_cache():
    """memory-sleep on made-up bytes at the in-process check's size: a 40 GiB KV cache, 2.9 GiB of weights and the small
    pools every sleep frees and the first wake maps back. Its previous bound (all the sleep freed >= the weights)
    passed an engine that kept its weights, the KV cache alone being larger."""
    gib = gpu_smoke.GIB
    weights, kv, pools = int(2.9 * gib), 40 * gib, gib // 4
    verdict = gpu_smoke.memory_sleep_verdict
    ok, text = verdict(1, kv + pools + weights + 2**21, kv + pools, weights + 2**21, weights)  # both freed
    assert ok and "the KV cache's wake took back 40.25: 2.90 GiB left with the weights (2.90 GiB)" in text, text
    assert verdict(2, kv + pools + weights, kv + pools, weights, weights)[0]
    ok, text = verdict(1, kv + pools, kv + pools, 0, weights)  # the KV cache freed, the weights kept
    assert not ok and text.endswith("the weights, or part of them, stayed on the GPU"), text
    ok, text = verdict(2, kv + pools + weights // 2, kv + pools, weights // 2, weights)  # half of them kept
    assert not ok and text.endswith("stayed on the GPU"), text
    ok, text = verdict(1, kv + pools + weights, kv + pools, weights // 2, weights)  # freed, not mapped back
    assert not ok and text.endswith("their wake took back less than 90% of it"), text


class Engine:
    """vLLM's sleep and wake by tag, as free GPU memory: a 40 GiB KV cache, the weights (kept on the GPU if `keeps`)."""

    def __init__(self, weights: int, keeps: bool):
        self.sizes, self.keeps, self.free, self.asleep = (
            {"kv_cache": 40 * gpu_smoke.GIB, "weights": weights},
            keeps,
            0,
            [],
        )

    def sleep(self, level):
        self.asleep = ["kv_cache"] if self.keeps else ["kv_cache", "weights"]
        self.free += sum(self.sizes[t] for t in self.asleep)

    def wake_up(self, tags=None):
        for tag in [t for t in tags or list(self.sizes) if t in self.asleep]:
            self.asleep.remove(tag)
            self.free -= self.sizes[tag]


@pytest.mark.parametrize("keeps", [False, True])
def test_memory_sleep_reads_the_memory_a_tag_at_a_time(monkeypatch, keeps):
    """memory_sleep's readings (the GPU-only code around the verdict) on a stand-in engine: its line, and the trainer's
    weights pushed back once at the end."""
    from utils import vllm_engine

    pushed, lines, weights = [], [], 3 * gpu_smoke.GIB
    monkeypatch.setattr(vllm_engine, "push_weights", lambda policy, sampler, zero_stage: pushed.append(zero_stage))
    engine = Engine(weights, keeps)
    gpu_smoke.memory_sleep(engine, "policy", 2, weights, lambda label: engine.free, lines.append)
    assert pushed == [2] and engine.asleep == [] and len(lines) == 1, lines
    left = "0.00" if keeps else "3.00"
    assert lines[0].startswith(f"{'FAIL' if keeps else 'PASS'} memory-sleep: sleep 1 freed "), lines
    assert lines[0].count(f"the KV cache's wake took back 40.00: {left} GiB left with the weights (3.00 GiB)") == 2


def smoke_on(hw: str, gpus: int, on_cpu: bool = False):
    """What rollout_unavailable reads of a Smoke: the hardware, the GPU count, --rollout-ranks-on-cpu."""
    return SimpleNamespace(hw=hw, gpus=gpus, a=SimpleNamespace(rollout_ranks_on_cpu=on_cpu))


def test_rollout_ranks_runs_only_with_two_gpus():
    assert "torch.cuda.device_count() is 1" in gpu_smoke.rollout_unavailable(smoke_on("gpu", 1))
    assert gpu_smoke.rollout_unavailable(smoke_on("gpu", 2)) is None
    assert gpu_smoke.rollout_unavailable(smoke_on("cpu", 0)).startswith("GPU only, needs 2 GPUs")
    assert gpu_smoke.rollout_unavailable(smoke_on("cpu", 0, True)) is None


@pytest.mark.launches
def test_calibration_runs():
    cmd = [sys.executable, "-m", "benchmarks.checks.gpu_smoke", "--calibrate", "--cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CPU_ENV}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("calibration (LONG's CPU dims on cpu, 264 tokens")]
    values = [float(x) for x in re.findall(r"mean ([\d.e+-]+), max", line)]
    assert len(values) == 3 and all(0 < v < 1 for v in values), line
