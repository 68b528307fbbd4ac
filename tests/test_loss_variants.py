"""The loss variants the frameworks merged: SAPO (grpo_sapo.py, arXiv 2511.20347), GSPO (grpo_gspo.py, arXiv
2507.18071) and W-REINFORCE (grpo_wreinforce.py, arXiv 2506.01347). Each paper's equation stated per token (or
sequence) in our words, in float64, with its gradient derived by hand on every branch; then the real scripts end to
end: SAPO and GSPO on policy are vanilla step for step, W-REINFORCE trains on its fixed weights. The references' own
code (verl 0.9.1, TRL 1.16) is run against ours by benchmarks/experiments/reference_losses.py."""

import math

import pytest
import torch
from launch import final_weights, read_metrics, run_dir, run_script, script_flags
from test_remedies import recipe_args

import grpo_gspo as gs
import grpo_sapo as sa
import grpo_wreinforce as wr


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ---- SAPO ----
def sapo_published(a: float, log_r: float, tau_pos: float, tau_neg: float) -> tuple[float, float, float]:
    """(loss, d loss / d log pi, gate) of one token: -A (4 / tau) s, s = sigmoid(tau (r - 1)); d/d log pi =
    -A (4 / tau) s (1 - s) tau r = -A r w with w = 4 s (1 - s); tau by A's sign (A > 0: tau_pos)."""
    tau = tau_pos if a > 0 else tau_neg
    r = math.exp(log_r)
    s = sigmoid(tau * (r - 1))
    w = 4 * s * (1 - s)
    return -a * 4 / tau * s, -a * r * w, w


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 2.0), (1.0, 1.0)])
def test_sapo_is_the_published_gate(tau_pos, tau_neg):
    g = torch.Generator().manual_seed(0)
    adv = torch.cat([torch.randn(300, generator=g, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)])
    old = -3 * torch.rand(310, generator=g, dtype=torch.float64)
    logp = (old + torch.randn(310, generator=g, dtype=torch.float64)).requires_grad_()
    loss, gate = sa.sapo_loss(logp, old, adv, tau_pos, tau_neg)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    want = [sapo_published(a, lp - o, tau_pos, tau_neg) for a, lp, o in zip(adv.tolist(), logp.tolist(), old.tolist())]
    for got, column in ((loss, 0), (grad, 1), (gate, 2)):
        assert torch.allclose(got, torch.tensor([w[column] for w in want], dtype=torch.float64), rtol=1e-12, atol=0)
    assert not gate.requires_grad and (gate <= 1).all() and (gate > 0).all()


def test_sapo_on_policy_is_the_policy_gradient_and_fades_off_policy():
    """r = 1: the gate is 1 and the gradient -A (PPO's); the loss is -2A / tau. Far from 1 the gradient fades, the
    negative tokens (tau_neg > tau_pos) sooner; beyond the +-20 clamp it is 0 (TRL, unclamped: below |A| e^-20)."""
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.float64)
    logp = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    loss, gate = sa.sapo_loss(logp, torch.zeros(4, dtype=torch.float64), adv, 1.0, 1.05)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.equal(gate, torch.ones(4, dtype=torch.float64)) and torch.allclose(grad, -adv, rtol=1e-15, atol=0)
    assert torch.allclose(loss, torch.tensor([-2.0, 2 / 1.05, -4.0, 4 / 1.05], dtype=torch.float64))
    log_r = torch.tensor([0.5, 0.5], dtype=torch.float64)  # the same ratio, A of either sign
    _, gate = sa.sapo_loss(log_r, torch.zeros(2, dtype=torch.float64), torch.tensor([1.0, -1.0]).double(), 1.0, 1.05)
    assert 0 < gate[1] < gate[0] < 1
    far = torch.tensor([25.0, -25.0], dtype=torch.float64, requires_grad=True)
    loss, _ = sa.sapo_loss(far, torch.zeros(2, dtype=torch.float64), torch.tensor([1.0, 1.0]).double(), 1.0, 1.05)
    assert torch.equal(torch.autograd.grad(loss.sum(), far)[0], torch.zeros(2, dtype=torch.float64))


