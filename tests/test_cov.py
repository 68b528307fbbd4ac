"""KL-Cov and Clip-Cov (grpo_klcov.py, grpo_clipcov.py): selection functions, the published per-token loss, and the
reference's micro-batch scope end to end on the CPU testbed (the global selection's invariance to micro-batch size and
world size: tests/test_selection_layouts.py)."""

import pytest
import torch
from launch import read_metrics, run_dir, run_script, script_flags

import grpo_clipcov as cc
import grpo_klcov as kc
import grpo_vanilla as gv


def test_both_scripts_share_the_covariance_and_the_gather():
    import inspect

    assert inspect.getsource(kc.token_covariance) == inspect.getsource(cc.token_covariance)
    assert not hasattr(kc, "gather_ranks") and not hasattr(
        cc, "gather_ranks"
    )  # both use utils.distributed.gather_ranks
    assert "distributed.gather_ranks(" in inspect.getsource(kc) and "distributed.gather_ranks(" in inspect.getsource(cc)


def test_token_covariance_is_centred_on_the_selection_set_and_detached():
    torch.manual_seed(0)
    logp = (-3 * torch.rand(50)).requires_grad_()
    adv = torch.randn(50)
    cov = kc.token_covariance(logp, adv)
    assert not cov.requires_grad
    expected = [(a - adv.mean()) * (lp - logp.detach().mean()) for a, lp in zip(adv, logp.detach())]
    assert torch.allclose(cov, torch.stack(expected), atol=1e-6)
    assert torch.isclose(cov.mean(), torch.cov(torch.stack([adv, logp.detach()]), correction=0)[0, 1], atol=1e-6)


@pytest.mark.parametrize("n", [1, 7, 100, 1001])
@pytest.mark.parametrize("ratio", [1e-4, 0.01, 0.3, 1.0])
def test_kl_cov_select_picks_exactly_the_k_largest(n, ratio):
    cov = torch.randn(n, generator=torch.Generator().manual_seed(n))
    selected = kc.kl_cov_select(cov, ratio)
    k = max(1, int(ratio * n))
    assert selected.dtype == torch.bool and int(selected.sum()) == min(k, n)
    if k < n:
        assert cov[selected].min() > cov[~selected].max()


@pytest.mark.parametrize("ratio", [1e-3, 0.05, 0.5])
def test_clip_cov_select_draws_min_n_pool_tokens_all_eligible(ratio):
    g = torch.Generator().manual_seed(3)
    cov = 4 * torch.randn(400, generator=g)
    eligible = torch.rand(400, generator=g) > 0.3
    pool = eligible & (cov > 1) & (cov < 5)
    selected = cc.clip_cov_select(cov, eligible, ratio, 1.0, 5.0, torch.Generator().manual_seed(0))
    assert int(selected.sum()) == min(max(1, int(ratio * 400)), int(pool.sum()))
    assert not (selected & ~pool).any()
    again = cc.clip_cov_select(cov, eligible, ratio, 1.0, 5.0, torch.Generator().manual_seed(0))
    assert torch.equal(selected, again)  # a seeded draw: the same on every rank that holds the same vector


def test_clip_cov_select_is_uniform_over_the_pool_and_handles_an_empty_pool():
    cov = torch.tensor([0.5, 2.0, 3.0, 9.0, 1.5, 4.0, 2.5])
    eligible = torch.tensor([True, True, True, True, False, True, True])
    g = torch.Generator().manual_seed(0)
    counts = sum(cc.clip_cov_select(cov, eligible, 0.1, 1.0, 5.0, g).long() for _ in range(2000))
    assert counts[[0, 3, 4]].tolist() == [0, 0, 0]  # out of bounds or not eligible
    assert all(400 < c < 600 for c in counts[[1, 2, 5, 6]].tolist()), counts  # 4 tokens, 500 each expected
    assert not cc.clip_cov_select(cov, torch.zeros(7, dtype=torch.bool), 0.5, 1.0, 5.0, g).any()


