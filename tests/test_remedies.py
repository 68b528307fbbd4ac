"""CISPO, CE-GPPO and Lp-Reg (grpo_cispo.py, grpo_cegppo.py, grpo_lpreg.py): each loss against its reference code on
the same inputs, every branch (each sign of A, each side of the clip, the dual clip on and off, ratios exactly on a
bound, ties in the selection), values, gradients and selected tokens; then the real scripts on the CPU testbed.

The references, transcribed into plain torch (their verl helpers inlined; verl_F.masked_mean is sum(v m) / (sum(m) +
1e-8)), each named by its file and commit:
- verl 0.9.1 (PyPI), verl/trainer/ppo/core_algos.py, compute_policy_loss_cispo (unchanged since PR #4508, b19b749);
- TRL 1.16.0 (PyPI), trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss, loss_type="cispo" (PR #4495, fix #4499);
- Kwai-Klear/CE-GPPO at 10558fe, verl/trainer/ppo/core_algos.py, compute_gppo_loss_general_beta;
- CarlanLark/Lp-Reg-dev at 33b27e2, verl/trainer/ppo/core_algos.py, compute_policy_loss_lp_reg, and
  verl/workers/actor/dp_actor.py, apply_min_p.
benchmarks/reference_losses.py runs the references' own code (installed or checked out) on the same inputs (its case
builders serve both) and compares; its result: benchmarks/results/reference_losses.txt."""

import importlib
import math
import os

import pytest
import torch
import tyro
from launch import ROOT, final_weights, read_metrics, run_dir, run_script, script_flags
from test_compare import dry_run, method_at

import grpo_cegppo as ce
import grpo_cispo as ci
import grpo_lpreg as lp
import grpo_vanilla as gv
from benchmarks import reference_losses


def micro_batch(seed: int, **shape):
    """benchmarks/reference_losses.py's cases (the inputs its run of the references' own code saw): right-padded [B, T]
    current and old log-probs, advantages (both signs and 0, per sequence) and the mask; log-ratios over [-3, 3], some
    beyond the dual clip c, and in rows 0-3 ratios exactly on both bounds (float32: 1 - 0.2 is 0.800000011920929)."""
    return micro_batch_of(reference_losses.micro_batch(seed, **shape))


def micro_batch_of(case: dict) -> tuple:
    return case["logp"].requires_grad_(), case["old"], case["adv"], case["mask"], case["lengths"]


def masked_mean(values, mask):  # verl_F.masked_mean, and agg_loss's token-mean on one micro-batch
    return (values * mask).sum() / (mask.sum() + 1e-8)


def ours(loss_fn, logp, old, adv, mask, lengths):
    """A script's per-token loss on the flat valid tokens (as the scripts hold a micro-batch), token-mean weights:
    (loss, gradient with respect to the [B, T] log-probs, the loss function's other outputs)."""
    out = loss_fn(logp[mask], old[mask], adv[mask])
    weights = gv.token_weights(lengths, "token-mean", int(mask.sum()), len(lengths), mask.shape[1])
    loss = (out[0] * weights).sum()
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, out[1:]


def check(reference, mine, logp):
    (expected_grad,) = torch.autograd.grad(reference, logp)
    loss, grad, _ = mine
    assert torch.isclose(loss, reference, rtol=1e-6, atol=1e-7), (loss, reference)
    assert torch.allclose(grad, expected_grad, rtol=1e-6, atol=1e-8), (grad - expected_grad).abs().max()


