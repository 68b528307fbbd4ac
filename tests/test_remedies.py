"""CISPO, CE-GPPO and Lp-Reg (grpo_cispo.py, grpo_cegppo.py, grpo_lpreg.py) against their papers' equations, written
here per token (value and gradient with respect to the log-prob, derived by hand), on every branch: each sign of A,
each side of the clip, the dual clip on and off, ratios exactly on a bound, log-ratios beyond +-20, ties in the
selection; then the real scripts on the CPU testbed.

No reference code is copied here: benchmarks/experiments/reference_losses.py runs the references' own code (verl 0.9.1
and TRL 1.16.0 installed, the CE-GPPO and Lp-Reg authors' functions read from their files at run time) on the same cases
(its case builders serve both) and compares; its result: benchmarks/results/reference_losses.txt."""

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
from benchmarks.experiments import reference_losses


def micro_batch(seed: int, **shape):
    """benchmarks/experiments/reference_losses.py's cases: right-padded [B, T] current and old log-probs, advantages
    (both signs and 0, per sequence) and the mask; log-ratios over [-3, 3], one per row beyond the dual clip c, in rows
    0-3 ratios exactly on both bounds (float32: 1 - 0.2 is 0.800000011920929); with `far`, log-ratios of +-25 in rows
    0, 1, 5, 6 (A > 0 and A < 0 each): beyond the +-20 clamp of our ratios."""
    far = shape.pop("far", False)
    c = reference_losses.micro_batch(seed, **shape)
    if far:
        for row, sign in ((0, 1), (1, 1), (5, -1), (6, -1), (0, -1), (1, -1), (5, 1), (6, 1)):
            col = 3 if sign > 0 else 4
            c["logp"][row, col] = c["old"][row, col] + 25.0 * sign
    return c["logp"].requires_grad_(), c["old"], c["adv"], c["mask"], c["lengths"]


def ours(loss_fn, logp, old, adv, mask, lengths):
    """A script's per-token loss on the flat valid tokens (as the scripts hold a micro-batch), token-mean weights:
    (loss, gradient with respect to the [B, T] log-probs, the loss function's other outputs)."""
    out = loss_fn(logp[mask], old[mask], adv[mask])
    loss = (out[0] * token_mean(mask, lengths)).sum()
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, out[1:]


def token_mean(mask, lengths):
    return gv.token_weights(lengths, 1, "token-mean", int(mask.sum()), len(lengths), mask.shape[1])


def check(mine, value, grad, mask, lengths):
    """Our loss and gradient against the per-token `value` and `grad` of the formula ([B, T]), token mean (float64)."""
    w, value, grad = token_mean(mask, lengths).double(), value.double(), grad.double()
    loss, our_grad, _ = mine
    expected_grad = torch.zeros(mask.shape, dtype=torch.float64)
    expected_grad[mask] = grad[mask] * w
    expected, scale = (value[mask] * w).sum().item(), (value[mask].abs() * w).sum().item()  # float32 sums: rounding
    assert abs(loss.item() - expected) <= 2e-6 * scale + 1e-9, (loss.item(), expected)  # of terms that may cancel
    assert torch.allclose(our_grad.double(), expected_grad, rtol=1e-5, atol=1e-9), (
        (our_grad - expected_grad).abs().max()
    )


def ratio_of(logp, old, clamp=True):
    """exp of the log-ratio (float32 as the scripts: the bounds' ties are float32 ties), its log clamped to +-20."""
    x = logp.detach() - old
    return torch.exp(x.clamp(-20, 20) if clamp else x)


