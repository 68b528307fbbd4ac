"""Colocated engines against a rollout rank of its own (--rollout-ranks 1) at --max-staleness 0 and 1, on a CPU.

    python -m benchmarks.experiments.bench_rollout_ranks        # 2 processes each: 12 steps, 3 repeats, alternating
    python -m benchmarks.experiments.bench_rollout_ranks --steps 6 --repeats 1  # a quick look

The workload of bench_trl.py --varlen: a random Qwen2 that stops (perf_common.random_qwen2_varlen), responses of 64
tokens on average and at most 256, lengths close to geometric (a long tail); the testbed's first prompts, 4 per step x
8 samples, 2 optimizer updates per step (so every variant runs the same log-prob pass, which s > 0 needs), vLLM. Each
variant is 2 processes on the machine's cores (OMP_NUM_THREADS=1):
- colocated: 2 ranks, each training and generating with its own engine, one after the other;
- s0: 1 trainer and 1 rollout rank, the trainer waiting for each batch (no overlap);
- s1: the same, the next batch generated while the trainer trains (one-step-off-policy).
Every repeat of a variant does the same work (seeded samples; s1's differ from the others' after step 1: they come
from older weights). Per step: time/step (median over the repeats, then over the counted steps), the trainers' wait
for their batch (time/rollout_wait) and the rollout rank's seconds generating and grading it (time/generation +
time/reward); hidden = 1 - wait / (generation + grading), the share of the rollout rank's work done while the trainer
trained. Ratios are step times against colocated.
"""

import argparse
import os
import sys
import tempfile

from benchmarks.experiments.perf_common import (
    ROOT,
    median,
    prompt_file,
    random_qwen2_varlen,
    read_metrics,
    run_measured,
    tail,
)
from testbed.ports import free_port

VARIANTS = {"colocated": [], "s0": ["--rollout-ranks", "1"], "s1": ["--rollout-ranks", "1", "--max-staleness", "1"]}


def command(a, variant: str, out: str) -> list:
    flags = {
        "model-name-or-path": a.model,
        "dataset": a.prompts,
        "output-dir": out,
        "total-steps": a.steps,
        "num-prompts-per-step": 4,
        "group-size": 8,
        "max-prompt-length": 128,
        "max-response-length": a.max_response_length,
        "num-mini-batches": 2,
        "micro-batch-size": 8,
        "learning-rate": 1e-5,
        "save-every": 0,
        "eval-every": 0,
        "grading-workers": 1,
    }
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    cmd = [*launcher, os.path.join(ROOT, "grpo_vanilla.py"), "--no-gradient-checkpointing", *VARIANTS[variant]]
    for k, v in flags.items():
        cmd += [f"--{k}", str(v)]
    return cmd


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run not counted")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-response-length", type=int, default=256)
    p.add_argument("--mean-response-length", type=float, default=64)
    a = p.parse_args()
    a.model = random_qwen2_varlen(a.max_response_length, a.mean_response_length)
    work = tempfile.mkdtemp(prefix="bench_rollout_ranks_")
    a.prompts = prompt_file(max(64, 4 * a.steps), os.path.join(work, "prompts.jsonl"))
    steps = {v: [] for v in VARIANTS}  # per repeat: the counted steps' metrics
    for r in range(a.repeats):
        for v in VARIANTS:
            out = os.path.join(work, f"{v}_{r}")
            run = run_measured(command(a, v, out), {}, out + ".log")
            if run["rc"] != 0:
                raise SystemExit(f"error: {v} exited {run['rc']}:\n{tail(run['log'])}")
            steps[v].append(read_metrics(out)[a.warmup :])
            print(f"repeat {r + 1} {v}: {run['wall']:.0f} s", flush=True)

    def per_step(v, key):  # each counted step's median over the repeats
        return [median([rep[i][key] for rep in steps[v]]) for i in range(len(steps[v][0]))]

    print(
        f"\n{a.steps} steps ({a.warmup} not counted) x {a.repeats} repeats; 4 prompts x 8 samples, responses of mean "
        f"{a.mean_response_length:g} and at most {a.max_response_length} tokens, 2 updates per step; 2 processes each"
    )
    print("| variant | s/step | vs colocated | generation + grading s | trainer wait s | hidden |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = median(per_step("colocated", "time/step"))
    for v in VARIANTS:
        step = median(per_step(v, "time/step"))
        work_s = median([g + w for g, w in zip(per_step(v, "time/generation"), per_step(v, "time/reward"))])
        wait, hidden = "-", "-"  # colocated ranks wait for no one: they generate themselves
        if v != "colocated":
            seconds = median(per_step(v, "time/rollout_wait"))
            wait, hidden = f"{seconds:.2f}", f"{1 - seconds / work_s:.2f}"
        print(f"| {v} | {step:.2f} | {step / base:.2f} | {work_s:.2f} | {wait} | {hidden} |")


if __name__ == "__main__":
    main()