# ---- CISPO ----
def verl_cispo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    """verl 0.9.1 compute_policy_loss_cispo, token-mean, one data-parallel rank: (loss, pg_clipfrac)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    return (pg_losses * response_mask).sum() / response_mask.sum(), pg_clipfrac


def trl_cispo(old_per_token_logps, per_token_logps, advantages, mask, epsilon_high):
    """TRL 1.16 GRPOTrainer._compute_loss with loss_type="cispo", one process, one generation batch (its normaliser:
    the batch's token count)."""
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
    per_token_loss = -clamped_ratios * advantages * per_token_logps
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("low, high", [(10.0, 0.2), (0.2, 0.28), (1.0, 4.0)])  # verl's example, DAPO's, TRL's cap 5
def test_cispo_equals_verls_compute_policy_loss_cispo(seed, low, high):
    logp, old, adv, mask, lengths = micro_batch(seed, bounds=(max(1 - low, 0.5), 1 + high))
    logp.data[5, 3] = old[5, 3] + 25.0  # a log-ratio beyond verl's +-20 clamp (A > 0)
    expected, clipfrac = verl_cispo(old, logp, adv, mask, low, high)
    mine = ours(lambda *t: ci.cispo_loss(*t, low, high), logp, old, adv, mask, lengths)
    check(expected, mine, logp)
    clipped = mine[2][0]
    assert clipped.float().mean().item() == pytest.approx(clipfrac.item(), rel=1e-6)  # verl's pg_clipfrac
    assert clipped.any() and (high > 1 or (~clipped).any())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cap", [5.0, 1.2, 0.2])  # ScaleRL's 5; 0.2: TRL's default epsilon when epsilon_high is unset
def test_cispo_absolute_cap_equals_trls_cispo_branch(seed, cap):
    logp, old, adv, mask, lengths = micro_batch(seed, bounds=(0.5, cap if cap > 1 else 1.2))  # e^x = 0.2f has no x
    logp.data[5, 3] = old[5, 3] + 25.0  # beyond +-20: TRL does not clamp the log-ratio, the cap binds
    logp.data[6, 4] = old[6, 4] - 25.0  # a weight of e^-25: no lower bound, no clamp
    check(
        trl_cispo(old, logp, adv, mask, cap),
        ours(lambda *t: ci.cispo_loss(*t, 0.2, 0.2, cap), logp, old, adv, mask, lengths),
        logp,
    )


def test_cispo_keeps_the_gradient_ppo_clips_and_equals_ppo_on_policy():
    logp, old, adv, mask, lengths = micro_batch(0)
    cispo = ours(lambda *t: ci.cispo_loss(*t, 0.2, 0.2), logp, old, adv, mask, lengths)
    ppo = ours(lambda *t: gv.ppo_clip_loss(*t, 0.2, 0.2), logp, old, adv, mask, lengths)
    silenced = mask & (ppo[1] == 0) & (adv != 0)
    assert silenced.any() and (cispo[1][silenced] != 0).all()  # PPO's clipped tokens: no gradient there, CISPO's -w A
    on_policy = logp.detach()
    cispo = ours(lambda *t: ci.cispo_loss(*t, 0.2, 0.2), logp, on_policy, adv, mask, lengths)
    ppo = ours(lambda *t: gv.ppo_clip_loss(*t, 0.2, 0.2), logp, on_policy, adv, mask, lengths)
    assert torch.allclose(cispo[1], ppo[1], atol=1e-8)  # r = 1: the same gradient -A grad log pi


# ---- CE-GPPO ----
def authors_gppo(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high, clip_ratio_c,
                 beta1, beta2, dual=True):  # fmt: skip
    """compute_gppo_loss_general_beta (Kwai-Klear/CE-GPPO 10558fe), token-mean: (loss, pg_clipfrac, pg_clipfrac_lower);
    dual=False: without its dual-clip lines (c = infinity)."""
    ratio = torch.exp(log_prob - old_log_prob)
    ratio_detached = ratio.detach()
    low_mask = (ratio < (1 - cliprange_low)) & (advantages < 0)
    high_mask = (ratio > (1 + cliprange_high)) & (advantages > 0)
    other_mask = ~(low_mask | high_mask)
    clip_pg_losses1 = torch.zeros_like(advantages)
    clip_pg_losses1[low_mask] = (
        -beta1 * (1 - cliprange_low) / ratio_detached[low_mask] * ratio[low_mask] * advantages[low_mask]
    )
    clip_pg_losses1[high_mask] = (
        -beta2 * (1 + cliprange_high) / ratio_detached[high_mask] * ratio[high_mask] * advantages[high_mask]
    )
    clip_pg_losses1[other_mask] = -ratio[other_mask] * advantages[other_mask]
    pg_clipfrac = masked_mean((low_mask | high_mask).float(), response_mask)
    if not dual:
        return masked_mean(clip_pg_losses1, response_mask), pg_clipfrac, None
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return masked_mean(pg_losses, response_mask), pg_clipfrac, pg_clipfrac_lower


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("beta1, beta2", [(0.5, 1.0), (0.75, 1.0), (0.25, 0.6), (1.0, 1.0), (0.0, 0.0)])
@pytest.mark.parametrize("c", [10.0, 3.0, 0.0])
def test_cegppo_equals_the_authors_compute_gppo_loss_general_beta(seed, beta1, beta2, c):
    logp, old, adv, mask, lengths = micro_batch(seed, dual=c or 10.0)
    expected, clipfrac, lower = authors_gppo(old, logp, adv, mask, 0.2, 0.2, c, beta1, beta2, dual=bool(c))
    mine = ours(lambda *t: ce.gppo_loss(*t, 0.2, 0.2, c, beta1, beta2), logp, old, adv, mask, lengths)
    check(expected, mine, logp)
    dual_clipped = mine[2][0]
    if c:
        assert dual_clipped.float().mean().item() == pytest.approx(lower.item(), rel=1e-6) and dual_clipped.any()
    else:
        assert not dual_clipped.any()
    # the authors' pg_clipfrac: the tokens in a bounded branch, what the shared clip_frac_low_neg + high_pos count
    r, a = torch.exp(logp - old)[mask], adv[mask]
    bounded = ((r < 0.8) & (a < 0)) | ((r > 1.2) & (a > 0))
    assert bounded.float().mean().item() == pytest.approx(clipfrac.item(), rel=1e-6)


def test_cegppo_gradients_on_each_branch_and_on_the_bounds():
    """d loss / d logp per token (A = +-1): beta1 (1 - eps) |A| below the range for A < 0, beta2 (1 + eps) above it
    for A > 0, r |A| elsewhere and on the bounds themselves (strict inequalities, as theirs), 0 beyond c for A < 0."""
    ratios = [0.5, 0.8, 1.0, 1.2, 1.5, 12.0]
    logp = torch.tensor([reference_losses.exact_log(r) for r in ratios] * 2, requires_grad=True)
    adv = torch.tensor([-1.0] * 6 + [1.0] * 6)
    loss, _ = ce.gppo_loss(logp, torch.zeros(12), adv, 0.2, 0.2, 10.0, 0.5, 0.75)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    expected = [0.5 * 0.8, 0.8, 1.0, 1.2, 1.5, 0.0] + [-0.5, -0.8, -1.0, -1.2, -0.75 * 1.2, -0.75 * 1.2]
    assert torch.allclose(grad, torch.tensor(expected), atol=1e-6), grad


def test_cegppo_correct_tokens_mark_every_token_of_the_correct_responses():
    graded = [(1.0, "correct"), (0.0, "wrong"), (1.0, "correct"), (0.5, "shaped")]
    mask = ce.correct_tokens([2, 1, 3, 0], graded, torch.tensor([2, 3, 1, 2]))
    assert mask.tolist() == [1, 1, 0, 0, 0, 0, 1, 1]


# ---- Lp-Reg ----
def authors_min_p_logprobs(logits, labels, min_p, temperature):
    """apply_min_p (Lp-Reg-dev 33b27e2, dp_actor.py; regular_type "minp", hard) then the temperature and the log-prob
    of each label: the proxy's log-prob of the sampled token."""
    logits = logits.clone()
    probability_values = torch.nn.functional.softmax(logits, dim=-1)
    max_probabilities = torch.amax(probability_values, dim=-1, keepdim=True)
    invalid_mask = ~(probability_values >= min_p * max_probabilities)
    logits[invalid_mask] = -1e4
    logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)


