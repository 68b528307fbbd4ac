"""benchmarks/tune_report.py on two hand-made studies (journals as the tuner writes them, each trial's metrics.jsonl):
the Pareto front, the plan's scalarisation (the floor is vanilla's best majority mean@16 minus 0.05; then the highest
overall pass@16, ties to the higher majority), and the confirmation's command as testbed.sh runs it (the script in
reproduce/, the report linking to it)."""

import json
import os
import subprocess

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from benchmarks import tune, tune_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {"eval/majority/mean_acc": 0.48, "eval/majority/pass@16": 0.99, "eval/minority/pass@16": 0.84}


def distributions(method):
    """Each flag's distribution as tune.suggest draws it (the journal stores a value with its distribution)."""
    out = {}
    for flag, (kind, *spec) in {**tune.SPACES[method], **tune.SHARED}.items():
        if kind == "choice":
            out[flag] = CategoricalDistribution(spec[0])
        else:
            out[flag] = (IntDistribution if kind == "int" else FloatDistribution)(spec[0], spec[1], log=kind == "log")
    return out


def make_study(journals, runs, method, flag, trials):
    """A study of (flag value, majority mean@16, majority pass@16, minority pass@16) trials, as tune.py leaves it
    (flag: one flag's name, or several names and each trial's value a tuple; the space's other flags at its corner)."""
    storage = JournalStorage(JournalFileBackend(str(journals / f"{method}.log")))
    study = optuna.create_study(study_name=method, storage=storage, directions=["maximize", "maximize"])
    for n, (value, major, major_pass, minor) in enumerate(trials):
        params = {**tune.defaults(method), **(dict(zip(flag, value)) if isinstance(flag, tuple) else {flag: value})}
        study.add_trial(
            optuna.trial.create_trial(params=params, distributions=distributions(method), values=[major, minor])
        )
        run = runs / method / f"trial_{n}" / f"{method}__1__0"
        run.mkdir(parents=True)
        last = {"eval/majority/mean_acc": major, "eval/majority/pass@16": major_pass, "eval/minority/pass@16": minor}
        rows = [{"step": 0, **BASE}, {"step": 30, "train/loss": 0.1}, {"step": 60, **last}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.launches
def test_fronts_picks_and_the_confirmation_command(tmp_path):
    journals, runs, out = tmp_path / "journals", tmp_path / "runs", tmp_path / "out"
    script = str(tmp_path / "reproduce" / "tune_confirm.sh")
    journals.mkdir()
    # vanilla's best majority 0.95: the floor 0.90
    make_study(journals, runs, "grpo_vanilla", "kl-coef", [(0.0, 0.95, 1.0, 0.0), (0.1, 0.90, 1.0, 0.10)])
    # trial 0: the highest overall pass@16 (0.75) but under the floor; trials 1 and 2 tie at 0.60 (2 has the higher
    # majority); trial 3 is dominated
    make_study(
        journals, runs, "grpo_cispo", "clip-eps-high",
        [(4.0, 0.70, 1.0, 0.50), (0.2, 0.91, 1.0, 0.20), (0.3, 0.92, 0.9, 0.30), (0.5, 0.80, 0.9, 0.05)],
    )  # fmt: skip
    # every trial under the floor; trial 1 diverged
    make_study(journals, runs, "grpo_sapo", "sapo-tau-pos", [(1.0, 0.50, 1.0, 0.6), (2.0, 0.20, 0.5, 0.0)])
    tune_report.main(["--journals", str(journals), "--runs", str(runs), "--out", str(out), "--script", script])

    rows = [json.loads(line) for line in open(out / "trials.jsonl")]
    assert [r["method"] for r in rows][:2] == ["grpo_vanilla", "grpo_vanilla"]  # the reference first
    fronts = {(r["method"], r["trial"]) for r in rows if r["front"]}
    assert fronts == {("grpo_vanilla", 0), ("grpo_vanilla", 1), ("grpo_cispo", 0), ("grpo_cispo", 2), ("grpo_sapo", 0)}
    assert all(r["base"] == {"step": 0, **BASE} and r["last"]["step"] == 60 for r in rows)
    cispo = [r for r in rows if r["method"] == "grpo_cispo"]
    assert tune_report.pick(cispo, 0.90)["trial"] == 2
    assert tune_report.pick(cispo, 0.60)["trial"] == 0 and tune_report.pick(cispo, 0.99) is None

    text = (out / "README.md").read_text()
    assert "floor" in text.lower() and "0.900" in text and "| grpo_sapo | 2 |" in text and "none within 0.05" in text
    # what each keeps: cispo's trials 1 and 2 reach the floor (0.30 the most kept there), its trial 0 kept most; sapo
    # has none at the floor, and its trial 1 diverged (majority under 0.3)
    assert "| grpo_cispo | 2 of 4 | 0.30 | 0: 0.700 / 0.50 | 0 |" in text
    assert "| grpo_sapo | 0 of 2 | - | 0: 0.500 / 0.60 | 1 |" in text
    assert (out / "fronts.png").stat().st_size > 10_000
    # the confirmation as written, run by testbed.sh (dry run): vanilla under its own name, each method's picked flags
    assert "[tune_confirm.sh](../reproduce/tune_confirm.sh)" in text and not (out / "confirm.sh").exists()
    dry = subprocess.run(["bash", script, "11", "12", "13"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "DRY_RUN": "1"})  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    launches = [line for line in dry.stdout.splitlines() if "torch.distributed.run" in line]
    assert len(launches) == 6  # 2 methods x 3 seeds
    vanilla = [c for c in launches if "grpo_vanilla.py" in c]
    assert len(vanilla) == 3 and all(
        "--kl-coef 0.1 --learning-rate 5e-05 --num-mini-batches 1 --exp-name grpo_vanilla " in c for c in vanilla
    )
    cispo_runs = [c for c in launches if "grpo_cispo.py" in c]
    assert all(
        "--clip-eps-high 0.3 --clip-eps-low 0.2 --learning-rate 5e-05 --num-mini-batches 1 --exp-name grpo_cispo_tuned"
        in c
        for c in cispo_runs
    )
    assert {c.split("--seed ")[1].split()[0] for c in launches} == {"11", "12", "13"}
    # each seed in its own folder; the comparison over all of them, in the study's folder (not the main testbed's)
    for seed in (11, 12, 13):
        assert f"--output-dir runs/testbed_tuned/seed{seed} " in dry.stdout
        assert f"--output-dir benchmarks/results/tune/confirmation/seed{seed} " in dry.stdout
    assert dry.stdout.rstrip().endswith(
        "-m benchmarks.compare --runs runs/testbed_tuned/seed*/* --output-dir benchmarks/results/tune/confirmation "
        "--baseline grpo_vanilla --smooth 10"
    )
    elsewhere = subprocess.run(["bash", script], cwd=out, capture_output=True, text=True, timeout=60)
    assert elsewhere.returncode == 1 and "run from the repository's root" in elsewhere.stderr


def test_the_flags_are_the_tuners_own(tmp_path):
    """AEnt's box is two draws put in order by tune.suggest: the report's flags are the ordered ones, and they are
    checked against the command the tuner recorded (a trial whose record differs stops the report)."""
    journals, runs = tmp_path / "journals", tmp_path / "runs"
    journals.mkdir()
    make_study(journals, runs, "grpo_vanilla", "kl-coef", [(0.0, 0.95, 1.0, 0.0)])
    box = ("entropy-low", "entropy-high", "entropy-coef", "clamp-p", "entropy-coef-lr", "entropy-coef-warmup")
    make_study(journals, runs, "grpo_aent", (*box, "learning-rate", "num-mini-batches"),
               [((0.06, 0.02, 0.1, 0.3, 0.5, 5, 1e-4, 2), 0.9, 1.0, 0.2)])  # fmt: skip
    record = runs / "grpo_aent" / "trial_0" / "command.txt"
    ran = "--entropy-low 0.02 --entropy-high 0.06 --entropy-coef 0.1 --clamp-p 0.3 --entropy-coef-lr 0.5"
    record.write_text(
        f"python grpo_aent.py {ran} --entropy-coef-warmup 5 --learning-rate 0.0001 --num-mini-batches 2\n"
    )
    argv = ["--journals", str(journals), "--runs", str(runs), "--out", str(tmp_path / "out")]
    argv += ["--script", str(tmp_path / "tune_confirm.sh")]
    tune_report.main(argv)
    (aent,) = [json.loads(line) for line in open(tmp_path / "out" / "trials.jsonl") if "grpo_aent" in line]
    assert aent["flags"]["entropy-low"] == 0.02 and aent["flags"]["entropy-high"] == 0.06
    record.write_text(record.read_text().replace("--num-mini-batches 2", "--num-mini-batches 4"))
    with pytest.raises(SystemExit, match="does not hold the flags"):
        tune_report.main(argv)


def test_no_vanilla_study_is_a_one_line_error(tmp_path):
    journals = tmp_path / "journals"
    journals.mkdir()
    make_study(journals, tmp_path / "runs", "grpo_cispo", "clip-eps-high", [(0.2, 0.9, 1.0, 0.2)])
    with pytest.raises(SystemExit, match="no complete grpo_vanilla trial"):
        tune_report.main(["--journals", str(journals), "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "o")])
    os.remove(tmp_path / "runs" / "grpo_cispo" / "trial_0" / "grpo_cispo__1__0" / "metrics.jsonl")
    with pytest.raises(SystemExit, match="grpo_cispo trial 0: 0 runs"):
        tune_report.main(["--journals", str(journals), "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "o")])
