"""A run's metrics as means over windows of steps, one row per window: how a metric moved while another did, e.g.
which branch of CE-GPPO carried the gradient while the entropy rose.

    python -m benchmarks.run_windows --runs 'runs/testbed_cegppo_mb8/*' --window 20 \
        --metrics entropy/full rollout/reward cegppo/grad_beta1_share cegppo/grad_beta2_share
"""

import argparse
import glob
import json
import math
import os


def windows(rows: list, metrics: list, window: int) -> list:
    """[(first step, last step, {metric: mean over the window's steps that log it})] over a run's metrics.jsonl rows."""
    steps = sorted({r["step"] for r in rows if any(m in r for m in metrics)})
    out = []
    for start in range(0, len(steps), window):
        chunk = set(steps[start : start + window])
        means = {}
        for m in metrics:
            values = [r[m] for r in rows if r["step"] in chunk and m in r and r[m] is not None]
            means[m] = sum(values) / len(values) if values else math.nan
        out.append((min(chunk), max(chunk), means))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="run directories or glob patterns")
    parser.add_argument("--metrics", nargs="+", required=True)
    parser.add_argument("--window", type=int, default=20, help="steps per window")
    a = parser.parse_args()
    runs = sorted(p for pattern in a.runs for p in glob.glob(pattern) if os.path.exists(f"{p}/metrics.jsonl"))
    if not runs:
        raise SystemExit(f"error: no run with a metrics.jsonl in {a.runs}")
    for path in runs:
        with open(f"{path}/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        print(f"\n{path}\n| steps | " + " | ".join(a.metrics) + " |\n|" + " --- |" * (len(a.metrics) + 1))
        for first, last, means in windows(rows, a.metrics, a.window):
            print(f"| {first}-{last} | " + " | ".join(f"{means[m]:.4g}" for m in a.metrics) + " |")


if __name__ == "__main__":
    main()
