"""--rollout-ranks: the real scripts on the CPU testbed, 2 trainers and 1 rollout rank (utils/split_launch.py): at
--max-staleness 0 the colocated run's trajectory; at 1 one trajectory per seed, through a kill and its resume; every
method script once in this mode; a rank that dies stops the job with one line from each rank left; a run's end joins
the gloo threads of the groups between the worlds."""

import os
import re

import pytest
from launch import (
    CPU_ENV,
    NOISE,
    ROOT,
    assert_same_run,
    checkpoints,
    free_port,
    read_metrics,
    rollout_flags,
    run_dir,
    run_python,
    run_script,
)

pytestmark = pytest.mark.launches  # every test here launches a run (conftest.py)


@pytest.mark.xdist_group("test_crash")  # the worker that holds `straight`'s vanilla run (conftest.py)
def test_without_staleness_the_run_is_the_colocated_one(testbed, straight, tmp_path):
    run_script("grpo_vanilla.py", rollout_flags(testbed, "grpo_vanilla.py", staleness=0), tmp_path, nproc=3)
    path = run_dir(tmp_path)
    assert_same_run(straight("grpo_vanilla.py"), path)  # the same samples: every metric, the final weights
    assert all(r["time/rollout_wait"] > 0 for r in read_metrics(path))


def test_one_step_off_is_one_trajectory_through_a_kill_and_its_resume(testbed, tmp_path):
    """AEnt at s = 1 twice: uninterrupted, and killed in step 3's first update (trainer 0), then resumed from step 2's
    checkpoint, which holds step 3's batch, generated before the kill by step 1's weights."""
    flags = rollout_flags(testbed, "grpo_aent.py")
    run_script("grpo_aent.py", flags, tmp_path / "a", nproc=3)
    proc = run_script("grpo_aent.py", flags, tmp_path / "b", nproc=3, fault="kill-step:5:0", check=False)
    # the rollout rank's line names the trainer its link (trainer 0) or its sender (trainer 0 or 1) found gone first
    assert proc.returncode != 0 and re.search(r"error: trainer rank [01] stopped", proc.stderr), proc.stderr[-3000:]
    assert_one_line_each(proc.stderr, 2)  # the rollout rank's, and the other trainer's
    path = run_dir(tmp_path / "b")
    assert checkpoints(path)[-1] == "step_0000002"
    run_script("grpo_aent.py", rollout_flags(testbed, "grpo_aent.py", resume=path), tmp_path / "b", nproc=3)
    assert_same_run(run_dir(tmp_path / "a"), path)
    gaps = [r["rollout/vllm_logprob_gap"] for r in read_metrics(path)]
    assert gaps[0] < NOISE < min(gaps[1:])  # step 1's batch is on-policy, the later ones one update behind


@pytest.mark.parametrize(
    "script, flags, nproc",
    [
        # evaluation; 2 trainers and 2 engines of their own (data-parallel: each rollout rank plays one trainer)
        ("grpo_clipcov.py", {"eval-every": 2, "eval-samples": 2, "eval-num-prompts": 6, "rollout-ranks": 2}, 4),
        # the 80/20 rule's global selection; 1 trainer, 2 rollout ranks sharing one tensor-parallel engine
        ("grpo_entadv.py", {"top-entropy-quantile": 0.5, "rollout-ranks": 2, "vllm-tensor-parallel-size": 2}, 3),
    ],
)
def test_every_method_runs_one_step_off(testbed, tmp_path, script, flags, nproc):
    """KL-Cov's run in this mode, with dynamic sampling under ZeRO-3, is test_faults' preemption of a rollout rank."""
    extra = {"eval-dataset": testbed.test_file} if "eval-every" in flags else {}
    run_script(script, rollout_flags(testbed, script, **flags, **extra), tmp_path, nproc=nproc)
    metrics = read_metrics(run_dir(tmp_path))
    train = [r for r in metrics if "rollout/reward" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert train[0]["rollout/vllm_logprob_gap"] < NOISE < min(r["rollout/vllm_logprob_gap"] for r in train[1:])
    if "eval-every" in flags:
        assert [r["step"] for r in metrics if "eval/acc" in r] == [0, 2, 4]


def test_a_dying_rollout_rank_stops_the_job_with_one_line(testbed, tmp_path):
    # the rollout rank is rank 0 of its world: only it calls vLLM's generate (evaluation is off)
    proc = run_script(
        "grpo_vanilla.py",
        rollout_flags(testbed, "grpo_vanilla.py"),
        tmp_path,
        nproc=3,
        fault="kill-generate:3:0",
        check=False,
    )
    assert proc.returncode != 0 and "error: rollout rank 2 stopped (" in proc.stderr, proc.stderr[-3000:]
    assert_one_line_each(proc.stderr, 2)  # the trainers'


def assert_one_line_each(stderr: str, ranks: int) -> None:
    """Each rank left ends with one "error:" line: one blocked on the rollout link names the rank that stopped, one in a
    DeepSpeed collective says that a process has ended (distributed.one_line_when_a_peer_is_gone); no traceback."""
    assert stderr.count("error: ") == ranks and "Traceback" not in stderr, stderr[-3000:]


def test_the_second_thread_to_find_a_peer_gone_lets_the_first_print_its_line():
    """A rollout rank's main thread and sender both end the process after a peer is gone (rollout_rank._say_once, then
    os._exit): the first's line comes out even when the second ends the process while the first is printing (the one
    line once missing after trainer 0's kill in the test above)."""
    proc = run_python([os.path.join(ROOT, "tests", "two_tellers.py")], {**os.environ, **CPU_ENV}, timeout=60)
    assert proc.returncode == 1 and proc.stderr.count("error: ") == 1, proc.stderr[-3000:]
    assert "error: the first thread's line" in proc.stderr, proc.stderr[-3000:]


def test_a_run_end_leaves_no_gloo_thread_to_the_interpreter_exit():
    """The scripts' end of a run (tests/end_of_run.py: process.shutdown, serve's end), 2 trainers and a rollout rank:
    no gloo worker thread may outlive it. One alive at the interpreter's exit can still be waiting for the GIL to drop
    its last collective's tensors when finalization begins, which ends it inside a noexcept destructor: std::terminate
    after a complete run (issue 42; the fork server's runs skip finalization, so the threads are what is checked)."""
    env = {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port())}
    proc = run_python([os.path.join(ROOT, "tests", "end_of_run.py")], env, nproc=3, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("gloo workers at exit: 0") == 3, proc.stdout
