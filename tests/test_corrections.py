"""The rollout correction's modes, the KL estimators and --mask-truncated's weights, each in our own words on cases
computed by hand (the frameworks' own functions against ours: benchmarks/experiments/reference_corrections.py; the
modes in a run: tests/test_faults.py)."""

import math

import pytest
import torch

import grpo_vanilla as gv
from utils.kl import kl_penalty
from utils.rollout_correction import rollout_weights

RATIOS = [3.0, 0.5, 1.5, 0.5, 4.0]  # pi_old / pi_sampler of the tokens of two responses, 2 and 3 tokens long
LENGTHS = torch.tensor([2, 3])  # products 1.5 and 3, geometric means 1.5^(1/2) = 1.22 and 3^(1/3) = 1.44


def correction(mode: str, low: float, cap: float):
    weights, truncated, masked = rollout_weights(
        torch.log(torch.tensor(RATIOS)), torch.zeros(5), LENGTHS, mode, low, cap
    )
    return weights.tolist(), truncated.int().tolist(), masked.int().tolist()


@pytest.mark.parametrize(
    "mode, low, cap, weights, truncated, masked",
    [
        ("token-truncate", 0, 2, [2, 0.5, 1.5, 0.5, 2], [1, 0, 0, 0, 1], [0] * 5),  # min(r, C)
        ("token-truncate", 0.6, 2, [2, 0.6, 1.5, 0.6, 2], [1, 1, 0, 1, 1], [0] * 5),  # raised to the lower bound
        ("token-mask", 0, 2, [0, 0.5, 1.5, 0.5, 0], [0] * 5, [1, 0, 0, 0, 1]),  # r above C: 0
        ("token-mask", 0.6, 2, [0, 0, 1.5, 0, 0], [0] * 5, [1, 1, 0, 1, 1]),  # IcePop: outside [0.6, 2]
        ("sequence-truncate", 0, 2, [1.5, 1.5, 2, 2, 2], [0, 0, 1, 1, 1], [0] * 5),  # the product, min(., C)
        ("sequence-mask", 0, 2, [1.5, 1.5, 0, 0, 0], [0] * 5, [0, 0, 1, 1, 1]),
        ("sequence-mask", 1.6, 4, [0, 0, 3, 3, 3], [0] * 5, [1, 1, 0, 0, 0]),  # below the lower bound
        ("geo-mask", 0, 1.3, [1, 1, 0, 0, 0], [0] * 5, [0, 0, 1, 1, 1]),  # 1.44 > 1.3: out; kept weigh 1
        ("geo-mask", 1.3, 2, [0, 0, 1, 1, 1], [0] * 5, [1, 1, 0, 0, 0]),  # 1.22 < 1.3: out
    ],
)
def test_rollout_correction_modes(mode, low, cap, weights, truncated, masked):
    got = correction(mode, low, cap)
    assert got[0] == pytest.approx(weights, rel=1e-6) and got[1:] == (truncated, masked)


@pytest.mark.parametrize("mode", ["token-truncate", "token-mask", "sequence-truncate", "sequence-mask", "geo-mask"])
def test_rollout_correction_off_weighs_every_token_1(mode):
    assert correction(mode, 0.5, 0) == ([1.0] * 5, [0] * 5, [0] * 5)


def test_sequence_ratios_beyond_exp_20_stay_finite():
    """A sequence's log-ratio sum of 60 is clamped at 20 before exp (verl's bound): truncated to C, or masked."""
    old, lengths = torch.full((3,), 20.0), torch.tensor([3])
    for mode, expected in (("sequence-truncate", 2.0), ("sequence-mask", 0.0)):
        weights = rollout_weights(old, torch.zeros(3), lengths, mode, 0, 2)[0]
        assert weights.tolist() == [expected] * 3


def test_kl_estimators_values_and_gradients():
    """d = log pi - log pi_ref: k1 d (gradient 1), k2 d^2 / 2 (gradient d), k3 exp(-d) + d - 1 (gradient 1 - exp(-d));
    k1+ and k3+ their values with k2's gradient; k3-is k3 r with r = pi / pi_old, gradient (1 - exp(-d) + k3) r."""
    ref, old = torch.tensor([-1.5, -1.0, -0.5]), torch.tensor([-1.2, -2.0, -0.3])
    d = torch.tensor([-1.0, -2.0, -0.5]) - ref
    k3, r = torch.exp(-d) + d - 1, torch.exp(torch.tensor([-1.0, -2.0, -0.5]) - old)
    expected = {
        "k1": (d, torch.ones(3)),
        "k2": (d**2 / 2, d),
        "k3": (k3, 1 - torch.exp(-d)),
        "k1+": (d, d),
        "k3+": (k3, d),
        "k3-is": (k3 * r, (1 - torch.exp(-d) + k3) * r),
    }
    for estimator, (value, gradient) in expected.items():
        logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
        kl = kl_penalty(logp, ref, old, estimator)
        kl.sum().backward()
        assert torch.allclose(kl.detach(), value, atol=1e-6), estimator
        assert torch.allclose(logp.grad, gradient, atol=1e-6), estimator


def test_k3_is_clamped_as_verl():
    """d = -30: verl clamps d to -20 and the value to 10, where no gradient flows."""
    logp = torch.tensor([-31.0], requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([-1.0]), torch.tensor([-31.0]), "k3")
    kl.sum().backward()
    assert kl.item() == 10.0 and logp.grad.item() == 0.0


def test_uncounted_sequences_leave_the_numerator_and_the_denominator():
    """--mask-truncated: the middle response (3 tokens) out; the totals count the other two (7 tokens, 2 sequences)."""
    lengths, counted = torch.tensor([2, 3, 5]), torch.tensor([True, False, True])
    w = gv.token_weights(lengths, counted, "token-mean", 7, 2, 8)
    assert w.tolist() == pytest.approx([1 / 7] * 2 + [0] * 3 + [1 / 7] * 5)
    w = gv.token_weights(lengths, counted, "seq-mean-token-mean", 7, 2, 8)
    assert w.tolist() == pytest.approx([1 / 4] * 2 + [0] * 3 + [1 / 10] * 5)
    none = gv.token_weights(lengths, torch.zeros(3, dtype=torch.bool), "token-mean", 0, 0, 8)
    assert none.tolist() == [0.0] * 10 and all(math.isfinite(x) for x in none.tolist())
