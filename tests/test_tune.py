"""benchmarks/tune.py: a 2-trial study of the real script on the fork testbed, killed while its second trial runs and
resumed from its journal (the killed trial's point runs again, the first trial's result stays); the GPU launcher's
command, dry run, parses as the script's flags."""

import importlib
import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pytest
import torch
import tyro
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

import grpo_aent as ga
from benchmarks import tune

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def study(journal):
    return optuna.load_study(study_name="grpo_passk", storage=JournalStorage(JournalFileBackend(str(journal))))


@pytest.mark.launches
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


def test_concurrent_trials_get_disjoint_gpus():
    """Slot k: GPUs [k x n, (k + 1) x n) of the visible ones; none on a CPU host; too many refused in one line."""
    eight = [str(i) for i in range(8)]
    assert tune.slot_devices(eight, 2, 4, "--num-gpus 4") == ["0,1,2,3", "4,5,6,7"]
    assert tune.slot_devices(eight, 2, 1, "1 GPU a trial (--launcher torch)") == ["0", "1"]
    assert tune.slot_devices(["4", "5", "6", "7"], 2, 2, "--num-gpus 2") == ["4,5", "6,7"]  # within the tuner's own
    assert tune.slot_devices([], 2, 8, "--num-gpus 8") == [None, None]  # a CPU host: the environment unchanged
    with pytest.raises(ValueError) as refused:
        tune.slot_devices(["0"], 2, 1, "1 GPU a trial (--launcher torch)")
    assert (
        str(refused.value)
        == "--parallel 2 x 1 GPU a trial (--launcher torch) needs 2 GPUs, 1 visible (0): lower --parallel"
    )
    with pytest.raises(ValueError, match=r"^--parallel 2 x --num-gpus 8 needs 16 GPUs, 8 visible .* or --num-gpus$"):
        tune.slot_devices(eight, 2, 8, "--num-gpus 8")


def test_visible_gpus_respects_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert tune.visible_gpus() == ["0", "1", "2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5,6,7,x")  # what CUDA counts: up to the first invalid entry
    assert tune.visible_gpus() == ["4", "5", "6", "7"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a CPU host with a stray variable
    assert tune.visible_gpus() == []


def test_more_trials_than_gpus_is_refused_before_the_study(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tune, "visible_gpus", lambda: ["0"])
    journal = tmp_path / "study.log"
    argv = ["--method", "grpo_passk", "--trials", "2", "--journal", str(journal), "--parallel", "2"]
    assert tune.main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "tune.py: error: --parallel 2 x 1 GPU a trial (--launcher torch) needs 2 GPUs, 1 visible (0): lower --parallel"
    ]
    assert not journal.exists()


@pytest.mark.parametrize("gpus", [8, 0])
def test_each_trial_runs_with_its_slots_gpus(tmp_path, monkeypatch, capsys, gpus):
    """The study's own objective (subprocess.run stood in for): on 8 GPUs, 2 trials x 4 at a time, each trial's
    environment carries its slot's CUDA_VISIBLE_DEVICES, DeepSpeed's launcher gets no --num_gpus (it would ignore the
    variable), trials running together hold disjoint GPUs; on a CPU host the command and environment are unchanged."""
    monkeypatch.setattr(tune, "visible_gpus", lambda: [str(i) for i in range(gpus)])
    runs, running, lock = [], [], threading.Lock()

    def run(cmd, stdout, stderr, env):
        devices = None if env is None else env["CUDA_VISIBLE_DEVICES"]
        with lock:
            assert not any(set(devices.split(",")) & set(d.split(",")) for d in running if d and devices)
            running.append(devices)
            runs.append((cmd, env))
        time.sleep(0.3)  # the two slots' trials overlap
        run_dir = os.path.join(cmd[cmd.index("--output-dir") + 1], "run")
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.write('{"eval/majority/mean_acc": 0.5, "eval/minority/pass@16": 0.25}\n')
        with lock:
            running.remove(devices)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(tune.subprocess, "run", run)
    argv = ["--method", "grpo_passk", "--trials", "4", "--journal", str(tmp_path / "study.log"), "--parallel", "2"]
    argv += ["--output-dir", str(tmp_path / "runs"), "--launcher", "deepspeed", "--num-gpus", "4"]
    assert tune.main(argv) == 0 and len(runs) == 4
    if gpus:
        assert sorted(env["CUDA_VISIBLE_DEVICES"] for _, env in runs) == ["0,1,2,3"] * 2 + ["4,5,6,7"] * 2
        assert all(env["PATH"] == os.environ["PATH"] for _, env in runs)  # the tuner's environment, plus the devices
        assert all(cmd[:2] == ["deepspeed", "--master_port"] for cmd, _ in runs), runs[0][0]
        text = (tmp_path / "runs" / "grpo_passk" / "trial_0" / "command.txt").read_text()
        assert text.startswith(("CUDA_VISIBLE_DEVICES=0,1,2,3 deepspeed ", "CUDA_VISIBLE_DEVICES=4,5,6,7 deepspeed "))
    else:
        assert all(env is None and cmd[:3] == ["deepspeed", "--num_gpus", "4"] for cmd, env in runs)
    capsys.readouterr()
    tune.main([*argv, "--dry-run"])
    shown = capsys.readouterr().out
    assert shown.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3 deepspeed --master_port" if gpus else "deepspeed --num_gpus")
