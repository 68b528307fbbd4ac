# Compare GRPO runs by method: curves over seeds, the entropy-performance law R = -a exp(H) + b, a table (README.md)
import glob
import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np
import tyro

from benchmarks.metrics import (
    AENT,
    CLIP,
    COV,
    EVAL,
    EVAL_SAMPLED,
    OPENING,
    REWARD,
    SAMPLING,
    SELECTION,
    label,
    own_metrics,
)


@dataclass
class Args:
    runs: tuple[str, ...] = ("runs/*",)
    """run directories (each with metrics.jsonl and args.json) or glob patterns"""
    wandb_runs: tuple[str, ...] = ()
    """wandb run paths (entity/project/run_id) to compare too, read with wandb.Api(): needs network and an API key"""
    output_dir: str = "runs/compare"
    """where the PNGs, compare.md and compare.json go"""
    baseline: str = "grpo_vanilla"
    """the method the others' final entropy is compared to (column 'entropy retained')"""
    entropy_metric: str = "entropy/full"
    """the entropy H: full-vocabulary entropy of the sampling policy, mean over response tokens"""
    law_metric: str = "auto"
    """the performance R of the law: eval/acc where every run logs it, else rollout/accuracy ('auto'), or a metric"""
    smooth: int = 1
    """moving-average window (steps) of the training curves; 1 plots them raw"""
    final_window: int = 10
    """'final' rollout numbers are the mean of the last this many steps, 'best' the max of that moving average"""
    allow_mixed: bool = False
    """pool runs that do not belong together (a seed run twice, other datasets, models or lengths) with a warning
    line for each, instead of refusing them"""


def find_runs(patterns, required: bool = True) -> list:
    """Run directories matched by the patterns (a directory or a glob), in order, without duplicates."""
    found = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) or [pattern]
        for path in matches:
            if os.path.isfile(os.path.join(path, "metrics.jsonl")) and path not in found:
                found.append(path)
    if not found and required:
        raise SystemExit(f"error: no run directory with a metrics.jsonl matches {' '.join(patterns)}")
    return found


def read_run(path: str) -> dict:
    """{"path", "method", "seed", "rows"}; the method is args.json's exp_name (else the name's part before '__')."""
    name = os.path.basename(os.path.normpath(path))
    args = {}
    if os.path.isfile(os.path.join(path, "args.json")):
        with open(os.path.join(path, "args.json")) as f:
            args = json.load(f)
    rows = []
    with open(os.path.join(path, "metrics.jsonl")) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise SystemExit(f"error: {path}/metrics.jsonl line {number} is not JSON")
    settings = {k: args.get(k) for k in COMPARABLE}
    method = args.get("exp_name", name.split("__")[0])
    return {"path": path, "method": method, "seed": args.get("seed"), "rows": rows, "settings": settings}


COMPARABLE = ("dataset", "model_name_or_path", "total_steps")
"""the settings (args.json) that runs pooled as seeds of one method, or set side by side, must share"""


def mixes(groups: dict, baseline: str) -> list:
    """What makes the runs of `groups` (method -> runs) not comparable, one line each: a method's seed run more than
    once, a method's runs on other datasets, models or lengths (total steps, or the last step logged), a method whose
    runs differ in these from the baseline's. Unknown settings (no args.json, a wandb run without them) never count."""

    def values(runs, key):
        if key == "steps":
            return {max((row["step"] for row in r["rows"]), default=0) for r in runs}
        return {r.get("settings", {}).get(key) for r in runs} - {None}

    problems = []
    for method, runs in groups.items():
        seeds = [r["seed"] for r in runs if r["seed"] is not None]
        repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
        if repeated:
            problems.append(f"{method}: seed {', '.join(map(str, repeated))} run more than once ({len(runs)} runs)")
        for key in (*COMPARABLE, "steps"):
            if len(values(runs, key)) > 1:
                problems.append(
                    f"{method}: its runs differ in {key} ({', '.join(map(str, sorted(values(runs, key), key=str)))})"
                )
    base = groups.get(baseline, [])
    for method, runs in groups.items():
        for key in (*COMPARABLE, "steps"):
            mine, theirs = values(runs, key), values(base, key)
            if method != baseline and mine and theirs and mine != theirs:
                problems.append(
                    f"{method} against {baseline}: {key} {sorted(mine, key=str)} vs {sorted(theirs, key=str)}"
                )
    return problems


