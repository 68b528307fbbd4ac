"""AEnt (grpo_aent.py): clamped entropy against its definition, the coefficient step, and end to end on the CPU testbed
(one global coefficient on every rank, restored by --resume). The plain bonus and the other coefficient rules:
tests/test_entreg.py.

The end-to-end runs use `--no-use-vllm`: AEnt changes nothing in generation (tests/test_e2e.py covers the vLLM
engine), and HF generate starts in half the time on a 2-core machine.
"""

import pytest
import torch
from launch import read_metrics, run_dir, run_script, script_flags, trainer_state

import grpo_aent as ga
from utils import logprobs, ops
from utils.data import step_prompt_indices


def definition(logits, clamp_p):
    """The paper's clamped entropy, literally: -inf on the floor(p V) lowest logits (top-k indices), softmax, H."""
    z = logits.double()
    k = min(int(clamp_p * z.shape[-1]), z.shape[-1] - 1)
    if k:
        z = z.scatter(-1, z.topk(k, dim=-1, largest=False).indices, -torch.inf)
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * torch.where(torch.isinf(z), 0.0, logp)).sum(dim=-1)


def values_and_grads(fn, logits, upstream):
    x = logits.detach().clone().requires_grad_()
    out = fn(x)
    (out * upstream.to(out.dtype)).sum().backward()
    return out.detach().double(), x.grad.double()


@pytest.mark.parametrize("clamp_p", [0.0, 0.2, 0.33, 0.9])
@pytest.mark.parametrize("vocab, block", [(50, None), (384, 1000), (1000, 1)])
def test_clamped_entropy_equals_the_definition(clamp_p, vocab, block):
    torch.manual_seed(0)
    logits, upstream = torch.randn(37, vocab) * 3, torch.randn(37)
    logits[::5, :3] += 10  # confident rows
    ours, ours_grad = values_and_grads(lambda x: ga.clamped_entropy(x, clamp_p, block), logits, upstream)
    ref, ref_grad = values_and_grads(lambda x: definition(x, clamp_p), logits, upstream)
    assert torch.allclose(ours, ref, atol=1e-5) and torch.allclose(ours_grad, ref_grad, atol=1e-5)


@pytest.mark.parametrize("make", ["randn", "bf16", "int", "sorted", "trend", "adversarial"])
def test_sampled_kth_value_equals_kthvalue_at_a_real_vocabulary(make):
    """kth_smallest's sampled bracket (a CPU path taken only at vocabularies of tens of thousands) is exact: ties,
    sorted rows, logits drifting along the vocabulary, and rows whose strided sample lies (the whole-row fallback)."""
    torch.manual_seed(2)
    z = torch.randn(8, 151_936) * 2.5
    if make == "bf16":
        z = z.bfloat16().float()
    if make == "int":
        z = torch.randint(0, 5, z.shape).float()
    if make == "sorted":
        z = z.sort(-1).values
    if make == "trend":
        z = z + torch.linspace(-20, 20, z.shape[-1])
    if make == "adversarial":
        z[::2, ::32] = 100.0  # the sample sees only the largest values in half the rows
    z[::4, :8] += 12
    for p in (0.001, 0.25, 0.33, 0.9, 0.999):
        k = int(p * z.shape[-1])
        assert torch.equal(ops.kth_smallest(z, k), z.kthvalue(k, dim=-1, keepdim=True).values), p


@pytest.mark.parametrize("clamp_p", [0.25, 0.33])
def test_clamped_entropy_equals_the_definition_at_a_real_vocabulary(clamp_p):
    torch.manual_seed(3)
    logits, upstream = torch.randn(6, 151_936) * 2.5 / 0.7, torch.randn(6)
    logits[::3, :8] += 12
    ours, ours_grad = values_and_grads(lambda x: ga.clamped_entropy(x, clamp_p), logits, upstream)
    ref, ref_grad = values_and_grads(lambda x: definition(x, clamp_p), logits, upstream)
    assert torch.allclose(ours, ref, atol=1e-5) and torch.allclose(ours_grad, ref_grad, atol=1e-6)


