"""The output head's dtype in the trainer and the sampler (--head-dtype), measured side by side in bf16 on the CPU:
the sampler's log-probs against the trainer's (mean and largest |gap| per token, the mismatch KL), step time and peak
memory, for both heads in the weights' dtype, both in float32, and float32 on one side only.

    python -m benchmarks.experiments.head_dtype                 # both testbeds, seeds 1-3, 8 steps: ~15 min on 2 cores
    python -m benchmarks.experiments.head_dtype --testbeds fork --seeds 1 --steps 4   # a quick look

Each run is grpo_vanilla.py with the testbed's settings (the Makefile's TESTBED_ARGS, fewer steps, no evaluation) and
--dtype bfloat16, one process. The one-sided settings are not flags of the scripts (a run should never have them):
this file starts the run itself with vLLM's LLM given the other head dtype (`--sampler-head`), the trainer's from
--head-dtype. Writes a Markdown table to stdout (and --out): mean over a run's steps, then mean +- 95% t half-width
over the seeds."""

import json
import os
import resource
import runpy
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import tyro

from benchmarks.compare import fmt_ci, mean_ci
from testbed.common import CPU_ENV
from testbed.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTINGS = {  # name: (the trainer's head, the sampler's head)
    "both model": ("model", "model"),
    "both float32": ("float32", "float32"),
    "trainer float32 only": ("float32", "model"),
    "sampler float32 only": ("model", "float32"),
}
TESTBEDS = {"arithmetic": ("testbed", 48, 200), "fork": ("testbed/fork", 32, 100)}  # folder, response length, eval
METRICS = {
    "mean abs gap": "rollout/vllm_logprob_gap",
    "max abs gap": "rollout/vllm_logprob_gap_max",
    "mismatch KL (k3)": "rollout/vllm_mismatch_kl",
    "step s": "time/step",
    "log-prob pass s": "time/logprob",
    "training s": "time/training",
}


@dataclass
class Args:
    testbeds: tuple[str, ...] = ("arithmetic", "fork")
    """the shipped testbeds to run on (arithmetic: testbed/, fork: testbed/fork/)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """the seeds of each setting"""
    steps: int = 8
    """training steps per run"""
    settings: tuple[str, ...] = tuple(SETTINGS)
    """the head settings to run"""
    out: str = "runs/head_dtype"
    """the runs' folder; the table is also written to <out>/head_dtype.md"""
    sampler_head: str | None = field(default=None)
    """internal: run the script given after it with vLLM's head dtype set to this"""


def testbed_flags(name: str, steps: int) -> list:
    folder, response_length, _ = TESTBEDS[name]
    return (
        f"--model-name-or-path {folder}/model --dataset {folder}/train.jsonl --total-steps {steps} "
        f"--num-prompts-per-step 16 --group-size 8 --max-prompt-length 128 --max-response-length {response_length} "
        "--num-mini-batches 2 --micro-batch-size 32 --learning-rate 2e-4 --warmup-steps 5 --no-gradient-checkpointing "
        "--eval-every 0 --save-every 0 --vllm-is-cap 0 --dtype bfloat16 --grading-workers 1"
    ).split()


def run_with_sampler_head(head: str, argv: list) -> None:
    """Run the script argv[0] in this process with vLLM's LLM given hf_overrides head_dtype `head` whatever the
    script asks (utils/vllm_engine.py start_engine passes --head-dtype), and write this process's peak RSS beside the
    run's metrics at exit."""
    import atexit

    from vllm import LLM

    init = LLM.__init__

    def init_with_head(self, *a, **k):
        init(self, *a, **{**k, "hf_overrides": {"head_dtype": head}})

    LLM.__init__ = init_with_head
    out = argv[argv.index("--output-dir") + 1]
    atexit.register(lambda: json.dump(peak_rss(), open(os.path.join(out, "peak_rss.json"), "w")))
    sys.argv = argv
    sys.path.insert(0, ROOT)
    runpy.run_path(os.path.join(ROOT, argv[0]), run_name="__main__")


def peak_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: GiB


def one_run(testbed: str, setting: str, seed: int, steps: int, out: str) -> dict:
    """One run's means over its steps (the first step left out of the times: start-up), and its peak memory."""
    trainer, sampler = SETTINGS[setting]
    run_out = os.path.join(out, testbed, setting.replace(" ", "_"), f"seed{seed}")
    os.makedirs(run_out, exist_ok=True)
    argv = ["grpo_vanilla.py", "--output-dir", run_out, "--seed", str(seed), "--head-dtype", trainer]
    argv += testbed_flags(testbed, steps)
    env = {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port())}
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.experiments.head_dtype", "--sampler-head", sampler, "--", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"error: {testbed} {setting} seed {seed} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    [run_dir] = [os.path.join(run_out, d) for d in os.listdir(run_out) if os.path.isdir(os.path.join(run_out, d))]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "rollout/vllm_logprob_gap" in r]
    result = {}
    for name, key in METRICS.items():
        values = [r[key] for r in (rows[1:] if name.endswith(" s") and len(rows) > 1 else rows)]
        result[name] = max(values) if name.startswith("max") else float(np.mean(values))
    result["peak RSS GiB"] = json.load(open(os.path.join(run_out, "peak_rss.json")))
    print(f"{testbed} {setting} seed {seed}: {time.time() - start:.0f} s {result}", file=sys.stderr)
    return result


def cell(values: list) -> str:
    """A table cell: mean ± 95% t half-width over the seeds (benchmarks/compare.py's), small values in e-notation."""
    mean, half = mean_ci(values)
    if abs(mean) >= 1e-2:
        return fmt_ci(mean, half, 2 if abs(mean) >= 0.1 else 3)
    return f"{mean:.3e}" + ("" if np.isnan(half) else f" ± {half:.1e}")


def main(args: Args) -> str:
    lines = [
        f"seeds {', '.join(map(str, args.seeds))}, {args.steps} steps of grpo_vanilla.py in bf16, one process; "
        "mean over a run's steps (max abs gap: the largest of any step; times without the first step), then mean ± "
        "95% t half-width over the seeds",
    ]
    columns = [*METRICS, "peak RSS GiB"]
    for testbed in args.testbeds:
        lines += ["", f"**{testbed} testbed**", "", "| heads | " + " | ".join(columns) + " |"]
        lines.append("|" + " --- |" * (len(columns) + 1))
        for setting in args.settings:
            runs = [one_run(testbed, setting, seed, args.steps, args.out) for seed in args.seeds]
            lines.append(f"| {setting} | " + " | ".join(cell([r[c] for r in runs]) for c in columns) + " |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "head_dtype.md"), "w") as f:
        f.write(table + "\n")
    return table


if __name__ == "__main__":
    if "--sampler-head" in sys.argv and "--" in sys.argv:
        split = sys.argv.index("--")
        run_with_sampler_head(sys.argv[sys.argv.index("--sampler-head") + 1], sys.argv[split + 1 :])
    else:
        print(main(tyro.cli(Args)))