def _random_micro_batch(seed):
    """Right-padded [B, T] log-probs, old log-probs, per-sequence advantages and the response mask."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    old = -4 * torch.rand(B, T, generator=g)
    logp = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = (2 * torch.randn(B, 1, generator=g)).expand(B, T).contiguous()
    return logp, old, adv, mask, lengths


def _published_kl_cov(logp, old, adv, mask, ratio, coef):
    """KL-Cov as published, on [B, T] tensors: the k largest covariances over the valid tokens get coef * |log r|."""
    valid = mask.flatten().nonzero().squeeze(-1)
    a, lp = adv.flatten()[valid], logp.detach().flatten()[valid]
    cov = (a - a.mean()) * (lp - lp.mean())
    k = max(1, int(ratio * len(valid)))
    penalised = torch.zeros(mask.numel(), dtype=torch.bool)
    penalised[valid[torch.topk(cov, k).indices]] = True
    log_r = logp - old
    loss = -adv * log_r.exp() + coef * log_r.abs() * penalised.view_as(mask)
    return (loss * mask).sum() / mask.sum()


def _published_clip_cov(logp, old, adv, mask, ratio, lb, ub, eps_low, eps_high, generator):
    """Clip-Cov as published: PPO-clip loss; n random tokens of the unclipped ones with lb < cov < ub get loss x 0."""
    r = (logp - old).exp()
    surrogate, clipped_surrogate = -adv * r, -adv * r.clamp(1 - eps_low, 1 + eps_high)
    already = (clipped_surrogate > surrogate) & mask
    m = mask.float()
    cov = (adv - (adv * m).sum() / m.sum()) * (logp.detach() - (logp.detach() * m).sum() / m.sum())
    candidates = (mask & ~already & (cov > lb) & (cov < ub)).flatten().nonzero().squeeze(-1)
    n = max(1, int(ratio * mask.sum().item()))
    keep = torch.ones(mask.numel())
    keep[candidates[torch.randperm(len(candidates), generator=generator)[:n]]] = 0
    loss = torch.maximum(surrogate, clipped_surrogate) * keep.view_as(mask)
    return (loss * m).sum() / m.sum()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ratio", [1e-3, 0.1, 0.4])
def test_microbatch_scope_equals_the_published_kl_cov_loss(seed, ratio):
    logp, old, adv, mask, lengths = _random_micro_batch(seed)
    expected = _published_kl_cov(logp, old, adv, mask, ratio, 1.0)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    # as the script's microbatch branch does: flattened valid tokens, local means, local k, token-mean weights
    flat_logp, flat_old, flat_adv = logp[mask], old[mask], adv[mask]
    cov = kc.token_covariance(flat_logp, flat_adv)
    selected = kc.kl_cov_select(cov, ratio)
    weights = gv.token_weights(lengths, 1, "token-mean", int(mask.sum()), len(lengths), mask.shape[1])
    loss = (kc.kl_cov_loss(flat_logp, flat_old, flat_adv, selected, 1.0) * weights).sum()
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isclose(loss, expected, atol=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-7)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ratio, lb, ub", [(2e-4, 1.0, 5.0), (0.1, 1.0, 5.0), (0.3, 0.0, 3.0)])
def test_microbatch_scope_equals_the_published_clip_cov_loss(seed, ratio, lb, ub):
    logp, old, adv, mask, lengths = _random_micro_batch(seed)
    expected = _published_clip_cov(logp, old, adv, mask, ratio, lb, ub, 0.2, 0.2, torch.Generator().manual_seed(seed))
    (expected_grad,) = torch.autograd.grad(expected, logp)
    flat_logp, flat_old, flat_adv = logp[mask], old[mask], adv[mask]
    token_loss, clipped = gv.ppo_clip_loss(flat_logp, flat_old, flat_adv, 0.2, 0.2)
    cov = cc.token_covariance(flat_logp, flat_adv)
    selected = cc.clip_cov_select(cov, ~clipped, ratio, lb, ub, torch.Generator().manual_seed(seed))
    weights = gv.token_weights(lengths, 1, "token-mean", int(mask.sum()), len(lengths), mask.shape[1])
    loss = (token_loss * ~selected * weights).sum()
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isclose(loss, expected, atol=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-7)
    assert selected.any() or not (~clipped & (cov > lb) & (cov < ub)).any()


# ---- end to end: the real script on the CPU testbed; the global selection on 1 and 2 ranks, packed or not:
# tests/test_selection_layouts.py ----
# 8 prompts x 4 samples, 2 mini-batches of 16 sequences, micro-batches of 4
LAYOUT = {"total-steps": 2, "num-prompts-per-step": 8, "group-size": 4, "num-mini-batches": 2, "micro-batch-size": 4}


@pytest.mark.launches
@pytest.mark.parametrize(
    "script, method",
    [
        ("grpo_klcov.py", {"kl-cov-ratio": 1e-4}),
        ("grpo_clipcov.py", {"clip-cov-ratio": 1e-4, "clip-cov-lb": -1e9, "clip-cov-ub": 1e9}),
    ],
)
def test_microbatch_scope_selects_per_micro_batch_like_the_reference(testbed, tmp_path, script, method):
    """At a tiny ratio the reference selects one token per micro-batch (4 per mini-batch here); global selects one."""
    flags = {**LAYOUT, **method, "cov-scope": "microbatch", "no-use-vllm": True}
    run_script(script, script_flags(testbed, **flags), tmp_path)
    for r in read_metrics(run_dir(tmp_path)):
        tokens = r["rollout/response_length"] * 32
        assert round(r["cov/selected_frac"] * tokens) == 2 * 4, r
        assert r["time/cov_selection"] == 0