def test_clamp_zero_is_the_full_entropy():
    """Value and gradient: verl's plain bonus takes logsumexp(z) - sum softmax(z) z (entropy_from_logits)."""
    logits, upstream = torch.randn(9, 384) * 2, torch.rand(9)
    full = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(ga.clamped_entropy(logits, 0.0), full, atol=1e-5)
    ours = values_and_grads(lambda z: ga.clamped_entropy(z, 0.0), logits, upstream)
    plain = values_and_grads(lambda z: z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1), logits, upstream)
    assert torch.allclose(ours[0], plain[0], atol=1e-5) and torch.allclose(ours[1], plain[1], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ties_at_the_threshold_give_the_same_value_and_share_the_gradient(dtype):
    """bf16 logits (and small integers) tie at the threshold: the value is that of dropping any k of the tied ones; the
    gradient equals the definition's away from the threshold, and its sum over the tied logits is the same."""
    torch.manual_seed(1)
    logits = (torch.randn(16, 384) * 3).to(dtype) if dtype == torch.bfloat16 else torch.randint(0, 5, (16, 384)).float()
    upstream = torch.randn(16)
    k = int(0.33 * 384)
    threshold = logits.float().kthvalue(k, dim=-1, keepdim=True).values
    tied = logits.float() == threshold
    assert (tied.sum(-1) > 1).any()  # the case under test
    ours, ours_grad = values_and_grads(lambda x: ga.clamped_entropy(x, 0.33), logits, upstream)
    ref, ref_grad = values_and_grads(lambda x: definition(x, 0.33), logits, upstream)
    assert ours_grad.shape == ref_grad.shape and ga.clamped_entropy(logits, 0.33).dtype == torch.float32
    assert torch.allclose(ours, ref, atol=1e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the gradient itself is rounded to bf16
    assert torch.allclose(ours_grad[~tied], ref_grad[~tied], atol=tol)
    assert torch.allclose((ours_grad * tied).sum(-1), (ref_grad * tied).sum(-1), atol=tol)


def test_clamp_close_to_one_keeps_at_least_one_token():
    logits = torch.randn(4, 10, requires_grad=True)
    for p in (0.95, 0.999, 1.0):
        h = ga.clamped_entropy(logits, p)
        assert torch.allclose(h, torch.zeros(4), atol=1e-5)  # only the largest logit is left
        h.sum().backward()
        assert torch.isfinite(logits.grad).all()
    top2 = torch.tensor([[3.0, 3.0, 1.0, 0.0]])  # the largest is tied: one of them is kept, the value is 0 too
    assert torch.allclose(ga.clamped_entropy(top2, 0.99), torch.zeros(1), atol=1e-6)
    flat = torch.zeros(2, 100)  # all equal: log(number kept)
    assert torch.allclose(ga.clamped_entropy(flat, 0.33), torch.full((2,), torch.log(torch.tensor(67.0)).item()))


def test_gradcheck_in_float64():
    x = torch.randn(3, 20, dtype=torch.float64, requires_grad=True)
    for p in (0.0, 0.3, 0.9):
        assert torch.autograd.gradcheck(lambda z, p=p: ga.clamped_entropy(z, p, 16), (x,))


@pytest.mark.parametrize("num_chunks", [None, 9])
def test_chunked_pass_returns_the_clamped_entropy_with_gradient(num_chunks):
    """The log-prob pass computes the clamped entropy from each chunk's logits, recomputed under checkpoint."""
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 60, bias=False)
    hidden, targets = torch.randn(23, 16, requires_grad=True), torch.randint(0, 60, (23,))
    up_logp, up_clamped = torch.randn(23), torch.randn(23)

    def clamp(logits, _):  # as grpo_aent.py passes it: the clamped entropy at the temperature, per chunk of logits
        return ga.clamped_entropy(logits.float() / 0.7, 0.33)

    logp, entropy, clamped = logprobs.chunked_logprobs_entropy(
        hidden, head, targets, 0.7, 5, False, num_chunks, extra=clamp
    )
    ((logp * up_logp).sum() + (clamped * up_clamped).sum()).backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    logits = head(hidden) / 0.7
    naive_logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    naive_clamped = definition(logits, 0.33).float()
    ((naive_logp * up_logp).sum() + (naive_clamped * up_clamped).sum()).backward()
    assert torch.equal(entropy, torch.zeros(23))
    assert torch.allclose(logp, naive_logp, atol=1e-5) and torch.allclose(clamped, naive_clamped, atol=1e-5)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-5) and torch.allclose(grads[1], head.weight.grad, atol=1e-5)
    with torch.no_grad():  # the no-grad pass reports both entropies; without clamp_p the third output is zeros
        _, full, clamped_nograd = logprobs.chunked_logprobs_entropy(
            hidden, head, targets, 0.7, 5, True, num_chunks, clamp
        )
        assert torch.allclose(clamped_nograd, clamped) and (full >= clamped_nograd - 1e-6).all()
        assert torch.equal(logprobs.chunked_logprobs_entropy(hidden, head, targets, 0.7, 5)[2], torch.zeros(23))