def history_to_rows(history) -> list:
    """wandb history rows -> metrics.jsonl rows: `step` from `_step` (the scripts log with step=step), wandb's own `_*`
    keys, missing (None/NaN) and non-numeric (media, tables) values dropped; rows left without a metric are skipped.
    A wandb row merges everything logged at one step (e.g. training and evaluation), which series() reads the same."""
    rows = []
    for h in history:
        if h.get("_step") is None:
            continue
        row = {
            k: v
            for k, v in h.items()
            if not k.startswith("_")
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and not (isinstance(v, float) and math.isnan(v))
        }
        if row:
            rows.append({"step": int(h["_step"]), **row})
    return rows


def wandb_run_record(path: str, config: dict, group: str | None, name: str, history) -> dict:
    """read_run()'s record of a wandb run: the method is config's exp_name (else the run group, else the name's part
    before '__'); pure, so testable offline."""
    method = config.get("exp_name") or group or name.split("__")[0]
    return {"path": f"wandb:{path}", "method": method, "seed": config.get("seed"), "rows": history_to_rows(history)}


def read_wandb_run(path: str) -> dict:
    """A wandb run (entity/project/run_id) as read_run() reads a directory: the full, unsampled history. Needs network
    and a wandb API key, so the test suite covers only history_to_rows() and wandb_run_record()."""
    import wandb

    try:
        run = wandb.Api().run(path)
        history = list(run.scan_history())
    except Exception as e:  # no key, no network, no such run
        raise SystemExit(f"error: cannot read wandb run {path}: {e}")
    return wandb_run_record(path, dict(run.config), run.group, run.name, history)


