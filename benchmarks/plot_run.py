"""Plot reward, entropy and held-out accuracy per step of runs: python -m benchmarks.plot_run runs/<run> [...]

Each curve is smoothed (a centred moving average; `--smooth`, in steps) over its raw points, drawn faint.
The plot goes to <first run>/plot.png.
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (panel title, [(metric, label)]): several metrics share a panel when they share a scale
PANELS = [
    ("reward (training samples)", [("rollout/reward", "reward")]),
    ("entropy (nats per response token)", [("entropy/full", "training samples"), ("eval/entropy", "eval samples")]),
    ("held-out accuracy", [("eval/acc", "greedy"), ("eval/mean_acc", "sampled (mean@k)"), ("eval/pass@16", "pass@16")]),
    (  # the fork testbed's fork, and its minority kind's pass@16 (the other testbed has no such set)
        "the first response token",
        [
            ("entropy/first_token", "its entropy (nats)"),
            ("rollout/first_token_minority", "share of the less usual openings"),
            ("eval/minority/pass@16", "minority kind: pass@16"),
        ],
    ),
]


def read_metrics(run_dir: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def smooth(values: list, window: int) -> list:
    """Centred moving average over `window` points (fewer at the ends)."""
    half = max(window, 1) // 2
    return [
        sum(values[max(0, i - half) : i + half + 1]) / len(values[max(0, i - half) : i + half + 1])
        for i in range(len(values))
    ]


def main(run_dirs: list, window: int) -> str:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.5 * len(PANELS), 3.8))
    color = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10)
    for run_dir in run_dirs:
        rows = read_metrics(run_dir)
        name = os.path.basename(run_dir.rstrip("/"))
        for ax, (title, metrics) in zip(axes, PANELS):
            for key, label in metrics:
                points = [(r["step"], r[key]) for r in rows if key in r]
                if not points:
                    continue
                steps, values = zip(*points)
                c = next(color)
                dense = len(points) > 30  # per-step metrics: smooth them; evaluations are few and plotted as they are
                ax.plot(steps, values, ".", color=c, alpha=0.25 if dense else 0.8, markersize=3 if dense else 5)
                ax.plot(
                    steps,
                    smooth(list(values), window) if dense else values,
                    "-",
                    color=c,
                    label=label if len(run_dirs) == 1 else f"{name}: {label}",
                )
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = os.path.join(run_dirs[0], "plot.png")
    fig.savefig(out, dpi=100)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with a metrics.jsonl)")
    parser.add_argument("--smooth", type=int, default=15, help="moving-average window for per-step curves, in steps")
    args = parser.parse_args()
    print(f"wrote {main(args.run_dirs, args.smooth)}")
