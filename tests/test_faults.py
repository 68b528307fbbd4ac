"""What else real runs meet: NaNs, preemption signals, slow rewards, bad data.

The real scripts on the CPU testbed; faults are injected into real library calls by tests/inject.py.
"""

import glob
import json
import math
import os
import signal
import subprocess
import time

import pytest
import torch
from launch import (
    COMMON,
    NOISE,
    ForkedRun,
    checkpoints,
    fault_flags,
    final_weights,
    read_metrics,
    rollout_flags,
    run_dir,
    run_script,
    script_argv,
    script_flags,
)

pytestmark = pytest.mark.launches  # every test here launches a run (conftest.py)


def test_nan_on_one_rank_skips_that_update_on_every_rank_and_keeps_the_learning_rate_schedule(testbed, tmp_path):
    """Rank 1 alone gets a NaN loss in step 2: neither rank applies that update, and the run goes on. DeepSpeed steps
    the LR scheduler only on applied updates (engine.py _take_model_step); the scripts step it on a skipped one too,
    so the warm-up follows the training steps: the learning rate is the one an uninterrupted run has at every step
    (5e-4 x (s + 1) / 5 after step s, 4 warm-up steps, 1 update per step)."""
    common = {**COMMON, "num-mini-batches": 1, "total-steps": 3, "keep-checkpoints": 3, "warmup-steps": 4}
    # per step and rank: 2 prompts x 4 samples, micro-batches of 4: rank 1's 3rd backward is in step 2
    flags = script_flags(testbed, **common, **{"no-use-vllm": True})
    run_script("grpo_vanilla.py", flags, tmp_path, nproc=2, fault="nan-loss:3:1")
    path = run_dir(tmp_path)
    rows = read_metrics(path)
    assert [r["losses/skipped_updates"] for r in rows] == [0, 1, 0]
    assert [r["charts/lr"] for r in rows] == pytest.approx([5e-4 * (s + 1) / 5 for s in (1, 2, 3)])
    assert math.isnan(rows[1]["losses/grad_norm"]) and all(math.isfinite(rows[i]["losses/grad_norm"]) for i in (0, 2))
    modules = [
        torch.load(f, weights_only=False)["module"]
        for f in sorted(glob.glob(f"{path}/checkpoints/step_*/state/mp_rank_00_model_states.pt"))
    ]
    assert all(
        torch.equal(modules[0][k], modules[1][k]) for k in modules[0]
    )  # step 2 changed nothing (Adam momentum would)
    assert any(not torch.equal(modules[1][k], modules[2][k]) for k in modules[0])
    assert all(torch.isfinite(v).all() for v in final_weights(path).values())
    for ckpt in checkpoints(path):  # rank agreement: the same step and method state on both ranks at every checkpoint
        states = [torch.load(f"{path}/checkpoints/{ckpt}/rng_rank{r}.pt", weights_only=False)["state"] for r in (0, 1)]
        assert states[0] == states[1] and json.loads(states[0])["step"] == int(ckpt[5:])


