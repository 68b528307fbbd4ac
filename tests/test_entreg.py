"""Entropy regularisation (grpo_entreg.py): the plain bonus as a constant coefficient, its schedules in a run and in
its checkpoints, and the target rule (--coef-rule target, Skywork-OR1's and TRL 1.16's) synced with the 80/20 rule,
against TRL's update and Skywork-OR1's controller replayed on a run's log, resume. The clamped entropy it takes with
--clamp-p: tests/test_aent.py."""

import math
import signal

import numpy as np
import pytest
from launch import read_metrics, run_dir, run_script, script_flags, trainer_state

import grpo_entreg as ge

# the tests sharing its module-scoped runs: on one xdist worker (make test: --dist loadgroup), the others anywhere
SHARED = pytest.mark.xdist_group("test_entreg")


@pytest.mark.parametrize(
    "rule, expected",
    [("linear", [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]), ("cosine", [1.0, 0.8535534, 0.5, 0.1464466, 0.0, 0.0])],
)
def test_scheduled_coefficient_goes_from_coef_0_to_the_end_over_the_run(rule, expected):
    """5 steps from 1 to 0: step s (0-based) at t = s / 4; past the last step it stays at the end."""
    got = [ge.scheduled_coef(rule, step, 5, 1.0, 0.0) for step in range(6)]
    assert got == pytest.approx(expected, abs=1e-7)
    assert ge.scheduled_coef("linear", 1, 3, 0.01, 0.05) == pytest.approx(0.03)  # rising works alike


@pytest.mark.launches
def test_clamp_zero_and_constant_coefficient_is_plain_entropy_regularisation(testbed, tmp_path):
    flags = {
        "no-use-vllm": True,
        "clamp-p": 0.0,
        "coef-rule": "constant",
        "entropy-coef": 0.05,
    }
    run_script("grpo_entreg.py", script_flags(testbed, **flags), tmp_path)
    rows = read_metrics(run_dir(tmp_path))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["entropy/coef"] == 0.05 and r["entropy/clamped"] == pytest.approx(r["entropy/full"], rel=1e-5)
        # one update per step, token-mean: the bonus is coef x the mean full entropy of the policy being trained
        assert r["entropy/bonus"] == pytest.approx(0.05 * r["entropy/clamped_train"], rel=1e-6)


@pytest.mark.launches
def test_scheduled_coefficient_in_a_run_and_in_its_checkpoints(testbed, tmp_path):
    """--coef-rule linear from 0.05 to 0.01 over 3 steps: 0.05, 0.03, 0.01 applied; each checkpoint holds the next
    step's coefficient (a resumed run continues the schedule)."""
    flags = {"no-use-vllm": True, "coef-rule": "linear", "entropy-coef": 0.05, "entropy-coef-end": 0.01}
    flags.update({"total-steps": 3, "save-every": 1, "keep-checkpoints": 3})
    run_script("grpo_entreg.py", script_flags(testbed, **flags), tmp_path)
    path = run_dir(tmp_path)
    rows = read_metrics(path)
    assert [r["entropy/coef_applied"] for r in rows] == pytest.approx([0.05, 0.03, 0.01])
    for step, coef in ((1, 0.03), (2, 0.01), (3, 0.01)):
        state = trainer_state(path, step)["method_state"]
        assert state["entropy_coef"] == pytest.approx(coef)


# ---- the target rule (Skywork-OR1, TRL 1.16's use_adaptive_entropy) ----
def trl_adaptive_entropy(entropies, coef, delta, target, low, high):
    """TRL 1.16's controller as published: the bonus in a window uses the coefficient only if the previous window's
    world entropy was <= target (none in the first); after each optimizer step the coefficient moves by +-delta."""
    applied, coefs, last = [], [], math.inf
    for h in entropies:
        coefs.append(coef)
        applied.append(coef if last <= target else 0.0)
        coef = min(coef + delta, high) if h <= target else max(coef - delta, low)
        last = h
    return coefs, applied, coef


def test_next_target_coef_and_gate():
    limits = dict(coef_min=0.0, coef_max=0.012)
    assert ge.next_target_coef(0.01, 0.2, target=0.2, delta=0.005, **limits) == 0.012  # at the target: up, clipped
    assert ge.next_target_coef(0.01, 0.21, target=0.2, delta=0.005, **limits) == pytest.approx(0.005)
    assert ge.next_target_coef(0.003, 0.5, target=0.2, delta=0.005, **limits) == 0.0
    assert not ge.target_gate(None, 0.2) and ge.target_gate(0.2, 0.2) and not ge.target_gate(0.2001, 0.2)


TARGET = {
    "coef-rule": "target",
    "clamp-p": 0.0,
    "entropy-coef": 0.0,
    "entropy-coef-delta": 0.02,
    "entropy-coef-min": 0.0,
    "entropy-coef-max": 0.05,
    "top-entropy-quantile": 0.2,
    "no-use-vllm": True,
    "total-steps": 5,
    "num-mini-batches": 2,
    "micro-batch-size": 4,
    "save-every": 1,
}


@pytest.fixture(scope="module")
def target_run(testbed, tmp_path_factory):
    """5 steps of the target rule synced with the selection; the target is put inside the kept tokens' entropies of
    a first run, so that the coefficient moves both ways and the gate both opens and closes."""
    probe = tmp_path_factory.mktemp("probe")
    run_script("grpo_entreg.py", script_flags(testbed, **{**TARGET, "total-steps": 3, "save-every": 0}), probe, nproc=0)
    seen = sorted(r["entropy/clamped_train"] for r in read_metrics(run_dir(probe)))
    target = round((seen[0] + seen[1]) / 2, 6)
    out = tmp_path_factory.mktemp("target")
    run_script("grpo_entreg.py", script_flags(testbed, **TARGET, **{"entropy-target": target}), out, nproc=0)
    return run_dir(out), target