def test_sapo_metrics_split_the_gate_by_sign():
    sums = dict.fromkeys(["gate_pos", "tokens_pos", "gate_neg", "tokens_neg"], 0.0)
    sa.sapo_sums(sums, torch.tensor([1.0, 0.5, 0.25, 0.9]), torch.tensor([1.0, 1.0, -1.0, 0.0]))
    assert sa.sapo_metrics(sums) == {"sapo/gate_pos": 0.75, "sapo/gate_neg": 0.25}  # A = 0: in neither


# ---- GSPO ----
def gspo_published(adv: list, log_ratios: list, eps_low: float, eps_high: float):
    """Per sequence (its one advantage, its tokens' log-ratios): s = exp(mean log-ratio), the loss min-clipped as
    PPO's, max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)), and d loss / d log pi_t = -A s / |y| (unclipped) or 0
    (the clipped branch: A > 0 and s > 1 + eps_high, or A < 0 and s < 1 - eps_low), the same for every token."""
    rows = []
    for a, lr in zip(adv, log_ratios):
        s = math.exp(sum(lr) / len(lr))
        clipped = (a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low)
        loss = max(-a * s, -a * min(max(s, 1 - eps_low), 1 + eps_high))
        rows.append((s, loss, 0.0 if clipped else -a * s / len(lr), clipped))
    return rows


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.2)])
def test_gspo_is_the_published_sequence_clip(level, eps):
    """Either level: each token's loss is its sequence's; with a sequence's tokens weighted 1 / |y| (the paper's
    sequence mean) each token's gradient is -A s / |y| where the clipped branch is inactive, else 0."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 1, 3, 7, 2, 4, 6, 3])
    seq_adv = [1.0, -1.0, 0.5, -0.7, 2.0, -2.0, 0.0, 1.5]
    old = -3 * torch.rand(int(lengths.sum()), generator=g, dtype=torch.float64)
    logp = (old + 2e-4 * torch.randn(old.shape, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor(seq_adv, dtype=torch.float64).repeat_interleave(lengths)
    seq_log_ratio = gs.sequence_log_ratios(logp, old, lengths)
    loss, clipped = gs.gspo_loss(logp, seq_log_ratio, adv, *eps, level)
    per_seq_weight = (1.0 / lengths.double()).repeat_interleave(lengths)
    (grad,) = torch.autograd.grad((loss * per_seq_weight).sum(), logp)
    spans = torch.split(torch.arange(len(old)), lengths.tolist())
    log_ratios = [(logp.detach() - old)[span].tolist() for span in spans]
    want = gspo_published(seq_adv, log_ratios, *eps)
    for span, (s, value, d, is_clipped) in zip(spans, want):
        assert torch.allclose(
            torch.exp(seq_log_ratio[span].detach()), torch.tensor(s, dtype=torch.float64), rtol=1e-12, atol=0
        )
        assert torch.allclose(loss[span].detach(), torch.tensor(value, dtype=torch.float64), rtol=1e-12, atol=1e-15)
        assert torch.allclose(grad[span], torch.tensor(d, dtype=torch.float64), rtol=1e-10, atol=1e-15)
        assert bool(clipped[span].all()) == is_clipped and bool(clipped[span].any()) == is_clipped  # whole sequences
    if eps == (3e-4, 4e-4):
        assert 0 < sum(w[3] for w in want) < len(want)  # both branches are exercised


def test_gspo_levels_agree_and_the_token_level_clamps_at_10():
    """One advantage and one weight per sequence: GSPO-token (verl) is the sequence form (TRL) in value and gradient;
    a sequence whose mean log-ratio is 12 gets s = e^10 at the token level (verl's clamp), e^12 at the sequence's."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([4, 2, 6])
    old = -2 * torch.rand(12, generator=g, dtype=torch.float64)
    base = old + 0.05 * torch.randn(12, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.8], dtype=torch.float64).repeat_interleave(lengths)
    weights = torch.tensor([0.1, 0.3, 0.05], dtype=torch.float64).repeat_interleave(lengths)
    out = {}
    for level in ("token", "sequence"):
        logp = base.clone().requires_grad_()
        loss, _ = gs.gspo_loss(logp, gs.sequence_log_ratios(logp, old, lengths), adv, 0.2, 0.2, level)
        out[level] = (loss.detach(), torch.autograd.grad((loss * weights).sum(), logp)[0])
    assert torch.allclose(out["token"][0], out["sequence"][0], rtol=1e-14, atol=0)
    assert torch.allclose(out["token"][1], out["sequence"][1], rtol=1e-12, atol=1e-16)
    far = (old + 12.0).requires_grad_()
    for level, want in (("token", 10.0), ("sequence", 12.0)):
        loss, _ = gs.gspo_loss(far, gs.sequence_log_ratios(far, old, lengths), -adv.abs(), 0.2, 0.2, level)
        assert torch.allclose(loss.detach(), adv.abs() * math.exp(want), rtol=1e-12, atol=0)  # A < 0: unclipped


