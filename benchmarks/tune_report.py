"""The equal-budget study's report (benchmarks/results/tune/PLAN.md): each method's trials and Pareto front, read from
its journal and its trials' runs, the one point per method the plan's scalarisation picks, and the fronts' picture.

    python -m benchmarks.tune_report --journals benchmarks/results/tune --runs runs/tune --out benchmarks/results/tune

Writes <out>/trials.jsonl (every complete trial: its flags and its last evaluation, so that the report can be read
without the runs), <out>/README.md (the fronts, the picked points, what each keeps), <out>/fronts.png and --script
(benchmarks/reproduce/tune_confirm.sh: the confirmation's runs).
"""

import argparse
import glob
import json
import os

from benchmarks.tune import OBJECTIVES, suggest

MAJORITY, MINORITY = OBJECTIVES
MAJORITY_PASS = "eval/majority/pass@16"
MARGIN = 0.05  # the plan's scalarisation: majority mean@16 at least vanilla's best minus this
DIVERGED = 0.3  # a trial whose majority mean@16 ends under this has diverged (the base policy has 0.48)


def overall_pass(row: dict) -> float:
    """The plan's overall pass@16: the mean of the two kinds' pass@16 (100 problems each)."""
    return (row[MAJORITY_PASS] + row[MINORITY]) / 2


def read_trials(journal: str, runs: str) -> list:
    """One row per complete trial of the journal's study: its number, its flags (made from its drawn values as the tuner
    made them: AEnt's box in order, KL-Cov's mini-batches), objectives, and the run's evaluations at step 0 (the base
    policy) and at its last evaluation (every eval/ metric)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    method = os.path.basename(journal).removesuffix(".log")
    study = optuna.load_study(study_name=method, storage=JournalStorage(JournalFileBackend(journal)))
    front = {t.number for t in study.best_trials}
    rows = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        where = os.path.join(runs, method, f"trial_{t.number}")
        paths = glob.glob(os.path.join(where, "*", "metrics.jsonl"))
        if len(paths) != 1:
            raise SystemExit(f"error: {method} trial {t.number}: {len(paths)} runs (metrics.jsonl) in {where}, not 1")
        (path,) = paths
        flags = suggest(optuna.trial.FixedTrial(t.params), method)
        ran = os.path.join(where, "command.txt")  # the tuner's record of the command
        if os.path.exists(ran):
            with open(ran) as f:
                command = f" {f.read().strip()} "
            if not all(f" --{k} {v} " in command for k, v in flags.items()):
                raise SystemExit(f"error: {ran} does not hold the flags {flag_text(flags, exact=True)}")
        evals = [r for r in map(json.loads, open(path)) if MINORITY in r]
        keep = lambda r: {k: v for k, v in r.items() if k == "step" or k.startswith("eval/")}  # noqa: E731
        rows.append(
            {"method": method, "trial": t.number, "flags": flags, "values": t.values, "front": t.number in front,
             "base": keep(evals[0]), "last": keep(evals[-1])}
        )  # fmt: skip
    return rows


def by_method(rows: list) -> dict:
    """The rows grouped by method, in their order (vanilla first: main sorts them so)."""
    groups = {}
    for r in rows:
        groups.setdefault(r["method"], []).append(r)
    return groups


def pick(rows: list, floor: float) -> dict | None:
    """The plan's point: the highest overall pass@16 among the trials whose majority mean@16 >= floor; ties: the higher
    majority mean@16. None if no trial reaches the floor."""
    eligible = [r for r in rows if r["last"][MAJORITY] >= floor]
    return max(eligible, key=lambda r: (overall_pass(r["last"]), r["last"][MAJORITY]), default=None)


def flag_text(flags: dict, exact: bool = False) -> str:
    """The trial's flags as command-line text: as tune.py passed them (exact) or rounded to 4 digits (to read)."""
    show = lambda v: f"{v:.4g}" if isinstance(v, float) and not exact else str(v)  # noqa: E731
    return " ".join(f"--{k} {show(v)}" for k, v in sorted(flags.items()))