def test_persistent_nan_aborts_with_a_clear_message_and_finite_weights(testbed, tmp_path):
    common = {
        **COMMON,
        "num-mini-batches": 1,
        "micro-batch-size": 8,
        "total-steps": 6,
        "max-bad-steps": 2,
        "no-use-vllm": True,
    }
    # 2 backward calls per step: from step 2 on every loss is NaN
    proc = run_script(
        "grpo_vanilla.py", script_flags(testbed, **common), tmp_path, nproc=0, fault="nan-loss:3+", check=False
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("error: 2 consecutive steps had a non-finite gradient"), (
        proc.stderr[-2000:]
    )
    path = run_dir(tmp_path)
    assert [r["losses/skipped_updates"] for r in read_metrics(path)] == [0, 1, 1]
    assert not os.path.exists(os.path.join(path, "final"))
    module = torch.load(f"{path}/checkpoints/step_0000002/state/mp_rank_00_model_states.pt", weights_only=False)[
        "module"
    ]
    assert all(torch.isfinite(v).all() for v in module.values())


def wait_for_step(path_glob, step, proc, timeout=300):
    start = time.time()
    while time.time() - start < timeout:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        for metrics in glob.glob(path_glob):
            with open(metrics) as f:
                if sum(1 for line in f if line.endswith("\n")) >= step:
                    return os.path.dirname(metrics)
        time.sleep(0.2)
    raise TimeoutError(path_glob)


def filtered_rollout_flags(tb, script, **overrides):
    """rollout_flags with dynamic sampling under ZeRO-3: KL-Cov's run beside a rollout rank (test_rollout_ranks.py)."""
    return rollout_flags(tb, script, **{"filter-groups": True, "zero-stage": 3, **overrides})


@pytest.mark.parametrize(
    "script, nproc, sig, flags",
    [
        ("grpo_vanilla.py", 2, signal.SIGTERM, fault_flags),
        ("grpo_aent.py", 0, signal.SIGINT, fault_flags),
        ("grpo_klcov.py", 3, signal.SIGTERM, filtered_rollout_flags),  # to the rollout rank, batches in flight (s = 1)
    ],
)
def test_preemption_signal_checkpoints_and_exits_cleanly(testbed, tmp_path, script, nproc, sig, flags):
    """A scheduler's SIGTERM (here to one rank only) or a Ctrl-C: every rank stops after the step, one checkpoint."""
    argv, env = script_argv(script, flags(testbed, script, **{"total-steps": 1000, "save-every": 0}), tmp_path)
    proc = ForkedRun(argv, env, nproc)
    path = wait_for_step(f"{tmp_path}/*/metrics.jsonl", 1, proc)
    os.kill(proc.pids[-1], sig)  # the last rank, or the one process
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    stopped = len(read_metrics(path))
    assert f"stopped by signal after step {stopped}" in out + err
    assert checkpoints(path) == [f"step_{stopped:07d}"] and not os.path.exists(os.path.join(path, "final"))
    # and it resumes from there (a longer or shorter run: --total-steps may change)
    run_script(script, flags(testbed, script, **{"total-steps": stopped + 1, "resume": path}), tmp_path, nproc)
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == list(range(1, stopped + 2))
    if flags is filtered_rollout_flags:  # dynamic sampling ran; step 1's batch on-policy, the later ones stale
        assert all(r["rollout/gen_rounds"] >= 1 for r in rows)
        gaps = [r["rollout/vllm_logprob_gap"] for r in rows]
        assert gaps[0] < NOISE < min(gaps[1:])


def test_slow_rewards_and_bad_rows_are_counted_never_hang(testbed, tmp_path):
    """Reference answers that make math-verify time out, rows without a problem or an answer, an over-long prompt."""
    with open(testbed.train_file) as f:
        rows = [json.loads(line) for _, line in zip(range(4), f)]
    tower = "9^{9^{9^{9^9}}}"  # comparing any number with it runs past the grading time limit
    bad = [{**r, "answer": tower} for r in rows] + [
        {"problem": "", "answer": "1"},
        {"problem": "What is 1 + 1?", "answer": None},
        {"problem": "What is 1 + 1? " * 300, "answer": "2"},
    ]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in bad))
    start = time.time()
    proc = run_script(
        "grpo_vanilla.py",
        script_flags(testbed, dataset=data, **{"total-steps": 1, "group-size": 2, "no-use-vllm": True}),
        tmp_path / "out",
        nproc=0,
    )
    assert "skipped 2 of 7 rows with an empty problem or answer" in proc.stderr
    assert "4 training prompts (1 dropped: longer than 128 tokens)" in proc.stdout
    (row,) = read_metrics(run_dir(tmp_path / "out"))
    assert row["rollout/reward"] == 0 and row["rollout/reward_failures"] >= 6  # 8 samples; one may lack a \boxed{}
    assert row["time/step"] < 8 * 1.5 * 3 and time.time() - start < 240  # 1.5 CPU-s per answer, a busy machine