BOX = {"low": 0.15, "high": 0.24, "lr": 0.002, "reg": 0.0, "init_coef": 0.002, "coef_min": 6e-4, "coef_max": 9e-3}


def test_next_entropy_coef_below_inside_and_above_the_box():
    assert ga.next_entropy_coef(0.003, 0.10, **BOX) == pytest.approx(0.003 + 0.002 * 0.05)  # below: rises
    assert ga.next_entropy_coef(0.003, 0.20, **BOX) == 0.003  # inside, no reg: unchanged
    assert ga.next_entropy_coef(0.003, 0.30, **BOX) == pytest.approx(0.003 - 0.002 * 0.06)  # above: falls
    assert ga.next_entropy_coef(0.003, 0.15, **BOX) == ga.next_entropy_coef(0.003, 0.24, **BOX) == 0.003  # edges


def test_next_entropy_coef_reg_pulls_towards_the_initial_value():
    reg = {**BOX, "reg": 0.5}
    assert ga.next_entropy_coef(0.004, 0.20, **reg) == pytest.approx(0.004 - 0.002 * 0.5 * 0.002)  # inside: pull only
    assert ga.next_entropy_coef(0.001, 0.20, **reg) == pytest.approx(0.001 + 0.002 * 0.5 * 0.001)
    assert ga.next_entropy_coef(0.004, 0.10, **reg) == pytest.approx(0.004 - 0.002 * (-0.05 + 0.5 * 0.002))


def test_next_entropy_coef_is_clipped_at_both_ends():
    assert ga.next_entropy_coef(0.0089, 0.0, **{**BOX, "lr": 1.0}) == 9e-3
    assert ga.next_entropy_coef(0.0007, 5.0, **{**BOX, "lr": 1.0}) == 6e-4
    assert ga.next_entropy_coef(0.05, 0.20, **BOX) == 9e-3  # a start outside [min, max] is clipped at the first step


# ---- end to end: 2 ranks, 2 optimizer updates per step, 2 micro-batches per update on each rank ----
ADAPTIVE = {
    "no-use-vllm": True,
    "num-mini-batches": 2,
    "micro-batch-size": 2,
    "entropy-coef": 0.002,
    "entropy-low": 0.3,
    "entropy-high": 0.3,
    "entropy-coef-lr": 0.02,
    "entropy-coef-warmup": 1,
}


def coef_step(coef, entropy):
    return ga.next_entropy_coef(
        coef, entropy, low=0.3, high=0.3, lr=0.02, reg=0.0, init_coef=0.002, coef_min=6e-4, coef_max=9e-3
    )


@pytest.fixture(scope="module")
def straight_run(testbed, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    run_script("grpo_aent.py", script_flags(testbed, **ADAPTIVE, **{"total-steps": 4}), out, nproc=2)
    return run_dir(out)


@pytest.mark.launches
def test_one_coefficient_on_every_rank_stepped_from_the_world_mean(testbed, straight_run):
    rows = read_metrics(straight_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the ranks train on different prompts...
    args = ga.Args(num_prompts_per_step=4, num_mini_batches=2, seed=1)
    with open(testbed.train_file) as f:
        n_prompts = sum(1 for _ in f)
    for step in range(4):
        assert {i for _, i in step_prompt_indices(step, args, n_prompts, 0, 2)}.isdisjoint(
            i for _, i in step_prompt_indices(step, args, n_prompts, 1, 2)
        )
    # ...and hold the same coefficient at every step
    assert all(r["entropy/coef_rank_spread"] == 0.0 for r in rows)
    coefs = [r["entropy/coef"] for r in rows]
    assert coefs[0] == coefs[1] == 0.002  # warm-up: the first update uses step 2's entropy
    for before, after in zip(rows[1:], rows[2:]):  # driven by the token mean over both ranks and all updates
        assert after["entropy/coef"] == pytest.approx(
            coef_step(before["entropy/coef"], before["entropy/clamped_train"]), rel=1e-12
        )
    assert coefs[2] != coefs[1]
    assert trainer_state(straight_run)["method_state"]["entropy_coef"] == pytest.approx(
        coef_step(coefs[3], rows[3]["entropy/clamped_train"]), rel=1e-12
    )
    for r in rows:
        assert 0 < r["entropy/clamped"] <= r["entropy/full"] + 1e-6 and r["entropy/bonus"] > 0
