"""Exit soak: does every finished run exit 0, every time? Short testbed runs of every method script x {colocated
engines, one rollout rank at --max-staleness 1} x {ZeRO-2, ZeRO-3}, each repeated, 2 processes each; counts the runs
that did not exit 0 and shows each one's last line. A finished run that dies at exit (a thread or a process group torn
down in the wrong order) shows here as a non-zero exit after its last step.

    python -m benchmarks.experiments.soak_exits --repeats 5                  # 5 scripts x 2 modes x 2 stages x 5
    python -m benchmarks.experiments.soak_exits --scripts grpo_aent.py --modes rollout --stages 3 --repeats 10

Prints a markdown table (runs and non-zero exits per configuration) and the command; writes each run's output under
--output. Flags: the Makefile's testbed, --steps steps, a token budget, packed sequences and the rollout correction
(the configuration of issue 42's aborts), no evaluation, no checkpoint but the final model.
"""

import argparse
import glob
import os
import shlex
import subprocess
import sys
import time

from benchmarks.experiments.soak import ROOT, free_port, override, testbed_args
from testbed.common import CPU_ENV

MODES = {"colocated": {}, "rollout": {"--rollout-ranks": "1", "--max-staleness": "1"}}
FLAGS = {
    "--max-tokens-per-micro-batch": "200",
    "--padding-free": None,
    "--vllm-is-cap": "2",
    "--eval-every": "0",
    "--save-every": "0",
}


def command(script: str, mode: str, stage: int, steps: int, out: str) -> list:
    flags = override(testbed_args(), {"--total-steps": str(steps), "--output-dir": out, "--zero-stage": str(stage)})
    flags += [x for k, v in {**FLAGS, **MODES[mode]}.items() for x in ([k] if v is None else [k, v])]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    return [*launch, script, *flags]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scripts", nargs="+", default=sorted(os.path.basename(s) for s in glob.glob(f"{ROOT}/grpo_*.py")))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--stages", nargs="+", type=int, default=[2, 3], choices=[2, 3])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--output", default="runs/soak_exits")
    a = p.parse_args()
    env = {**os.environ, **CPU_ENV, "VLLM_LOGGING_LEVEL": "WARNING"}
    rows, failures, t0 = [], [], time.time()
    for script in a.scripts:
        for mode in a.modes:
            for stage in a.stages:
                codes = []
                for r in range(a.repeats):
                    out = os.path.join(a.output, f"{script[:-3]}_{mode}_z{stage}_{r}")
                    os.makedirs(out, exist_ok=True)
                    proc = subprocess.run(
                        command(script, mode, stage, a.steps, out), cwd=ROOT, env=env, capture_output=True, text=True
                    )
                    with open(os.path.join(out, "output.txt"), "w") as f:
                        f.write(proc.stdout + proc.stderr)
                    finished = bool(glob.glob(os.path.join(out, "*", "final", "config.json")))
                    codes.append(proc.returncode)
                    if proc.returncode:
                        last = (proc.stderr.strip().splitlines() or [""])[-1][:160]
                        failures.append(
                            f"{script} {mode} ZeRO-{stage} #{r}: exit {proc.returncode}, final model "
                            f"{'written' if finished else 'missing'}; last line: {last}"
                        )
                    print(f"{script} {mode} ZeRO-{stage} #{r}: exit {proc.returncode}", file=sys.stderr, flush=True)
                rows.append((script, mode, stage, len(codes), sum(c != 0 for c in codes)))
    print(f"command: python -m benchmarks.experiments.soak_exits {shlex.join(sys.argv[1:])}")
    print(f"{a.steps} steps a run, 2 processes, {(time.time() - t0) / 60:.0f} minutes in all\n")
    print("| script | mode | ZeRO | runs | non-zero exits |\n| --- | --- | --- | --- | --- |")
    for script, mode, stage, n, bad in rows:
        print(f"| {script} | {mode} | {stage} | {n} | {bad} |")
    total, bad = sum(r[3] for r in rows), sum(r[4] for r in rows)
    print(f"| all | | | {total} | {bad} |")
    for line in failures:
        print(f"- {line}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