def test_disk_full_during_a_periodic_checkpoint_warns_and_training_goes_on(testbed, tmp_path):
    """ENOSPC in rank 0's write of step 2's engine state (2 ranks: rank 1 is waiting in DeepSpeed's closing barrier):
    a warning naming the cause, no partial directory left, training goes on, the later checkpoints are written."""
    flags = fault_flags(testbed, "grpo_vanilla.py", **{"no-use-vllm": True})
    proc = run_script("grpo_vanilla.py", flags, tmp_path, nproc=2, fault="disk-full:3:0")
    assert "warning: checkpoint of step 2 not written: no space left on the device" in proc.stderr, proc.stderr[-3000:]
    path = run_dir(tmp_path)
    assert checkpoints(path) == ["step_0000003", "step_0000004"] and os.path.exists(os.path.join(path, "final"))
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_disk_too_small_for_any_checkpoint_is_a_warning_then_one_line(testbed, tmp_path):
    """--output-dir on a real 4 MB tmpfs, too small for the testbed's ~6 MB checkpoint: each periodic checkpoint is
    skipped with a warning (free and needed space named), the final one is a one-line error; nothing partial is left."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        flags = script_flags(testbed, **{"total-steps": 2, "save-every": 1, "no-use-vllm": True})
        proc = run_script("grpo_vanilla.py", flags, mount, nproc=0, check=False)
        path = run_dir(mount)
        listed = sorted(os.listdir(os.path.join(path, "checkpoints")))
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines[-1].startswith("error: checkpoint of step 2 not written: not enough free"), (
        lines[-3:]
    )
    assert "needs ~" in lines[-1] and "newest complete checkpoint: none yet" in lines[-1]
    assert "warning: checkpoint of step 1 not written: not enough free space" in proc.stderr
    assert listed == []


def test_rollout_correction_weights_the_loss_by_the_sampler_mismatch(testbed, tmp_path):
    """A sampler that reports every token 3x less likely than the trainer finds it (injected into vLLM's output): with
    --vllm-is-cap 0 the loss is not corrected; token-truncate at C = 4 weights each token's loss by the ratio 3, at
    C = 2 by the cap 2; token-mask at C = 2 drops every token (ratio 3 > 2: no loss, no gradient); sequence-truncate
    at C = 4 weights by the cap (the sequences' products 3^n > 4); geo-mask at C = 4 keeps every sequence (geometric
    mean 3) at weight 1: the same samples, the loss and the gradient scaled by exactly that."""
    runs = {  # (flags, the weight of every token, truncated, masked)
        "off": ({"vllm-is-cap": 0}, 1.0, 0.0, 0.0),
        "c2": ({"vllm-is-cap": 2}, 2.0, 1.0, 0.0),
        "c4": ({"vllm-is-cap": 4}, 3.0, 0.0, 0.0),
        "token-mask c2": ({"vllm-is-cap": 2, "rollout-correction": "token-mask"}, 0.0, 0.0, 1.0),
        "sequence-truncate c4": ({"vllm-is-cap": 4, "rollout-correction": "sequence-truncate"}, 4.0, 1.0, 0.0),
        "geo-mask c4": ({"vllm-is-cap": 4, "rollout-correction": "geo-mask", "vllm-is-min": 0.5}, 1.0, 0.0, 0.0),
    }
    rows = {}
    for k, (name, (flags, *_)) in enumerate(runs.items()):
        flags = script_flags(testbed, **{"total-steps": 1, **flags})
        run_script("grpo_vanilla.py", flags, tmp_path / str(k), fault="sampler-ratio:1+", env={"GRPO_RATIO": "3"})
        (rows[name],) = read_metrics(run_dir(tmp_path / str(k)))
    base = rows["off"]
    assert base["rollout/vllm_logprob_gap"] == pytest.approx(math.log(3), rel=1e-3)
    assert base["losses/grad_norm"] > 0 and base["losses/policy_loss"] != 0
    for name, (_, weight, truncated, masked) in runs.items():
        r = rows[name]
        assert r["rollout/reward"] == base["rollout/reward"] and r["entropy/full"] == base["entropy/full"]
        assert r["rollout/is_weight_mean"] == pytest.approx(weight, rel=1e-3), name
        assert (r["rollout/is_clipped_frac"], r["rollout/is_masked_frac"]) == (truncated, masked), name
        for key in ("losses/policy_loss", "losses/grad_norm"):
            assert r[key] == pytest.approx(weight * base[key], rel=1e-3), (name, key)
