"""Plot reward, accuracy and entropy per step of one or more runs: python benchmarks/plot_run.py runs/<run> [...]"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [("rollout/reward", "reward"), ("entropy/full", "entropy (nats)"), ("eval/acc", "eval accuracy (greedy)")]


def read_metrics(run_dir: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(run_dirs: list) -> None:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.5))
    for run_dir in run_dirs:
        rows = read_metrics(run_dir)
        for ax, (key, label) in zip(axes, PANELS):
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=os.path.basename(run_dir.rstrip("/")))
            ax.set_xlabel("step")
            ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    out = os.path.join(run_dirs[0], "plot.png")
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python benchmarks/plot_run.py RUN_DIR [RUN_DIR ...]")
    main(sys.argv[1:])
