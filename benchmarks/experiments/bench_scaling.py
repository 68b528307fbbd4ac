"""How a training step's time grows as the group size and the response length double (1x, 2x, 4x), phase by phase.

    python -m benchmarks.experiments.bench_scaling             # grpo_vanilla.py, colocated vLLM-CPU engine
    python -m benchmarks.experiments.bench_scaling --no-use-vllm --script grpo_aent.py

Each setting runs the script once as a subprocess on one process for --steps steps (the first --warmup not counted)
and reports the median of each phase from its runs/<run>/metrics.jsonl: time/generation, time/logprob,
time/training, time/weight_push, time/step, with the ratio of the step time to the 1x setting.
Settings: the base (--num-prompts prompts x --group-size G x --max-response-length L), then G x2, x4 (L fixed) and
L x2, x4 (G fixed); --micro-batch-size stays fixed, so more sequences mean more micro-batches.
Model: the testbed policy ends its answers after ~32 tokens, so its response length cannot be scaled. Instead this
uses a random-weights Qwen2 on the testbed tokenizer whose head never favours eos (perf_common.random_qwen2: 3.36M
parameters, eos probability ~1e-5 per token): every response runs to the cap, so L is exactly the response length
(the table shows the measured mean, rollout/response_length). Rewards are all 0 with it (nothing to learn), which
changes no amount of work: every token still goes through the log-prob pass, the loss and the backward pass.
"""

import argparse
import os
import sys
import tempfile

from benchmarks.experiments.perf_common import (
    PHASES,
    ROOT,
    median,
    prompt_file,
    random_qwen2,
    read_metrics,
    run_measured,
    tail,
)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", default="grpo_vanilla.py")
    p.add_argument("--model", default=None, help="HF model dir (default: perf_common.random_qwen2())")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-response-length", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--num-mini-batches", type=int, default=1)
    p.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--use-vllm", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=int, default=900)
    a = p.parse_args()

    model = a.model or random_qwen2()
    work = tempfile.mkdtemp(prefix="bench_scaling_")
    prompts = prompt_file(max(64, a.num_prompts * a.steps), os.path.join(work, "prompts.jsonl"))
    settings = [("base", a.group_size, a.max_response_length)]
    settings += [(f"G x{f}", a.group_size * f, a.max_response_length) for f in a.factors if f != 1]
    settings += [(f"L x{f}", a.group_size, a.max_response_length * f) for f in a.factors if f != 1]
    rows = []
    for i, (name, G, L) in enumerate(settings):
        out = os.path.join(work, f"run{i}")
        flags = {
            "model-name-or-path": model,
            "dataset": prompts,
            "output-dir": out,
            "total-steps": a.steps,
            "num-prompts-per-step": a.num_prompts,
            "group-size": G,
            "max-prompt-length": 128,
            "max-response-length": L,
            "num-mini-batches": a.num_mini_batches,
            "micro-batch-size": min(a.micro_batch_size, a.num_prompts * G // a.num_mini_batches),
            "learning-rate": 1e-5,
            "save-every": 0,
            "eval-every": 0,
        }
        cmd = [sys.executable, os.path.join(ROOT, a.script), "--no-gradient-checkpointing"]
        cmd += [] if a.use_vllm else ["--no-use-vllm"]
        for k, v in flags.items():
            cmd += [f"--{k}", str(v)]
        run = run_measured(cmd, {"MASTER_PORT": str(29700 + i)}, out + ".log", a.timeout)
        if run["rc"] != 0:
            raise SystemExit(f"{name} failed (exit {run['rc']}):\n{tail(run['log'])}")
        metrics = read_metrics(out)[a.warmup :]
        phases = {k: median([m[k] for m in metrics]) for k in PHASES}
        length = median([m["rollout/response_length"] for m in metrics])
        rows.append((name, G, L, length, phases, run["peak_rss"], os.getloadavg()[0]))
        print(f"{name}: {phases['time/step']:.3f} s/step", file=sys.stderr)

    base = rows[0][4]["time/step"]
    print(
        f"{a.script}, {'vLLM-CPU' if a.use_vllm else 'HF generate'}, model {model}, {a.num_prompts} prompts per step, "
        f"micro-batch {a.micro_batch_size}, {a.num_mini_batches} mini-batch(es), 1 process, medians of steps "
        f"{a.warmup + 1}-{a.steps} (s)"
    )
    print(
        "| setting | G | L (mean) | sequences | generation | log-prob | training | weight push | step | step / base | "
        "peak RSS (MB) | load avg after run |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, G, L, length, ph, rss, load in rows:
        print(
            f"| {name} | {G} | {L} ({length:.1f}) | {a.num_prompts * G} | {ph['time/generation']:.3f} | "
            f"{ph['time/logprob']:.3f} | {ph['time/training']:.3f} | {ph['time/weight_push']:.3f} | "
            f"{ph['time/step']:.3f} | {ph['time/step'] / base:.2f} | {rss / 2**20:.0f} | {load:.1f} |"
        )
    print(f"runs and logs: {work}")


if __name__ == "__main__":
    main()
