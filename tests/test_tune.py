"""benchmarks/tune.py: a 2-trial study of the real script on the fork testbed, killed while its second trial runs and
resumed from its journal (the killed trial's point runs again, the first trial's result stays); the GPU launcher's
command, dry run, parses as the script's flags."""

import importlib
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
import tyro
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

import grpo_aent as ga
from benchmarks import tune

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def study(journal):
    return optuna.load_study(study_name="grpo_passk", storage=JournalStorage(JournalFileBackend(str(journal))))


def test_a_two_trial_study_resumes_after_a_kill(tmp_path):
    journal, runs = tmp_path / "study.log", tmp_path / "runs"
    argv = [sys.executable, "-m", "benchmarks.tune", "--method", "grpo_passk", "--trials", "2", "--steps", "1"]
    argv += ["--parallel", "1", "--journal", str(journal), "--output-dir", str(runs), "--port", "29790"]
    argv += ["--", "--eval-num-prompts", "4", "--no-use-vllm"]  # every trial: 1 step, evaluated on 4 + 4 prompts
    tuner = subprocess.Popen(argv, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not (runs / "grpo_passk" / "trial_1" / "log.txt").exists():  # trial 0 done, trial 1 started
        assert tuner.poll() is None and time.time() < deadline, tuner.stdout.read().decode()[-3000:]
        time.sleep(0.5)
    os.killpg(tuner.pid, signal.SIGKILL)
    tuner.wait()
    first = study(journal)
    assert [t.state for t in first.trials] == [TrialState.COMPLETE, TrialState.RUNNING]
    resumed = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "trial 1 was running when the tuner stopped" in resumed.stdout
    trials = study(journal).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert trials[0].values == first.trials[0].values and trials[2].params == first.trials[1].params
    assert all(0 <= v <= 1 for t in (trials[0], trials[2]) for v in t.values)
    # a finished study run again (the next sitting of a study of several methods) runs nothing and writes nothing
    before = journal.read_bytes()
    again = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "2 complete trials" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert journal.read_bytes() == before


def test_the_gpu_command_is_the_scripts_own_flags(capsys):
    """--launcher deepspeed --dry-run: DeepSpeed's launcher, then flags the script's parser accepts."""
    tune.main(["--method", "grpo_aent", "--trials", "1", "--journal", "unused", "--launcher", "deepspeed", "--dry-run"])
    cmd = capsys.readouterr().out.split()
    assert cmd[:3] == ["deepspeed", "--num_gpus", "8"] and cmd[5].endswith("grpo_aent.py")
    args = tyro.cli(ga.Args, args=cmd[6:])
    assert args.total_steps == 60 and args.entropy_low <= args.entropy_high


@pytest.mark.parametrize("method", sorted(tune.SPACES))
def test_every_space_gives_flags_its_script_accepts(method):
    """A draw of each method's space parses and passes the script's checks on one rank."""

    script = importlib.import_module(method.removesuffix("_top"))
    flags = tune.suggest(optuna.trial.FixedTrial(tune.defaults(method)), method)
    cmd = tune.command(
        tune.main.__globals__["argparse"].Namespace(launcher="torch", steps=2, seed=1, extra=[]),
        method,
        flags,
        "out",
        1,
    )
    args = tyro.cli(script.Args, args=cmd[cmd.index(next(c for c in cmd if c.endswith(".py"))) + 1 :])
    script.validate_args(args, 1)
