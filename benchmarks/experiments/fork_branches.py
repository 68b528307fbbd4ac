"""Which procedure the trained policies carry out on the fork testbed (testbed/build_fork.py), from each run's final
model: the share of sampled responses that open with the rare branch's letter ("s") and the share that subtract (the
operator of the equation), on each kind of test problem, with pass@k on the minority kind; mean and 95% t interval over
the seeds of each configuration (its --exp-name), Welch's interval against the baseline. The training metrics see only
the first token (rollout/first_token_minority, entropy/first_token); this sees what follows it.

    python -m benchmarks.experiments.fork_branches --runs 'runs/testbed_fork/*' \
        --output benchmarks/results/testbed/fork/branches.md
"""

import argparse
import glob
import json
import os
import sys

from benchmarks.compare import diff_ci, fmt_ci, mean_ci
from testbed import build_fork as ft
from testbed import common

COLUMNS = [  # (kind, key, header; n: the samples per problem)
    ("minority", "rare_share", "minority: opens with 's'"),
    ("minority", "rare_procedure_share", "minority: subtracts"),
    ("minority", "pass@n", "minority pass@{n}"),
    ("majority", "rare_procedure_share", "majority: subtracts"),
    ("majority", "accuracy", "majority mean@{n}"),
]


def measure_run(path: str, rows: list, samples: int) -> dict:
    """testbed/build_fork.measure_by_kind on a saved model (greedy and `samples` at T 1, seed 1), pass@n beside."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    by_kind = ft.measure_by_kind(model, tok, rows, samples, seed=1)
    return {kind: {**m, "pass@n": m["pass@k"][str(samples)]} for kind, m in by_kind.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="run directories or glob patterns (each with final/)")
    parser.add_argument("--output", required=True, help="the markdown table; the figures per run beside it (.json)")
    parser.add_argument("--baseline", default="grpo_vanilla")
    parser.add_argument("--problems", type=int, default=100, help="test problems of each kind (the first; eval: 100)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--base-model", default=os.path.join(ft.SHIPPED_DIR, "model"))
    a = parser.parse_args()
    runs = sorted(p for pattern in a.runs for p in glob.glob(pattern) if os.path.isdir(os.path.join(p, "final")))
    if not runs:
        sys.exit(f"error: no run with a final/ model in {a.runs}")
    recipe = ft.ForkRecipe()
    test = ft.split_problems(recipe)["test"]
    rows = []
    for kind in ("majority", "minority"):
        rows += [r for r in test if r["data_source"] == kind][: a.problems]
    figures = {}
    with common.quiet_and_isolated(1):
        figures["initial policy"] = [measure_run(a.base_model, rows, a.samples)]
        for path in runs:
            with open(os.path.join(path, "args.json")) as f:
                name = json.load(f)["exp_name"]
            figures.setdefault(name, []).append(measure_run(os.path.join(path, "final"), rows, a.samples))
            print(f"{path}: {json.dumps(figures[name][-1]['minority'])[:200]}", flush=True)
    value = lambda runs, kind, key: [r[kind][key] for r in runs]  # noqa: E731
    lines = ["| configuration | seeds | " + " | ".join(h.format(n=a.samples) for _, _, h in COLUMNS) + " |"]
    lines.append("| --- " * (len(COLUMNS) + 2) + "|")
    for name, rs in figures.items():
        cells = [fmt_ci(*mean_ci(value(rs, k, key))) for k, key, _ in COLUMNS]
        lines.append(f"| {name} | {len(rs)} | " + " | ".join(cells) + " |")
    base = figures.get(a.baseline)
    for name, rs in figures.items():
        if base is None or name in (a.baseline, "initial policy"):
            continue
        cells = []
        for k, key, _ in COLUMNS:
            mean, half = diff_ci(value(rs, k, key), value(base, k, key))
            cells.append(fmt_ci(mean, half, signed=True))
        lines.append(f"| {name} - {a.baseline} | | " + " | ".join(cells) + " |")
    note = (
        f"\nFinal models, {a.problems} test problems of each kind, {a.samples} samples each at T 1 (HF generate, seed"
        " 1); mean ± half-width of the 95% t interval over seeds; differences: Welch's 95% interval, * where it"
        " excludes 0."
        f" Command: python -m benchmarks.experiments.fork_branches --runs {' '.join(a.runs)} --output {a.output}\n"
    )
    with open(a.output, "w") as f:
        f.write("\n".join(lines) + "\n" + note)
    with open(os.path.splitext(a.output)[0] + ".json", "w") as f:
        json.dump(figures, f, indent=1)
    print("\n".join(lines) + "\n" + note)


if __name__ == "__main__":
    main()