def series(rows: list, key: str) -> tuple:
    """(steps, values) of one metric, in step order (a resumed run may repeat a step: the last value wins)."""
    points = {r["step"]: r[key] for r in rows if r.get(key) is not None}
    steps = sorted(points)
    return np.array(steps, dtype=float), np.array([points[s] for s in steps], dtype=float)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over `window` points (shorter at the start)."""
    if window <= 1 or len(values) == 0:
        return values
    sums = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.maximum(np.arange(1, len(values) + 1) - window, 0)]) / counts


def aggregate(runs: list, key: str, smooth: int = 1) -> tuple | None:
    """(steps, mean, min, max) over the runs (seeds) of one method, at every step any of them logged; None if none."""
    by_step = {}
    for run in runs:
        steps, values = series(run["rows"], key)
        for s, v in zip(steps, moving_average(values, smooth)):
            by_step.setdefault(s, []).append(v)
    if not by_step:
        return None
    steps = np.array(sorted(by_step))
    stacked = [np.array(by_step[s]) for s in steps]
    return (
        steps,
        np.array([v.mean() for v in stacked]),
        np.array([v.min() for v in stacked]),
        np.array([v.max() for v in stacked]),
    )


def law_points(rows: list, metric: str, entropy_metric: str) -> tuple:
    """(H, R) pairs of one run. An evaluation logged at step s measured the policy that sampled step s + 1's rollouts,
    so it is paired with step s + 1's entropy (the last evaluation, with nothing after it, with step s's)."""
    entropy = dict(zip(*series(rows, entropy_metric)))
    H, R = [], []
    for s, r in zip(*series(rows, metric)):
        h = entropy.get(s + 1, entropy.get(s)) if metric.startswith("eval/") else entropy.get(s)
        if h is not None:
            H.append(h)
            R.append(r)
    return np.array(H), np.array(R)


def fit_law(H, R) -> tuple:
    """Least-squares (a, b) of R = -a * exp(H) + b (linear in exp(H)); NaNs with fewer than 2 distinct H."""
    H, R = np.asarray(H, dtype=float), np.asarray(R, dtype=float)
    if len(np.unique(H)) < 2:
        return math.nan, math.nan
    design = np.stack([-np.exp(H), np.ones_like(H)], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, R, rcond=None)
    return float(a), float(b)


def run_summary(run: dict, args: Args) -> dict:
    """Per-run numbers for the table: final and best reward (smoothed), initial, final and best eval accuracy, final
    entropy."""
    out = {}
    for key, name in (("rollout/reward", "reward"), ("rollout/accuracy", "accuracy"), (args.entropy_metric, "entropy")):
        steps, values = series(run["rows"], key)
        if len(values):
            smoothed = moving_average(values, args.final_window)
            out[f"final_{name}"], out[f"best_{name}"] = smoothed[-1], smoothed.max()
            out["steps"] = int(steps[-1])
    steps, values = series(run["rows"], "eval/acc")
    if len(values):  # step 0 evaluated the initial policy: its own column, not a candidate for 'best'
        out["initial_eval_acc"] = values[0] if steps[0] == 0 else None
        out["final_eval_acc"], out["best_eval_acc"] = values[-1], values[steps > 0].max(initial=values[-1])
    results = os.path.join(run["path"], "eval", "results.json")  # benchmarks/eval.py on the final model, if run
    if os.path.isfile(results):
        with open(results) as f:
            average = json.load(f)["average"]
        out["benchmark_acc"] = next((v for k, v in average.items() if k.startswith("mean@")), None)
    return out


def fmt(values: list, digits: int = 3) -> str:
    """mean, with the (min-max) range over seeds when there are several; '-' when nothing was logged."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    mean = f"{np.mean(values):.{digits}f}"
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return mean if lo == hi else f"{mean} ({lo}-{hi})"


# two-sided 95% quantiles of Student's t by degrees of freedom (1-30; beyond: 1.96 at infinity, within 0.05)
T95 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


def t95(df: float) -> float:
    """The 97.5% quantile of Student's t at df degrees of freedom (rounded down to a whole number: conservative)."""
    df = int(math.floor(df))
    return math.nan if df < 1 else T95[df - 1] if df <= len(T95) else 1.96 + 2.4 / df