# ---- CISPO (MiniMax-M1, section 3.1): J = E[sg(w) A log pi], w the clipped importance ratio ----
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("low, high", [(10.0, 0.2), (0.2, 0.28), (1.0, 4.0)])  # verl's example, DAPO's, [0, 5]
def test_cispo_is_the_clipped_weight_times_the_policy_gradient(seed, low, high):
    """Per token: value -w A log pi, gradient -w A, w = clip(r, 1 - low, 1 + high), r with its log clamped to +-20
    (verl); the clipped mask is where w != r."""
    logp, old, adv, mask, lengths = micro_batch(seed, bounds=(max(1 - low, 0.5), 1 + high), far=True)
    r = ratio_of(logp, old)
    w = r.clamp(1 - low, 1 + high)
    mine = ours(lambda *t: ci.cispo_loss(*t, low, high), logp, old, adv, mask, lengths)
    check(mine, -w * adv * logp.detach(), -w * adv, mask, lengths)
    assert torch.equal(mine[2][0], (w != r)[mask]) and mine[2][0].any()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cap", [5.0, 1.2, 0.2])  # ScaleRL's 5; 0.2: TRL's epsilon when epsilon_high is unset
def test_cispo_absolute_cap_is_trls_convention(seed, cap):
    """--cispo-max-weight W (TRL 1.16): w = min(r, W), no lower bound and no clamp of the log-ratio (log r = +-25 gives
    w = W and e^-25)."""
    logp, old, adv, mask, lengths = micro_batch(seed, bounds=(0.5, cap if cap > 1 else 1.2), far=True)
    w = ratio_of(logp, old, clamp=False).clamp(max=cap)
    assert (w[mask] < math.exp(-24)).any()
    check(ours(lambda *t: ci.cispo_loss(*t, 0.2, 0.2, cap), logp, old, adv, mask, lengths), -w * adv * logp.detach(),
          -w * adv, mask, lengths)  # fmt: skip


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


# ---- CE-GPPO (arXiv 2509.20712, Eq. 9-10): PPO's clipped tokens keep a gradient scaled by beta1 / beta2 ----
def gppo_formula(r, adv, eps: float, c: float, beta1: float, beta2: float):
    """Per token (value, gradient with respect to log pi): where A < 0 and r < 1 - eps, -beta1 (1 - eps) A both (the
    ratio enters as r / sg(r)); where A > 0 and r > 1 + eps, -beta2 (1 + eps) A both; elsewhere -r A both; with c > 0,
    where A < 0 and the value exceeds -c A, the value -c A and no gradient."""
    low, high = (r < 1 - eps) & (adv < 0), (r > 1 + eps) & (adv > 0)
    scale = torch.where(low, beta1 * (1 - eps), torch.where(high, beta2 * (1 + eps), r))
    value = grad = -scale * adv
    if c:
        capped = (adv < 0) & (value > -c * adv)
        value, grad = torch.where(capped, -c * adv, value), torch.where(capped, 0.0, grad)
    return value, grad


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("beta1, beta2", [(0.5, 1.0), (0.75, 1.0), (0.25, 0.6), (1.0, 1.0), (0.0, 0.0)])
@pytest.mark.parametrize("c", [10.0, 3.0, 0.0])
def test_cegppo_follows_the_papers_branches(seed, beta1, beta2, c):
    """Every branch, ratios exactly on the bounds (strict inequalities: a tie is -r A), log-ratios of +-25: the bounded
    branches keep their gradient at any ratio (theirs too: r / sg(r)); -r A uses our ratio, clamped at e^+-20 (the
    reference's is not: the values differ there by |A| (e^25 - e^20) where A < 0 without the dual clip, and by less
    than 2e-9 |A| for r < e^-20)."""
    logp, old, adv, mask, lengths = micro_batch(seed, dual=c or 10.0, far=True)
    value, grad = gppo_formula(ratio_of(logp, old), adv, 0.2, c, beta1, beta2)
    grad = torch.where(((logp.detach() - old).abs() > 20) & (grad.abs() == ratio_of(logp, old) * adv.abs()), 0.0, grad)
    mine = ours(lambda *t: ce.gppo_loss(*t, 0.2, 0.2, c, beta1, beta2), logp, old, adv, mask, lengths)
    check(mine, value, grad, mask, lengths)
    r, a = ratio_of(logp, old)[mask], adv[mask]
    dual = mine[2][0]
    if c:  # the dual clip holds where A < 0 and -r A (or the bounded value) exceeds -c A
        assert torch.equal(dual, (a < 0) & (torch.where(r < 0.8, beta1 * 0.8, r) > c)) and dual.any()
    else:
        assert not dual.any()
    far = (logp.detach() - old).abs()[mask] > 20
    bounded = ((r < 0.8) & (a < 0)) | ((r > 1.2) & (a > 0))
    assert (far & bounded).any() and (mine[1][mask][far & bounded] != 0).all() == bool(beta1 and beta2)


