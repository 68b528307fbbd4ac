"""Pass@k Training (grpo_passk.py, Chen et al. 2025, arXiv 2508.10751): the analytic advantage against its definition
(the mean pass@k advantage over the k-subsets that hold a response, enumerated), its edge cases, k = 1 against GRPO,
and a real run (k = 1 unscaled follows Dr. GRPO's trajectory exactly). The authors' own function is run against ours
by benchmarks/experiments/reference_losses.py."""

import math
from itertools import combinations

import pytest
import torch
from launch import final_weights, read_metrics, run_dir, run_script, script_flags

import grpo_passk as gp
import grpo_vanilla as gv
from utils.engine import make_args


def enumerated(rewards: list, k: int) -> list:
    """Each response's advantage by definition: over the k-subsets of the group that hold it, the mean of
    (max reward of the subset - rho) / sigma, rho the mean over all k-subsets and sigma sqrt(rho (1 - rho))."""
    subsets = list(combinations(range(len(rewards)), k))
    passes = {s: max(rewards[i] for i in s) for s in subsets}
    rho = sum(passes.values()) / len(subsets)
    sigma = math.sqrt(rho * (1 - rho)) + 1e-6
    return [
        sum(passes[s] - rho for s in subsets if i in s) / sum(i in s for s in subsets) / sigma
        for i in range(len(rewards))
    ]


def test_a_hand_computed_group():
    """G 4, k 2, one correct: rho = 1 - C(3, 2) / C(4, 2) = 1/2, sigma 1/2; the correct response (1 - 1/2) / (1/2) = 1;
    a wrong one: 2 of its 3 pairs fail, (1/3 - 1/2) / (1/2) = -1/3."""
    got = gp.passk_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), 2)
    assert got[0].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], rel=1e-5)


@pytest.mark.parametrize("G, k", [(8, 4), (8, 2), (8, 8), (6, 3), (16, 4)])
def test_every_group_equals_the_enumeration(G, k):
    rewards = torch.tensor([[float(i < c) for i in range(G)] for c in range(G + 1)])
    got = gp.passk_advantages(rewards, k)
    for row, expected in zip(rewards.tolist(), got.tolist()):
        assert expected == pytest.approx(enumerated(row, k), rel=1e-6, abs=1e-9), row


def test_all_correct_all_wrong_and_fewer_wrong_than_k_give_zero():
    """All correct, all wrong, or fewer than k wrong (every k-subset passes): no signal."""
    rewards = torch.tensor([[1.0] * 8, [0.0] * 8, [1.0] * 6 + [0.0] * 2])
    assert gp.passk_advantages(rewards, 4).abs().max().item() == 0.0


def test_k_1_is_grpo_with_the_population_std():
    """k = 1: rho = c / G, the mean reward; sigma the population std (GRPO: the sample std); unscaled, Dr. GRPO's."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    expected = centered / (rewards.std(dim=1, unbiased=False, keepdim=True) + 1e-6)
    assert torch.allclose(gp.passk_advantages(rewards, 1), expected, atol=1e-6)
    assert torch.equal(gp.passk_advantages(rewards, 1, scale=False), gv.group_advantages(rewards, scale=False))


def test_rewards_that_are_not_0_or_1_are_refused():
    with pytest.raises(ValueError, match="0/1 rewards"):
        gp.passk_advantages(torch.tensor([[1.0, 0.5, 0.0, 0.0]]), 2)


@pytest.mark.parametrize(
    "change, message",
    [({"passk_k": 9}, "--passk-k must be in [1, --group-size]"), ({"overlong_buffer_len": 8}, "0/1 rewards")],
)
def test_bad_flags_are_refused(change, message):
    args = make_args(gp.Args, num_prompts_per_step=8, num_mini_batches=2, group_size=8, micro_batch_size=4, **change)
    with pytest.raises(SystemExit) as caught:
        gp.validate_args(args, 2)
    assert message in str(caught.value)


RUN = {"total-steps": 2, "num-prompts-per-step": 4, "group-size": 4, "no-use-vllm": True, "no-scale-rewards": True}


@pytest.mark.launches
def test_k_1_unscaled_follows_dr_grpo_and_k_2_trains(testbed, tmp_path):
    """--passk-k 1 --no-scale-rewards is vanilla --no-scale-rewards metric for metric and weight for weight; k 2 makes
    another, finite update."""
    runs = {}
    for name, script, extra in [
        ("vanilla", "grpo_vanilla.py", {}),
        ("k1", "grpo_passk.py", {"passk-k": 1}),
        ("k2", "grpo_passk.py", {"passk-k": 2}),
    ]:
        run_script(script, script_flags(testbed, **RUN, **extra), tmp_path / name)
        runs[name] = run_dir(tmp_path / name)
    vanilla, k1, k2 = (read_metrics(runs[n]) for n in ("vanilla", "k1", "k2"))
    for v, p in zip(vanilla, k1, strict=True):
        shared = [key for key in v if not key.startswith("time/") and key != "charts/tokens_per_second"]
        assert {key: v[key] for key in shared} == {key: p[key] for key in shared}
    w0, w1 = final_weights(runs["vanilla"]), final_weights(runs["k1"])
    assert all(torch.equal(w0[key], w1[key]) for key in w0)
    assert k2[0]["rollout/reward"] == vanilla[0]["rollout/reward"]  # the same samples in step 1...
    assert k2[0]["losses/policy_loss"] != vanilla[0]["losses/policy_loss"]  # ...another advantage
    assert all(math.isfinite(r["losses/grad_norm"]) for r in k2)