def test_gspo_metrics_count_sequences():
    sums = dict.fromkeys(["seqs_clipped", "seq_ratio_dev", "seqs_trained"], 0.0)
    lengths = torch.tensor([2, 0, 3])
    seq_log_ratio = torch.tensor([math.log(1.5)] * 2 + [math.log(0.5)] * 3)
    gs.gspo_sums(sums, seq_log_ratio, torch.tensor([True, True, False, False, False]), lengths)
    metrics = gs.gspo_metrics(sums)  # the empty response: no sequence ratio, not counted
    assert metrics["gspo/seq_clip_frac"] == 0.5 and metrics["gspo/seq_ratio_dev"] == pytest.approx(0.5)


# ---- W-REINFORCE ----
@pytest.mark.parametrize("lam", [0.1, 0.0, 1.0])
def test_wreinforce_weights_are_lambda_and_minus_one(lam):
    """The paper's W-REINFORCE objective lam L_PSR + L_NSR as advantages: lam for r = 1, -1 for r = 0, whatever the
    group (no baseline: an all-wrong group is pushed down, an all-right one up); lam 0 is NSR's weights."""
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = wr.weighted_advantages(rewards, lam)
    want = torch.tensor([[lam if r == 1 else -1.0 for r in row] for row in rewards.tolist()])
    assert torch.equal(adv, want)


# ---- end to end: the real scripts, DeepSpeed on gloo, 2 ranks ----
@pytest.mark.launches
def test_on_policy_sapo_and_gspo_are_vanilla_and_wreinforce_trains(testbed, tmp_path):
    """One update per step (r = 1 exactly): SAPO with both temperatures 1 and GSPO take vanilla's gradient (-A per
    token), so with vanilla's token-mean their runs are vanilla's metric for metric and weight for weight, apart from
    SAPO's loss value (-2A / tau). W-REINFORCE with the authors' entropy bonus on 2 mini-batches: its metrics finite."""
    run = {"total-steps": 2, "num-prompts-per-step": 8, "group-size": 4, "num-mini-batches": 1, "micro-batch-size": 4}
    runs = {}
    for name, script, extra in [
        ("vanilla", "grpo_vanilla.py", {}),
        ("sapo", "grpo_sapo.py", {"sapo-tau-pos": 1.0, "sapo-tau-neg": 1.0, "loss-agg": "token-mean"}),
        ("gspo", "grpo_gspo.py", {"loss-agg": "token-mean"}),
        ("wr", "grpo_wreinforce.py", {"num-mini-batches": 2, "wr-entropy-coef": 0.001}),
    ]:
        out = tmp_path / name
        run_script(script, script_flags(testbed, **{**run, **extra, "no-use-vllm": True}), out, nproc=2)
        runs[name] = run_dir(out)
    vanilla = read_metrics(runs["vanilla"])
    for name, own in (("sapo", "sapo/"), ("gspo", "gspo/")):
        for v, m in zip(vanilla, read_metrics(runs[name]), strict=True):
            shared = [k for k in v if not k.startswith("time/") and k not in ("charts/tokens_per_second",)]
            shared = [k for k in shared if not (name == "sapo" and k == "losses/policy_loss")]
            assert {k: v[k] for k in shared} == {k: m[k] for k in shared}, name
            assert {k for k in m if k.startswith(own)}, f"{name} logs its metrics"
        w0, w1 = final_weights(runs["vanilla"]), final_weights(runs[name])
        assert all(torch.equal(w0[k], w1[k]) for k in w0), name
    for m in read_metrics(runs["sapo"]):
        assert m["sapo/gate_pos"] == 1.0 and m["sapo/gate_neg"] == 1.0  # on policy
    for m in read_metrics(runs["gspo"]):
        assert m["gspo/seq_clip_frac"] == 0.0 and m["gspo/seq_ratio_dev"] == 0.0
    for m in read_metrics(runs["wr"]):
        assert math.isfinite(m["losses/policy_loss"]) and m["losses/grad_norm"] > 0