def test_cegppo_gradients_on_each_branch_and_on_the_bounds():
    """d loss / d logp per token (A = +-1): beta1 (1 - eps) |A| below the range for A < 0, beta2 (1 + eps) above it
    for A > 0, r |A| elsewhere and on the bounds themselves (strict inequalities), 0 beyond c for A < 0."""
    ratios = [0.5, 0.8, 1.0, 1.2, 1.5, 12.0]
    logp = torch.tensor([reference_losses.exact_log(r) for r in ratios] * 2, requires_grad=True)
    adv = torch.tensor([-1.0] * 6 + [1.0] * 6)
    loss, _ = ce.gppo_loss(logp, torch.zeros(12), adv, 0.2, 0.2, 10.0, 0.5, 0.75)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    expected = [0.5 * 0.8, 0.8, 1.0, 1.2, 1.5, 0.0] + [-0.5, -0.8, -1.0, -1.2, -0.75 * 1.2, -0.75 * 1.2]
    assert torch.allclose(grad, torch.tensor(expected), atol=1e-6), grad


@pytest.mark.parametrize("c", [10.0, 0.0])
def test_cegppo_branch_gradients_split_the_gradient(c):
    """The cegppo/grad_*_share metrics: branch_gradients' three parts add up to |d loss / d logp| of every token, and
    each is non-zero only on its own branch."""
    logp, old, adv, mask, _ = micro_batch(1, dual=c or 10.0)
    flat, o, a = logp[mask], old[mask], adv[mask]
    loss, _ = ce.gppo_loss(flat, o, a, 0.2, 0.2, c, 0.5, 1.0)
    (grad,) = torch.autograd.grad(loss.sum(), flat)
    parts = ce.branch_gradients(flat.detach() - o, a, 0.2, 0.2, c, 0.5, 1.0)
    assert torch.allclose(sum(parts.values()), grad.abs(), rtol=1e-6, atol=1e-7)
    r = torch.exp(flat.detach() - o)
    assert ((parts["beta1"] > 0) == ((r < 0.8) & (a < 0))).all() and (
        (parts["beta2"] > 0) == ((r > 1.2) & (a > 0))
    ).all()


def test_cegppo_correct_tokens_mark_every_token_of_the_correct_responses():
    graded = [(1.0, "correct"), (0.0, "wrong"), (1.0, "correct"), (0.5, "shaped")]
    mask = ce.correct_tokens([2, 1, 3, 0], graded, torch.tensor([2, 3, 1, 2]), torch.device("cpu"))
    assert mask.tolist() == [1, 1, 0, 0, 0, 0, 1, 1]


# ---- Lp-Reg (arXiv 2510.03222): a k3 penalty toward a min-p proxy on the rarest tokens with A < 0 ----
def lpreg_inputs(seed: int, ties: bool = False):
    """reference_losses.py's Lp-Reg cases: near on-policy log-probs (ties: bf16-like, rounded to 1/4), a proxy
    log pi_old + log(1 / kept mass), 10% of the sampled tokens outside the min-p set (-inf), five tokens with A < 0
    far below the proxy (k3 clamped at 10)."""
    c = reference_losses.lpreg_inputs(seed, ties)
    return c["logp"].requires_grad_(), c["old"], c["adv"], c["mask"], c["lengths"], c["proxy"]