def authors_lp_reg(old_log_prob, log_prob, tgt_log_prob, advantages, response_mask, cliprange_low, cliprange_high,
                   logp_neg_k_percent, ppo_kl_coef):  # fmt: skip
    """compute_policy_loss_lp_reg (Lp-Reg-dev 33b27e2), kl_type low_var_kl, logp_pos_k_percent 0, token-mean:
    (loss, the regularised tokens)."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - cliprange_low, 1 + cliprange_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    seq_len = log_prob.shape[1]
    all_valid_flat_idx = (response_mask > 0).reshape(-1).nonzero(as_tuple=True)[0]
    advantages_flat, log_prob_flat = advantages.reshape(-1), log_prob.reshape(-1)
    neg_indices = all_valid_flat_idx[advantages_flat[all_valid_flat_idx] < 0]
    regularised = torch.zeros_like(response_mask, dtype=torch.bool)
    if len(neg_indices) > 0:
        neg_logp_k = max(1, int(len(neg_indices) * logp_neg_k_percent))
        if neg_logp_k > 1:
            with torch.no_grad():
                _, neg_logp_indices = log_prob_flat[neg_indices].topk(k=neg_logp_k, largest=False)
                target_flat_idx = neg_indices[neg_logp_indices]
            batch_idx, seq_idx = target_flat_idx // seq_len, target_flat_idx % seq_len
            keep = log_prob[batch_idx, seq_idx].detach() < tgt_log_prob[batch_idx, seq_idx]
            batch_idx, seq_idx = batch_idx[keep], seq_idx[keep]
            if len(batch_idx):
                kl = tgt_log_prob[batch_idx, seq_idx] - log_prob[batch_idx, seq_idx]
                target_kl = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
                pg_losses = pg_losses.clone()
                pg_losses[batch_idx, seq_idx] = (
                    -advantages[batch_idx, seq_idx] * ratio[batch_idx, seq_idx] + ppo_kl_coef * target_kl
                )
                regularised[batch_idx, seq_idx] = True
    return masked_mean(pg_losses, response_mask), regularised


def lpreg_inputs(seed: int, ties: bool = False):
    """reference_losses.py's Lp-Reg cases: near on-policy log-probs (ties: bf16-like, rounded to 1/4), a proxy
    log pi_old + log(1 / kept mass), 10% of the sampled tokens outside the min-p set (-inf in ours; their -1e4 floor),
    five tokens with A < 0 far below the proxy (k3 clamped at 10)."""
    c = reference_losses.lpreg_inputs(seed, ties)
    return (*micro_batch_of(c), c["proxy"], c["proxy_theirs"])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rho", [0.01, 0.05, 0.3, 1.0])  # 0.01: k = 1 < 2, their guard: nothing regularised
@pytest.mark.parametrize("ties", [False, True])
def test_lpreg_microbatch_scope_equals_the_authors_compute_policy_loss_lp_reg(seed, rho, ties):
    logp, old, adv, mask, lengths, proxy, proxy_theirs = lpreg_inputs(seed, ties)
    expected, regularised = authors_lp_reg(old, logp, proxy_theirs, adv, mask, 1.0, 9.0, rho, 1.0)

    def lpreg(logp_, old_, adv_):  # as the script's microbatch branch
        loss, clipped = gv.ppo_clip_loss(logp_, old_, adv_, 1.0, 9.0)
        selected = lp.lpreg_select(logp_, proxy[mask], adv_, rho, min_count=2)
        return *lp.lpreg_loss(loss, logp_, old_, adv_, proxy[mask], selected, 1.0), selected

    mine = ours(lpreg, logp, old, adv, mask, lengths)
    check(expected, mine, logp)
    assert torch.equal(mine[2][1], regularised[mask])  # the same tokens
    if int(rho * (adv[mask] < 0).sum()) < 2:  # their guard
        assert not regularised.any()
    elif rho >= 0.3:
        assert regularised.any()


def test_lpreg_global_selection_takes_k_from_one_token_on():
    """Ours selects max(1, floor(rho n)) (their guard would select nothing at k = 1), then keeps logp < proxy."""
    logp = torch.tensor([-5.0, -1.0, -6.0, -0.5, -7.0])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0, -1.0])
    proxy = torch.tensor([-4.0, -0.5, -1.0, -0.1, -math.inf])
    assert lp.lpreg_select(logp, proxy, adv, 0.25).tolist() == [False] * 5  # k = 1: token 4, outside the min-p set
    assert lp.lpreg_select(logp, proxy, adv, 0.5).tolist() == [True, False, False, False, False]  # k = 2: 4 and 0
    assert not lp.lpreg_select(logp, proxy, adv, 0.5, min_count=3).any()


@pytest.mark.parametrize("kappa, temperature", [(0.02, 1.0), (0.1, 0.7), (0.5, 1.3)])
def test_proxy_logprobs_equal_the_authors_min_p_log_probs(kappa, temperature):
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(64, 50, generator=g)
    labels = torch.randint(0, 50, (64,), generator=g)
    labels[:8] = logits[:8].argmax(-1)  # surely kept
    theirs = authors_min_p_logprobs(logits, labels, kappa, temperature)
    mine = lp.proxy_logprobs(logits, labels, kappa, temperature)
    kept = theirs > -1000
    assert kept[:8].all() and (~kept).any()
    assert torch.allclose(mine[kept], theirs[kept], atol=1e-5)
    assert torch.isinf(mine[~kept]).all()  # theirs: about -1e4 / T; never below the current log-prob either way
    assert (
        mine[kept] >= torch.log_softmax(logits / temperature, -1).gather(-1, labels[:, None]).squeeze(-1)[kept]
    ).all()


# ---- the real scripts: on-policy, CISPO and CE-GPPO make vanilla's update; Lp-Reg's -A r too at beta 0 ----
ON_POLICY = {"total-steps": 2, "num-prompts-per-step": 8, "group-size": 4, "num-mini-batches": 1}


def test_on_policy_updates_equal_vanillas(testbed, tmp_path):
    """With one update per step the ratio is 1: CISPO's -sg(w) A log pi and CE-GPPO's branches give PPO's gradient,
    and Lp-Reg's selected tokens lose only the clip (-A r, r = 1) at --lpreg-beta 0; the same weights after 2 steps
    (the second step samples from them). Lp-Reg's selection is the reference's (micro-batch scope) here."""
    runs = {
        "grpo_vanilla.py": {},
        "grpo_cispo.py": {},
        "grpo_cegppo.py": {},
        "grpo_lpreg.py": {"lpreg-beta": 0, "lpreg-rho": 0.3, "lpreg-scope": "microbatch"},
    }
    for script, flags in runs.items():
        run_script(script, script_flags(testbed, **ON_POLICY, **flags), tmp_path / script)
    rows = {script: read_metrics(run_dir(tmp_path / script)) for script in runs}
    weights = {script: final_weights(run_dir(tmp_path / script)) for script in runs}
    base = weights["grpo_vanilla.py"]
    for script in runs:
        assert all(torch.allclose(weights[script][k], base[k], atol=1e-6) for k in base), script
        for a, b in zip(rows[script], rows["grpo_vanilla.py"]):
            assert a["rollout/reward"] == b["rollout/reward"] and a["entropy/top20"] > a["entropy/full"]
            assert a["losses/grad_norm"] == pytest.approx(b["losses/grad_norm"], rel=1e-4), script
    assert all(r["lpreg/selected_frac"] > 0 and r["lpreg/outside_minp_frac"] >= 0 for r in rows["grpo_lpreg.py"])


# ---- the authors' recipes (benchmarks/reproduce/, docs/fidelity.md) ----
def recipe_args(script: str, **settings) -> dict:
    """exp name -> the parsed Args of every training command a reproduction script prints (DRY_RUN)."""
    parsed = {}
    for argv in dry_run(os.path.join(ROOT, "benchmarks", "reproduce", script), **settings):
        if (at := method_at(argv)) is not None:
            module = importlib.import_module(argv[at][: -len(".py")])
            args = tyro.cli(module.Args, args=argv[at + 1 :])
            parsed[args.exp_name] = args
    return parsed


@pytest.mark.parametrize("size, beta1", [("1.5b", 0.5), ("7b", 0.75)])
def test_the_cegppo_recipe_runs_the_authors_settings(size, beta1):
    runs = recipe_args("cegppo_r1_distill_qwen.sh", SIZE=size)
    assert set(runs) == {"grpo_vanilla", "grpo_cegppo", "grpo_cegppo_nosft"}
    for args in runs.values():
        assert args.num_prompts_per_step == 128 and args.group_size == 8 and args.num_mini_batches == 8
        assert args.learning_rate == 1e-6 and args.warmup_steps == 10 and args.weight_decay == 0.1
        assert (args.clip_eps_low, args.clip_eps_high, args.clip_ratio_c) == (0.2, 0.2, 10)
        assert args.filter_groups and args.max_gen_batches == 1 and args.max_response_length == 16384
        assert args.kl_coef == 0 and args.model_name_or_path.endswith(f"Distill-Qwen-{size.upper()[:-1]}B")
    assert (runs["grpo_cegppo"].cegppo_beta1, runs["grpo_cegppo"].cegppo_beta2) == (beta1, 1.0)
    assert runs["grpo_cegppo"].cegppo_sft_coef == 0.1 and runs["grpo_cegppo_nosft"].cegppo_sft_coef == 0


@pytest.mark.parametrize("off_policy, mini_batches", [("", 1), ("1", 8)])
def test_the_lpreg_recipe_runs_the_authors_settings(off_policy, mini_batches):
    runs = recipe_args("lpreg_qwen3_14b.sh", OFF_POLICY=off_policy)
    assert set(runs) == {"grpo_vanilla", "grpo_lpreg"}
    for args in runs.values():
        assert args.num_prompts_per_step == 256 and args.group_size == 8 and args.num_mini_batches == mini_batches
        assert (args.clip_eps_low, args.clip_eps_high, args.clip_ratio_c) == (1, 9, 0) and args.learning_rate == 1e-6
        assert not args.filter_groups and args.kl_coef == 0 and args.max_response_length == 8192
    lpreg = runs["grpo_lpreg"]
    assert (lpreg.lpreg_kappa, lpreg.lpreg_rho, lpreg.lpreg_beta) == (0.02, 0.01, 1.0)


def test_the_cispo_recipe_runs_verls_example_and_trls_convention():
    runs = recipe_args("cispo_qwen3_8b.sh")
    assert set(runs) == {"grpo_vanilla", "grpo_cispo", "grpo_cispo_trl"}
    for args in runs.values():
        assert args.num_prompts_per_step == 1024 and args.group_size == 5 and args.num_mini_batches == 4
        assert args.learning_rate == 1e-6 and args.kl_coef == 0.001 and args.max_response_length == 2048
    assert (runs["grpo_cispo"].clip_eps_low, runs["grpo_cispo"].clip_eps_high) == (10, 0.2)
    assert runs["grpo_cispo"].cispo_max_weight == 0 and runs["grpo_cispo_trl"].cispo_max_weight == 5