# ---- the reproduction scripts (benchmarks/reproduce/, docs/fidelity.md): the references' settings, flag for flag ----
def test_the_sapo_recipe_runs_verls_example():
    runs = recipe_args("sapo_qwen3_30b.sh")
    assert set(runs) == {"grpo_vanilla", "grpo_sapo"}
    for args in runs.values():
        assert args.num_prompts_per_step == 256 and args.group_size == 16 and args.num_mini_batches == 8
        assert args.learning_rate == 1e-6 and args.kl_coef == 0 and args.max_response_length == 8192
        assert args.overlong_buffer_len == 4096 and args.model_name_or_path == "Qwen/Qwen3-30B-A3B-Base"
    sapo = runs["grpo_sapo"]
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg, sapo.loss_agg) == (1.0, 1.05, "seq-mean-token-mean")


def test_the_gspo_recipe_runs_verls_example():
    runs = recipe_args("gspo_qwen2.5_3b_gsm8k.sh", METHODS="grpo_vanilla grpo_gspo grpo_gspo_trl")
    assert set(runs) == {"grpo_vanilla", "grpo_gspo", "grpo_gspo_trl"}
    for args in runs.values():
        assert args.num_prompts_per_step == 512 and args.group_size == 16 and args.num_mini_batches == 4
        assert args.learning_rate == 1e-6 and args.warmup_steps == 25 and args.weight_decay == 0.1
        assert args.loss_agg == "seq-mean-token-mean" and args.kl_coef == 0 and args.dataset == "openai/gsm8k:main"
    for name, level in (("grpo_gspo", "token"), ("grpo_gspo_trl", "sequence")):
        assert (runs[name].clip_eps_low, runs[name].clip_eps_high, runs[name].gspo_level) == (3e-4, 4e-4, level)


def test_the_wreinforce_recipe_runs_the_authors_settings():
    runs = recipe_args("wreinforce_qwen2.5_math_7b.sh")
    assert set(runs) == {"grpo_vanilla", "grpo_wreinforce"}
    for args in runs.values():
        assert args.num_prompts_per_step == 1024 and args.group_size == 8 and args.num_mini_batches == 4
        assert args.learning_rate == 1e-6 and args.max_response_length == 3072 and args.total_steps == 140
        assert (args.clip_eps_low, args.clip_eps_high, args.loss_agg) == (0.2, 0.2, "token-mean")
    w = runs["grpo_wreinforce"]
    assert (w.wr_lambda, w.wr_entropy_coef, w.kl_coef) == (0.1, 0.001, 0) and runs["grpo_vanilla"].kl_coef == 0.001