def plot(rows: list, floor: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(8, 6))
    for i, (m, own) in enumerate(by_method(rows).items()):
        color = "black" if m == "grpo_vanilla" else colors(2 * i % 20 + 2 * i // 20)  # the dark shades first
        front = sorted((r["last"][MINORITY], r["last"][MAJORITY]) for r in own if r["front"])
        dots = [(r["last"][MINORITY], r["last"][MAJORITY]) for r in own]
        ax.scatter(*zip(*dots), color=color, s=12, alpha=0.35)
        ax.plot(*zip(*front), "o-", color=color, label=m.removeprefix("grpo_"), lw=2.5 if m == "grpo_vanilla" else 1.2)
    base = rows[0]["base"]
    ax.scatter([base[MINORITY]], [base[MAJORITY]], marker="*", s=250, color="gold", edgecolor="black", zorder=5,
               label="base policy (step 0)")  # fmt: skip
    ax.axhline(floor, color="gray", ls="--", lw=1, label="the scalarisation's floor")
    ax.set_xlabel("minority pass@16 (the rare procedure kept)")
    ax.set_ylabel("majority mean@16 (the common procedure learned)")
    ax.set_title(f"Each method's Pareto front after {rows[0]['last']['step']} steps (dots: every trial)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def vanilla_floor(rows: list) -> float:
    """The scalarisation's floor: vanilla's best majority mean@16 (the best on its front) minus the margin."""
    vanilla = [r["last"][MAJORITY] for r in rows if r["method"] == "grpo_vanilla"]
    if not vanilla:
        raise SystemExit("error: no complete grpo_vanilla trial: the scalarisation's floor is vanilla's best")
    return max(vanilla) - MARGIN


def report(rows: list, floor: float, link: str) -> tuple:
    """The markdown report (per method its trials, front and picked point, what it keeps; link: tune_confirm.sh from
    the report's folder) and tune_confirm.sh's text."""
    base = rows[0]["base"]
    lines = [
        "# The equal-budget study: results (plan: PLAN.md)",
        "",
        f"Base policy (step 0): majority mean@16 {base[MAJORITY]:.3f}, minority pass@16 {base[MINORITY]:.3f}, "
        f"overall pass@16 {overall_pass(base):.3f}. Floor of the scalarisation: vanilla's best majority mean@16 "
        f"{floor + MARGIN:.3f} - {MARGIN} = {floor:.3f}. Objectives at step {rows[0]['last']['step']}, seed 1.",
        "",
        "| method | trials | front (majority mean@16 / minority pass@16) | picked: overall pass@16 | majority "
        "| minority | its flags |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    confirm = {}  # testbed.sh's name of each configuration: its flags
    for m, own in by_method(rows).items():
        front = sorted((r for r in own if r["front"]), key=lambda r: r["last"][MINORITY])
        shown = ", ".join(f"{r['last'][MAJORITY]:.3f} / {r['last'][MINORITY]:.2f}" for r in front)
        best = pick(own, floor)
        if best is None:
            lines.append(f"| {m} | {len(own)} | {shown} | none within {MARGIN} of vanilla's majority | | | |")
            continue
        last = best["last"]
        lines.append(
            f"| {m} | {len(own)} | {shown} | {overall_pass(last):.3f} (trial {best['trial']}) | {last[MAJORITY]:.3f} "
            f"| {last[MINORITY]:.3f} | `{flag_text(best['flags'])}` |"
        )
        # vanilla keeps its name (compare.py's baseline); a variant's flags start with the script it runs
        name, script = (m, "") if m == "grpo_vanilla" else (f"{m}_tuned", m.removesuffix("_top") + " ")
        confirm[name] = script + flag_text(best["flags"], exact=True)
    lines += ["", *kept_table(rows, floor), "",
              "The confirmation (PLAN.md: 200 steps, seeds 11-13, each picked point beside vanilla's; one seed a "
              f"sitting, ~47 minutes each on 2 cores, 12 runs of ~470 s): [tune_confirm.sh]({link}); its comparison of "
              "all seeds: [confirmation/compare.md](confirmation/compare.md).", ""]  # fmt: skip
    return "\n".join(lines), confirmation(confirm)


def confirmation(flags: dict) -> str:
    """tune_confirm.sh: testbed.sh on the fork testbed for the given seeds (each in its own folder, so that a sitting
    runs one seed and a killed one reruns only its seed), then compare.py over every seed run so far."""
    names = " ".join(flags)
    seed_runs = (
        "  TESTBED=fork SEEDS=$seed OUT=runs/testbed_tuned/seed$seed \\\n"
        "    RESULTS=benchmarks/results/tune/confirmation/seed$seed \\\n"
        f'    METHODS="{names}" bash benchmarks/reproduce/testbed.sh'
    )
    return "\n".join([
        "#!/bin/bash",
        "# The equal-budget study's confirmation (PLAN.md): each method's picked point beside vanilla's, 200 steps on",
        "# the fork testbed, seeds 11-13. Written by benchmarks/tune_report.py from the journals. Run from the root:",
        "#   bash benchmarks/reproduce/tune_confirm.sh 11   # a seed's runs (its folder emptied first), the comparison",
        "#   bash benchmarks/reproduce/tune_confirm.sh      # the comparison of every seed run so far (confirmation/)",
        "set -euo pipefail",
        '[ -f benchmarks/reproduce/testbed.sh ] || { echo "error: run from the repository\'s root" >&2; exit 1; }',
        *(f'export METHOD_FLAGS_{name}="{text}"' for name, text in flags.items()),
        'for seed in "$@"; do',
        seed_runs,
        "done",
        'cmd=("${PY:-.venv/bin/python}" -m benchmarks.compare --runs "runs/testbed_tuned/seed*/*"',
        "     --output-dir benchmarks/results/tune/confirmation --baseline grpo_vanilla --smooth 10)",
        'if [ -n "${DRY_RUN:-}" ]; then echo "${cmd[*]}"; else "${cmd[@]}"; fi',
        "",
    ])  # fmt: skip


def kept_table(rows: list, floor: float) -> list:
    """Per method, what it keeps of the rare procedure at the floor and at all: its trials at the floor and the most
    minority pass@16 among them, the trial that kept most (with its majority mean@16), and its diverged trials."""
    lines = [
        f"What each method keeps (minority pass@16), at the floor and at all (diverged: majority under {DIVERGED}):",
        "",
        "| method | trials at the floor | most kept there | the trial that kept most: majority / minority | diverged |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m, group in by_method(rows).items():
        own = [r["last"] | {"trial": r["trial"]} for r in group]
        at_floor = [r[MINORITY] for r in own if r[MAJORITY] >= floor]
        most = max(own, key=lambda r: (r[MINORITY], r[MAJORITY]))
        lines.append(
            f"| {m} | {len(at_floor)} of {len(own)} | {f'{max(at_floor):.2f}' if at_floor else '-'} "
            f"| {most['trial']}: {most[MAJORITY]:.3f} / {most[MINORITY]:.2f} "
            f"| {sum(r[MAJORITY] < DIVERGED for r in own)} |"
        )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--journals", default="benchmarks/results/tune", help="the folder of the study's <method>.log files")
    p.add_argument("--runs", default="runs/tune", help="the tuner's --output-dir (the trials' runs)")
    p.add_argument("--out", default="benchmarks/results/tune")
    p.add_argument(
        "--script", default="benchmarks/reproduce/tune_confirm.sh", help="where the confirmation's script goes"
    )
    a = p.parse_args(argv)
    journals = sorted(glob.glob(os.path.join(a.journals, "grpo_*.log")))
    if not journals:
        raise SystemExit(f"error: no study journal (grpo_*.log) in {a.journals}")
    rows = [r for j in journals for r in read_trials(j, a.runs)]
    rows.sort(key=lambda r: (r["method"] != "grpo_vanilla", r["method"], r["trial"]))  # vanilla first: the reference
    floor = vanilla_floor(rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "trials.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    text, confirm = report(rows, floor, os.path.relpath(a.script, a.out))
    with open(os.path.join(a.out, "README.md"), "w") as f:
        f.write(text)
    os.makedirs(os.path.dirname(os.path.abspath(a.script)), exist_ok=True)
    with open(a.script, "w") as f:
        f.write(confirm)
    plot(rows, floor, os.path.join(a.out, "fronts.png"))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