def mean_ci(values: list) -> tuple:
    """(mean, half-width of its 95% t interval) over seeds; the half-width is NaN with one seed."""
    x = np.array([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if len(x) == 0:
        return math.nan, math.nan
    return float(x.mean()), (t95(len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else math.nan)


def diff_ci(values: list, base: list) -> tuple:
    """(mean difference, half-width of its 95% Welch interval) of a method's seeds minus the baseline's."""
    a, b = (np.array([v for v in vs if v is not None and not math.isnan(v)], dtype=float) for vs in (values, base))
    if len(a) < 2 or len(b) < 2:
        return (float(a.mean() - b.mean()) if len(a) and len(b) else math.nan), math.nan
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se > 0 else len(a) + len(b) - 2
    return float(a.mean() - b.mean()), t95(df) * se


def fmt_ci(mean: float, half: float, digits: int = 3, signed: bool = False) -> str:
    """'mean ± half' ('mean' alone with one seed, '-' without data); a difference whose interval excludes 0 gets '*'."""
    if math.isnan(mean):
        return "-"
    text = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    if math.isnan(half):
        return text
    return f"{text} ± {half:.{digits}f}" + (" *" if signed and abs(mean) > half else "")


def final_values(run: dict, key: str, window: int = 1) -> tuple:
    """(value at step 0, final value) of one metric of one run (None where absent): the final value is the mean of the
    last `window` logged values (evaluations are few and far apart: use 1 for them)."""
    steps, values = series(run["rows"], key)
    if not len(values):
        return None, None
    return (values[0] if steps[0] == 0 else None), float(values[-window:].mean())


def plot_curves(plt, path: str, groups: dict, colors: dict, panels: list, smooth: int) -> bool:
    """One PNG, one panel per (metric, label): mean over seeds and its min-max band per method. False if no data."""
    panels = [(k, name) for k, name in panels if any(aggregate(rs, k) is not None for rs in groups.values())]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        for method, runs in groups.items():
            agg = aggregate(runs, key, 1 if key.startswith("eval/") else smooth)
            if agg is None:
                continue
            steps, mean, lo, hi = agg
            ax.plot(
                steps,
                mean,
                color=colors[method],
                label=f"{method} ({len(runs)} seed{'s' * (len(runs) > 1)})",
                marker="." if len(steps) < 30 else None,
            )
            if len(runs) > 1:
                ax.fill_between(steps, lo, hi, color=colors[method], alpha=0.2, linewidth=0)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_law(plt, path: str, groups: dict, colors: dict, points: dict, fits: dict, metric: str, entropy_metric: str):
    """Performance vs entropy per method with its fitted R = -a exp(H) + b and the predicted ceiling -a + b at H = 0."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for method in groups:
        H, R = points[method]
        if not len(H):
            continue
        ax.scatter(H, R, s=10, alpha=0.5, color=colors[method])
        a, b = fits[method]
        if not math.isnan(a):
            grid = np.linspace(0, H.max() * 1.05, 100)
            ax.plot(grid, -a * np.exp(grid) + b, color=colors[method], label=f"{method}: a={a:.3g}, b={b:.3g}")
            ax.axhline(b - a, color=colors[method], linestyle="--", linewidth=0.8)
    ax.set_xlabel(f"{entropy_metric} (nats)")
    ax.set_ylabel(metric)
    ax.set_title("R = -a exp(H) + b; dashed: ceiling -a + b at H = 0", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.smooth < 1 or args.final_window < 1:
        raise SystemExit("error: --smooth and --final-window must be >= 1")
    runs = [read_run(p) for p in find_runs(args.runs, required=not args.wandb_runs)]
    local = {os.path.basename(os.path.normpath(r["path"])) for r in runs}  # a tracked run's wandb id is its run name
    for path in args.wandb_runs:
        if path.rstrip("/").split("/")[-1] in local:
            print(f"{path}: the same run is read from its local directory")
        else:
            runs.append(read_wandb_run(path))
    methods = sorted({r["method"] for r in runs}, key=lambda m: (m != args.baseline, m))  # baseline first
    groups = {m: [r for r in runs if r["method"] == m] for m in methods}
    problems = mixes(groups, args.baseline)
    if problems and not args.allow_mixed:
        raise SystemExit(
            f"error: these runs do not belong together: {'; '.join(problems)} (pass fewer --runs, or --allow-mixed to "
            "pool them anyway)"
        )
    for problem in problems:
        print(f"warning: pooled anyway (--allow-mixed): {problem}")
    os.makedirs(args.output_dir, exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    E = args.entropy_metric
    figures = {
        "entropy.png": [(E, f"{E} (nats)"), *((k, label(k)) for k in ("entropy/top20", "entropy/kept"))],
        "clip.png": [(k, label(k)) for k in CLIP],
        "reward.png": [(k, label(k)) for k in REWARD],
        "eval_acc.png": [(k, label(k)) for k in (EVAL[0], *EVAL_SAMPLED)],
        "aent.png": [(k, label(k)) for k in AENT],
        "cov.png": [(k, label(k)) for k in COV],  # panels no run logged are left out
        "selection.png": [(k, label(k)) for k in SELECTION],
        "sampling.png": [(k, label(k)) for k in SAMPLING],
        "opening.png": [(k, label(k)) for k in OPENING],
    }
    # several held-out sets (eval/<set>/...; the fork testbed's majority and minority): each set's sampled accuracy
    # and largest pass@k
    sets = sorted(
        {k.split("/")[1] for r in runs for row in r["rows"] for k in row if re.fullmatch(r"eval/[^/]+/acc", k)}
    )
    set_pass = sorted(
        {k.split("/")[-1] for r in runs for row in r["rows"] for k in row if re.fullmatch(r"eval/[^/]+/pass@\d+", k)},
        key=lambda k: int(k.split("@")[1]),
    )[-1:]
    if len(sets) > 1:
        figures["eval_sets.png"] = [(f"eval/{s}/{m}", f"{s}: {m}") for s in sets for m in ("mean_acc", *set_pass)]
    for namespace, keys in own_metrics({k for r in runs for row in r["rows"] for k in row}).items():
        figures[f"{namespace}.png"] = [(k, label(k)) for k in keys]  # a new method's own metrics
    written = [
        name
        for name, panels in figures.items()
        if plot_curves(plt, os.path.join(args.output_dir, name), groups, colors, panels, args.smooth)
    ]

    # the entropy-performance law, fitted per method over all its seeds' points
    metric = args.law_metric
    if metric == "auto":
        metric = "eval/acc" if all(len(series(r["rows"], "eval/acc")[0]) >= 2 for r in runs) else "rollout/accuracy"
    points = {
        m: tuple(np.concatenate(x) for x in zip(*(law_points(r["rows"], metric, E) for r in rs)))
        for m, rs in groups.items()
    }
    fits = {m: fit_law(*points[m]) for m in methods}
    plot_law(plt, os.path.join(args.output_dir, "law.png"), groups, colors, points, fits, metric, E)
    written.append("law.png")

    # the table: per-run numbers, then mean and range over each method's seeds
    summaries = {m: [run_summary(r, args) for r in rs] for m, rs in groups.items()}
    base = [s.get("final_entropy") for s in summaries.get(args.baseline, [])]
    base_entropy = np.mean(base) if base and None not in base else None
    header = [
        "method",
        "seeds",
        "steps",
        "final reward",
        "best reward",
        "step-0 eval acc",
        "final eval acc",
        "best eval acc",
        "final entropy",
        f"entropy retained vs {args.baseline}",
        "a",
        "b",
        "ceiling -a+b",
        "benchmarks mean@k",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    table = {}
    for m in methods:
        s = summaries[m]
        col = {
            k: [x.get(k) for x in s]
            for k in (
                "steps",
                "final_reward",
                "best_reward",
                "initial_eval_acc",
                "final_eval_acc",
                "best_eval_acc",
                "final_entropy",
                "benchmark_acc",
            )
        }
        entropies = [e for e in col["final_entropy"] if e is not None]
        retained = np.mean(entropies) / base_entropy if entropies and base_entropy else None
        a, b = fits[m]
        table[m] = {
            "runs": [r["path"] for r in groups[m]],
            "seeds": [r["seed"] for r in groups[m]],
            **col,
            "entropy_retained": retained,
            "a": a,
            "b": b,
            "ceiling": b - a,
        }
        distinct = len({r["seed"] for r in groups[m]})
        cells = [
            m,
            str(distinct) if distinct == len(s) else f"{distinct} ({len(s)} runs)",
            fmt(col["steps"], 0),
            fmt(col["final_reward"]),
            fmt(col["best_reward"]),
            fmt(col["initial_eval_acc"]),
            fmt(col["final_eval_acc"]),
            fmt(col["best_eval_acc"]),
            fmt(col["final_entropy"]),
            "-" if retained is None else f"{retained:.2f}x",
            fmt([a]),
            fmt([b]),
            fmt([b - a]),
            fmt(col["benchmark_acc"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = (
        f"\nFinal/best reward and entropy: mean of the last {args.final_window} steps / best {args.final_window}-step "
        f"moving average; eval acc: at step 0 (the initial policy) / last / best after step 0; ranges are min-max "
        f"over seeds. Law fitted on ({E}, {metric}) pairs of every step of every seed. Benchmarks: "
        f"benchmarks/eval.py's mean@k averaged over its sets, from <run>/eval/results.json when present.\n"
    )
    # the held-out metrics with 95% intervals over seeds, and each method minus the baseline
    pass_keys = sorted(
        {k for r in runs for row in r["rows"] for k in row if k.startswith("eval/pass@")},
        key=lambda k: int(k.split("@")[1]),
    )
    # several held-out sets (eval/<set>/acc; eval/acc is their mean): each set's greedy accuracy too
    set_keys = sorted({k for r in runs for row in r["rows"] for k in row if re.fullmatch(r"eval/[^/]+/acc", k)})
    set_sampled = [f"eval/{s}/{m}" for s in sets for m in ("mean_acc", *set_pass)] if len(sets) > 1 else []
    keys = [
        k
        for k in (
            "eval/acc",
            *(set_keys if len(set_keys) > 1 else []),
            "eval/mean_acc",
            *pass_keys[-1:],
            *set_sampled,
            "eval/entropy",
            E,
            "entropy/top20",
            "entropy/first_token",
            "rollout/first_token_minority",
            "entropy/kept",
            "entropy/kept_frac",
            "rollout/filtered_frac",
            "rollout/generated_groups",
        )
        if any(len(series(r["rows"], k)[0]) for r in runs)
    ]
    window = {k: 1 if k.startswith("eval/") else args.final_window for k in keys}
    finals = {m: {k: [final_values(r, k, window[k])[1] for r in rs] for k in keys} for m, rs in groups.items()}
    base_runs = groups.get(args.baseline, [])
    ci_lines = ["| method | seeds | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 2)]
    initial = [mean_ci([final_values(r, k)[0] for r in base_runs]) for k in keys]
    if any(not math.isnan(m) for m, _ in initial):  # the baseline's runs evaluated their step-0 policy
        ci_lines.append(
            f"| initial policy (step 0) | {len(base_runs)} | " + " | ".join(fmt_ci(*c) for c in initial) + " |"
        )
    for m in methods:
        ci_lines.append(
            f"| {m} | {len(groups[m])} | " + " | ".join(fmt_ci(*mean_ci(finals[m][k])) for k in keys) + " |"
        )
        table[m]["final"] = {k: mean_ci(finals[m][k]) for k in keys}
    for m in methods:
        if m != args.baseline and base_runs:
            diffs = [diff_ci(finals[m][k], finals[args.baseline][k]) for k in keys]
            ci_lines.append(f"| {m} - {args.baseline} | | " + " | ".join(fmt_ci(*d, signed=True) for d in diffs) + " |")
            table[m]["minus_baseline"] = dict(zip(keys, diffs))
    ci_notes = (
        f"\nAt the last evaluation ({E}: mean of the last {args.final_window} steps): mean ± half-width of the "
        f"95% t interval over seeds; differences: Welch's 95% interval, * where it excludes 0 (significant at "
        f"the 5% level).\n"
    )
    markdown = (
        "\n".join(ci_lines)
        + "\n"
        + ci_notes
        + "\n"
        + "\n".join(lines)
        + "\n"
        + notes
        + "".join(f"\n![{n}]({n})\n" for n in written)
    )
    with open(os.path.join(args.output_dir, "compare.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(args.output_dir, "compare.json"), "w") as f:
        json.dump({"law_metric": metric, "entropy_metric": E, "methods": table}, f, indent=2, default=float)
    print("\n".join(ci_lines))
    print("\n".join(lines))
    print(f"wrote {', '.join(written)}, compare.md and compare.json to {args.output_dir}")