def lowest_negative(logp, adv, k: int):
    """The k tokens with A < 0 of lowest log-prob, as a set (ties at the k-th value: any of them may be taken)."""
    negative = adv < 0
    kth = logp[negative].sort().values[k - 1]
    return negative & (logp < kth), negative & (logp == kth)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rho", [0.01, 0.05, 0.3, 1.0])  # 0.01: k = 1 < 2, the reference's guard: nothing selected
@pytest.mark.parametrize("ties", [False, True])
def test_lpreg_microbatch_scope_follows_the_paper(seed, rho, ties):
    """Selection: of the n tokens with A < 0, the k = max(1, floor(rho n)) of lowest log-prob (none if k < 2, the
    reference's guard), then those with log pi < log pi_proxy. Their loss: -A r (no clip) + beta min(k3, 10), k3 =
    e^x - x - 1, x = log pi_proxy - log pi, gradient -A r + beta (1 - e^x) (0 where the clamp holds); elsewhere PPO's
    clip at 1 / 9 (the authors' scripts)."""
    logp, old, adv, mask, lengths, proxy = lpreg_inputs(seed, ties)
    flat, a, p = logp.detach()[mask], adv[mask], proxy[mask]
    n = int((a < 0).sum())
    k = max(1, int(rho * n))
    selected = lp.lpreg_select(flat, p, a, rho, min_count=2)
    if k < 2:
        assert not selected.any()
    else:
        surely, maybe = lowest_negative(flat, a, k)
        candidates = lp.lpreg_select(flat, torch.full_like(p, math.inf), a, rho, min_count=2)  # before the proxy
        assert int(candidates.sum()) == k and (candidates >= surely).all() and (candidates <= surely | maybe).all()
        assert torch.equal(selected, candidates & (flat < p)) and (rho < 0.3 or selected.any())
    r, x = ratio_of(logp, old), proxy - logp.detach()
    k3 = torch.exp(x) - x - 1
    ppo_value = torch.maximum(-adv * r, -adv * r.clamp(0.0, 10.0))
    ppo_grad = torch.where(-adv * r >= -adv * r.clamp(0.0, 10.0), -adv * r, 0.0)
    chosen = torch.zeros_like(mask)
    chosen[mask] = selected
    value = torch.where(chosen, -adv * r + k3.clamp(max=10.0), ppo_value)
    grad = torch.where(chosen, -adv * r + torch.where(k3 < 10.0, 1 - torch.exp(x), 0.0), ppo_grad)

    def lpreg(logp_, old_, adv_):  # as the script's microbatch branch, the penalty added (no rollout weight here)
        loss, clipped = gv.ppo_clip_loss(logp_, old_, adv_, 1.0, 9.0)
        sel = lp.lpreg_select(logp_, p, adv_, rho, min_count=2)
        policy, penalty, _ = lp.lpreg_loss(loss, logp_, old_, adv_, p, sel, 1.0)
        return policy + penalty, sel

    check(ours(lpreg, logp, old, adv, mask, lengths), value, grad, mask, lengths)


def test_lpreg_penalty_is_apart_from_the_policy_term():
    """lpreg_loss returns the policy term (-A r on the selected tokens, PPO's elsewhere) and beta k3 on the selected
    tokens apart: the script weights the first by --vllm-is-cap's rollout weights and adds the second unweighted."""
    logp = torch.tensor([-5.0, -1.0, -6.0, -0.5])
    old = logp + torch.tensor([0.1, -0.1, 0.0, 0.3])
    adv = torch.tensor([-1.0, -1.0, 1.0, -2.0])
    proxy = torch.tensor([-3.0, -0.5, -1.0, -0.1])
    selected = torch.tensor([True, False, False, True])
    ppo, _ = gv.ppo_clip_loss(logp, old, adv, 0.2, 0.2)
    policy, penalty, k3 = lp.lpreg_loss(ppo, logp, old, adv, proxy, selected, 0.5)
    r = torch.exp(logp - old)
    assert torch.allclose(policy, torch.where(selected, -adv * r, ppo))
    x = proxy - logp
    assert torch.allclose(penalty, 0.5 * (torch.exp(x) - x - 1) * selected) and penalty[~selected].eq(0).all()
    assert k3[0] == pytest.approx(math.exp(2.0) - 3.0)