@pytest.mark.launches
@SHARED
def test_target_rule_equals_trls_update_replayed_on_the_logged_entropies(target_run):
    path, target = target_run
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    h = [r["entropy/clamped_train"] for r in rows]
    coefs, applied, final = trl_adaptive_entropy(h, 0.0, 0.02, target, 0.0, 0.05)
    assert [r["entropy/coef"] for r in rows] == pytest.approx(coefs, abs=1e-12)
    assert [r["entropy/coef_applied"] for r in rows] == pytest.approx(applied, abs=1e-12)
    assert rows[0]["entropy/coef_applied"] == 0 and rows[0]["entropy/bonus"] == 0  # no bonus before a measurement
    state = trainer_state(path)["method_state"]
    assert state["entropy_coef"] == pytest.approx(final, abs=1e-12) and state["last_entropy"] == h[-1]
    # synced with the selection: the controller sees the kept tokens' entropy (clamp-p 0: the full entropy)
    assert all(r["entropy/clamped_train"] > 2 * r["entropy/full"] for r in rows)
    for r in rows:  # the bonus is coef x the mean entropy of the kept tokens (2 updates per step, token-mean)
        assert r["entropy/bonus"] == pytest.approx(r["entropy/coef_applied"] * r["entropy/clamped_train"], rel=0.1)


@pytest.mark.launches
@SHARED
def test_killed_target_rule_run_resumes_the_same_coefficient_trajectory(testbed, target_run, tmp_path):
    path, target = target_run
    flags = script_flags(testbed, **TARGET, **{"entropy-target": target})
    proc = run_script("grpo_entreg.py", flags, tmp_path, nproc=0, fault="kill-step:7", check=False)  # in step 4
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    resumed = run_dir(tmp_path)
    assert trainer_state(resumed)["step"] == 3
    run_script("grpo_entreg.py", flags + ["--resume", resumed], tmp_path, nproc=0)
    a, b = read_metrics(path), read_metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        for key in ("entropy/coef", "entropy/coef_applied", "entropy/clamped_train", "entropy/kept_frac"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-9), (x["step"], key)
    assert trainer_state(resumed)["method_state"] == pytest.approx(trainer_state(path)["method_state"], rel=1e-5)


@pytest.mark.launches
def test_update_cadence_steps_the_coefficient_after_every_update_as_trl(testbed, tmp_path):
    """--coef-cadence update (TRL 1.16): 2 updates per step, an entropy always below the target: the coefficient rises
    by delta after every update, and the second update of step 1 already gets the bonus (gated by the first)."""
    flags = {**TARGET, "total-steps": 3, "save-every": 0, "coef-cadence": "update", "entropy-target": 100.0}
    flags.update({"entropy-coef-delta": 0.01, "entropy-coef-max": 1.0})
    run_script("grpo_entreg.py", script_flags(testbed, **flags), tmp_path, nproc=0)
    rows, path = read_metrics(run_dir(tmp_path)), run_dir(tmp_path)
    coefs, applied, final = trl_adaptive_entropy([0.0] * 6, 0.0, 0.01, 100.0, 0.0, 1.0)  # one entropy per update
    assert [r["entropy/coef"] for r in rows] == pytest.approx(coefs[1::2], abs=1e-12)  # each step's last update
    assert [r["entropy/coef_applied"] for r in rows] == pytest.approx(applied[1::2], abs=1e-12)
    assert rows[0]["entropy/bonus"] > 0 and trainer_state(path)["method_state"]["entropy_coef"] == pytest.approx(final)


def skywork_ent_controller(nlls, coef, delta, target, low, high):
    """Skywork-OR1's EntController (verl/trainer/ppo/core_algos.py) as its trainer drives it: once per step, from the
    step's NLL of the sampled tokens under the old policy; the bonus on (enabled) only after a step below the target
    (enabled from the start: with their initial coefficient 0 the same as gated)."""
    applied, coefs, enabled = [], [], 1
    for h in nlls:
        coefs.append(coef)
        applied.append(coef * enabled)
        coef = float(np.clip(coef + delta if h < target else coef - delta, low, high))
        enabled = int(h < target)
    return coefs, applied, coef


@pytest.mark.launches
def test_nll_signal_is_skywork_or1s_controller_replayed(testbed, tmp_path):
    """The Skywork-OR1 command line (README.md), its target scaled to the testbed: the coefficient and the bonus's
    gate follow Skywork's controller replayed on the logged NLL."""
    flags = {"coef-rule": "target", "coef-signal": "nll", "clamp-p": 0.0, "entropy-coef": 0.0, "no-use-vllm": True}
    flags.update({"entropy-target": 0.14, "entropy-coef-delta": 0.002, "entropy-coef-min": 0.0})
    flags.update({"entropy-coef-max": 0.005, "total-steps": 5, "num-mini-batches": 1})
    run_script("grpo_entreg.py", script_flags(testbed, **flags), tmp_path, nproc=0)
    rows = read_metrics(run_dir(tmp_path))
    coefs, applied, final = skywork_ent_controller([r["entropy/sampled_nll"] for r in rows], 0.0, 0.002, 0.14, 0, 0.005)
    assert [r["entropy/coef"] for r in rows] == pytest.approx(coefs, abs=1e-12)
    assert [r["entropy/coef_applied"] for r in rows] == pytest.approx(applied, abs=1e-12)
    assert trainer_state(run_dir(tmp_path))["method_state"]["entropy_coef"] == pytest.approx(final, abs=1e-12)
