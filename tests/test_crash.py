"""Crash safety: runs killed (SIGKILL) in generation, an optimizer step or a checkpoint write resume on the same
trajectory; resume refuses changed settings. The real scripts on the CPU testbed; kills are injected into real
library calls by tests/inject.py.
"""

import os
import shutil
import signal

import pytest
from launch import COMMON, assert_same_run, checkpoints, fault_flags, read_metrics, run_dir, run_script, trainer_state

pytestmark = pytest.mark.launches  # every test here launches a run (conftest.py)

# the tests sharing vanilla's uninterrupted run (conftest.py straight; test_dynamic_sampling's too): on one xdist
# worker (make test: --dist loadgroup), the others anywhere
SHARED = pytest.mark.xdist_group("test_crash")


@pytest.mark.parametrize(
    "script, fault, complete",
    [
        pytest.param("grpo_vanilla.py", "kill-generate:3", 2, marks=SHARED),  # step 3's rollouts; vanilla's run
        ("grpo_aent.py", "kill-step:5", 2),  # step 3's first optimizer update
        ("grpo_klcov.py", "kill-step:6", 2),  # step 3's second update: the first one is already applied
        ("grpo_clipcov.py", "kill-save:2", 1),  # writing step 2's checkpoint: engine state written, not yet complete
    ],
)
def test_killed_run_resumes_from_its_last_complete_checkpoint_on_the_same_trajectory(
    testbed, tmp_path, straight, script, fault, complete
):
    proc = run_script(script, fault_flags(testbed, script), tmp_path, nproc=0, fault=fault, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    path = run_dir(tmp_path)
    done = [c for c in checkpoints(path) if c.startswith("step_")]
    assert done[-1] == f"step_{complete:07d}" and len(done) <= COMMON["keep-checkpoints"]
    assert trainer_state(path)["step"] == complete
    run_script(script, fault_flags(testbed, script, resume=path), tmp_path, nproc=0)
    assert [c for c in checkpoints(path)] == ["step_0000003", "step_0000004"]  # no leftover temporary directory
    assert_same_run(straight(script), path)


@SHARED
def test_resume_refuses_changed_training_settings(testbed, straight, tmp_path):
    path = shutil.copytree(straight("grpo_vanilla.py"), tmp_path / "run")
    proc = run_script(
        "grpo_vanilla.py",
        fault_flags(testbed, "grpo_vanilla.py", **{"resume": path, "learning-rate": 1e-3, "clip-eps-high": 0.28}),
        tmp_path / "a",
        nproc=0,
        check=False,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith("error: --resume"), proc.stderr[-2000:]
    assert (
        "--learning-rate 0.0005 -> 0.001" in last
        and "--clip-eps-high 0.2 -> 0.28" in last
        and "--resume-allow-changes" in last
    )
    proc = run_script(
        "grpo_vanilla.py", fault_flags(testbed, "grpo_vanilla.py", resume=path), tmp_path / "c", nproc=2, check=False
    )
    assert "error: --resume" in proc.stderr and "written by 1 processes, launched with 2" in proc.stderr, proc.stderr[
        -2000:
    ]
    # allowed explicitly (and --total-steps may always change): trains on from step 4
    run_script(
        "grpo_vanilla.py",
        fault_flags(
            testbed,
            "grpo_vanilla.py",
            **{"resume": path, "learning-rate": 1e-3, "total-steps": 5, "resume-allow-changes": True},
        ),
        tmp_path / "b",
        nproc=0,
    )
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]


@SHARED
def test_damaged_newest_checkpoint_resumes_from_the_older_intact_one(testbed, straight, tmp_path):
    """The newest checkpoint's model file cut to 1000 bytes (a failing disk, a partial copy): detected by its recorded
    size and sha256 before anything loads, named in a warning; the run resumes from the older checkpoint and follows
    the uninterrupted run's trajectory. With every checkpoint damaged: one line."""
    path = shutil.copytree(straight("grpo_vanilla.py"), tmp_path / "run")
    damaged = os.path.join(path, "checkpoints", "step_0000004", "state", "mp_rank_00_model_states.pt")
    os.truncate(damaged, 1000)
    proc = run_script("grpo_vanilla.py", fault_flags(testbed, "grpo_vanilla.py", resume=path), tmp_path / "a", nproc=0)
    assert "warning: checkpoint" in proc.stderr and "step_0000004 is damaged" in proc.stderr, proc.stderr[-2000:]
    assert "state/mp_rank_00_model_states.pt has 1000 bytes" in proc.stderr, proc.stderr[-2000:]
    assert checkpoints(path) == ["step_0000003", "step_0000004"]
    assert_same_run(straight("grpo_vanilla.py"), path)
    for step in (3, 4):
        os.truncate(os.path.join(path, "checkpoints", f"step_{step:07d}", "rng_rank0.pt"), 10)
    proc = run_script(
        "grpo_vanilla.py", fault_flags(testbed, "grpo_vanilla.py", resume=path), tmp_path / "b", nproc=0, check=False
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith("error: --resume") and "every checkpoint is damaged" in last, last