def test_lpreg_global_selection_takes_k_from_one_token_on():
    """Ours selects max(1, floor(rho n)) (their guard would select nothing at k = 1), then keeps logp < proxy."""
    logp = torch.tensor([-5.0, -1.0, -6.0, -0.5, -7.0])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0, -1.0])
    proxy = torch.tensor([-4.0, -0.5, -1.0, -0.1, -math.inf])
    assert lp.lpreg_select(logp, proxy, adv, 0.25).tolist() == [False] * 5  # k = 1: token 4, outside the min-p set
    assert lp.lpreg_select(logp, proxy, adv, 0.5).tolist() == [True, False, False, False, False]  # k = 2: 4 and 0
    assert not lp.lpreg_select(logp, proxy, adv, 0.5, min_count=3).any()


@pytest.mark.parametrize("kappa, temperature", [(0.02, 1.0), (0.1, 0.7), (0.5, 1.3)])
def test_proxy_logprobs_are_the_min_p_policy(kappa, temperature):
    """pi_proxy (the paper's Eq. 4, min-p on the untempered softmax as the authors' code): the tokens with p >= kappa
    max p keep their tempered probabilities, renormalised; a target outside the set gets -inf. In float64, per row."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(64, 50, generator=g)
    labels = torch.randint(0, 50, (64,), generator=g)
    labels[:8] = logits[:8].argmax(-1)  # surely kept
    mine = lp.proxy_logprobs(logits, labels, kappa, temperature)
    expected = []
    for row, label in zip(logits.double(), labels.tolist()):
        p = torch.softmax(row, -1)
        kept = p >= kappa * p.max()
        tempered = torch.exp((row - row.max()) / temperature) * kept
        expected.append(math.log(tempered[label] / tempered.sum()) if kept[label] else -math.inf)
    expected = torch.tensor(expected, dtype=torch.float64)
    kept = torch.isfinite(expected)
    assert kept[:8].all() and (~kept).any()
    assert torch.equal(torch.isinf(mine), ~kept)
    assert torch.allclose(mine[kept].double(), expected[kept], atol=1e-5)


# ---- the real scripts: on-policy, CISPO and CE-GPPO make vanilla's update; Lp-Reg's -A r too at beta 0 ----
ON_POLICY = {"total-steps": 2, "num-prompts-per-step": 8, "group-size": 4, "num-mini-batches": 1}


@pytest.mark.launches
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


@pytest.mark.launches
def test_cispo_cap_clip_metrics_count_against_the_cap(testbed, tmp_path):
    """--cispo-max-weight W: the losses/clip_frac_* metrics count the ratios outside [0, W] (not against the unused
    --clip-eps-low/high, against which none would be); losses/clip_frac, the loss's own mask, counts them with those of
    A = 0 too. A cap just above 1 and a second mini-batch, so that some are capped."""
    flags = {**ON_POLICY, "total-steps": 1, "num-mini-batches": 2, "cispo-max-weight": 1.0001, "no-use-vllm": True}
    run_script("grpo_cispo.py", script_flags(testbed, **flags), tmp_path)
    (row,) = read_metrics(run_dir(tmp_path))
    high = row["losses/clip_frac_high_pos"] + row["losses/clip_frac_high_neg"]
    assert high > 0 and row["losses/clip_frac_low_pos"] == row["losses/clip_frac_low_neg"] == 0
    assert high <= row["losses/clip_frac"] + 1e-12  # the capped tokens with A != 0 (those with A = 0: no sign)


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
        assert args.filter_groups and args.max_gen_batches == 2 and args.max_response_length == 16384
        assert args.loss_agg == "seq-mean-token-mean"  # their per-micro-batch mean at their layout
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
