"""Unit tests of the math every script shares: advantages, loss aggregation, chunked log-probs/entropy."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo_aent as ga
import grpo_entadv as ge
import grpo_klcov as kc
import grpo_vanilla as gv
from utils import batching, logprobs, rollouts, tracking
from utils.data import load_tokenizer, step_prompt_indices
from utils.engine import make_args
from utils.sampler import HFSampler, Sample


def test_group_advantages_normalise_within_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    adv = gv.group_advantages(rewards)
    assert torch.allclose(adv.mean(dim=1), torch.zeros(3), atol=1e-6)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) / (rewards[0].std() + 1e-6) * 0.5)
    assert torch.equal(adv[1], torch.zeros(4))  # all-equal group: no signal
    assert adv[2, 3] < 0 < adv[2, 0]
    dr = gv.group_advantages(rewards, scale=False)  # Dr. GRPO: centred only
    assert torch.allclose(dr[2], torch.tensor([0.25, 0.25, 0.25, -0.75]))


def test_token_weights_match_each_aggregation_definition():
    lengths = torch.tensor([2, 3, 5])
    loss = torch.arange(10, dtype=torch.float32)
    per_seq = loss.split(lengths.tolist())
    w = gv.token_weights(lengths, 1, "token-mean", 10, 3, 8)
    assert torch.isclose((w * loss).sum(), loss.mean())
    w = gv.token_weights(lengths, 1, "seq-mean-token-mean", 10, 3, 8)
    assert torch.isclose((w * loss).sum(), torch.stack([s.mean() for s in per_seq]).mean())
    w = gv.token_weights(lengths, 1, "seq-mean-token-sum-norm", 10, 3, 8)
    assert torch.isclose((w * loss).sum(), torch.stack([s.sum() / 8 for s in per_seq]).mean())
    with pytest.raises(ValueError):
        gv.token_weights(lengths, 1, "sum", 10, 3, 8)


def test_token_weights_split_over_ranks_sum_to_global_mean():
    """Two 'ranks' with half the sequences each, normalised by global totals, give the global token mean."""
    lengths = torch.tensor([4, 1, 3, 6])
    loss = torch.randn(14)
    half = int(lengths[:2].sum())
    total = sum(
        (gv.token_weights(ls, 1, "token-mean", 14, 4, 8) * lo).sum()
        for ls, lo in ((lengths[:2], loss[:half]), (lengths[2:], loss[half:]))
    )
    assert torch.isclose(total, loss.mean(), atol=1e-6)


def test_ppo_clip_loss_clips_in_the_direction_of_the_advantage():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = gv.ppo_clip_loss(logp, old, adv, 0.2, 0.28)
    assert torch.allclose(loss, torch.tensor([-1.28, -0.5, 1.5, 0.8]))
    assert clipped.tolist() == [True, False, False, True]


def test_dual_clip_caps_the_loss_of_negative_advantages():
    """With clip_c (verl's clip_ratio_c): for A < 0 the loss is min(PPO-clip loss, -A c), with no gradient where the
    cap binds; A > 0 and clip_c = 0 are PPO-clip as before."""
    old = torch.zeros(5)
    logp = torch.log(torch.tensor([5.0, 2.0, 5.0, 0.5, 4.0])).requires_grad_()
    adv = torch.tensor([-1.0, -1.0, 1.0, -2.0, -0.5])
    loss, clipped = gv.ppo_clip_loss(logp, old, adv, 0.2, 0.2, 3.0)
    ratio, pg = logp.exp(), None
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    expected = torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)  # the published dual-clip formula
    assert torch.allclose(loss, expected)
    assert clipped.tolist() == [True, False, True, True, True]
    loss.sum().backward()
    assert logp.grad[0] == 0 and logp.grad[4] == 0 and logp.grad[1] != 0  # capped tokens: no gradient
    plain, plain_clipped = gv.ppo_clip_loss(logp.detach(), old, adv, 0.2, 0.2)
    assert torch.equal(plain, pg.detach()) and plain_clipped.tolist() == [False, False, True, True, False]


def test_clip_sums_split_the_clipped_tokens_by_side_and_sign():
    """losses/clip_frac_{high,low}_{pos,neg}: the loss-weighted tokens whose ratio left [1 - eps_low, 1 + eps_high],
    by side and sign of A; PPO-clip's clipped tokens are exactly high_pos + low_neg."""
    g = torch.Generator().manual_seed(0)
    logp, old = -3 * torch.rand(500, generator=g), -3 * torch.rand(500, generator=g)
    adv, weights = torch.randn(500, generator=g).round(), torch.rand(500, generator=g)  # zero advantages included
    sums = dict.fromkeys(tracking.CLIP_SUMS, 0.0)
    tracking.clip_sums(sums, logp - old, adv, weights, 0.2, 0.28)
    r = torch.exp(logp - old)
    for key, where in {
        "clip_frac_high_pos": (r > 1.28) & (adv > 0),
        "clip_frac_high_neg": (r > 1.28) & (adv < 0),
        "clip_frac_low_pos": (r < 0.8) & (adv > 0),
        "clip_frac_low_neg": (r < 0.8) & (adv < 0),
    }.items():
        assert sums[key].item() == pytest.approx(weights[where].sum().item(), rel=1e-6) and where.any(), key
    clipped = gv.ppo_clip_loss(logp, old, adv, 0.2, 0.28)[1]
    silenced = sums["clip_frac_high_pos"] + sums["clip_frac_low_neg"]
    assert silenced.item() == pytest.approx(weights[clipped].sum().item(), rel=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_logprobs_entropy_equal_naive_values_and_gradients(temperature, chunk_size):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(23, 16, requires_grad=True)
    targets = torch.randint(0, 50, (23,))
    upstream_lp, upstream_h = torch.randn(23), torch.randn(23)

    logp, ent, _ = logprobs.chunked_logprobs_entropy(hidden, head, targets, temperature, chunk_size)
    ((logp * upstream_lp).sum() + (ent * upstream_h).sum()).backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    log_probs = torch.log_softmax(head(hidden) / temperature, dim=-1)  # naive: full [N, V] softmax
    naive_logp = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    naive_ent = -(log_probs.exp() * log_probs).sum(-1)
    ((naive_logp * upstream_lp).sum() + (naive_ent * upstream_h).sum()).backward()
    assert torch.allclose(logp, naive_logp, atol=1e-5)
    assert torch.allclose(ent, naive_ent, atol=1e-5)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-5)
    assert torch.allclose(grads[1], head.weight.grad, atol=1e-5)


def test_chunked_logprobs_entropy_without_grad_and_without_entropy():
    head = torch.nn.Linear(8, 11, bias=False)
    hidden, targets = torch.randn(5, 8), torch.randint(0, 11, (5,))
    with torch.no_grad():
        logp, ent, _ = logprobs.chunked_logprobs_entropy(hidden, head, targets, 1.0, 2, with_entropy=False)
    assert torch.allclose(logp, torch.log_softmax(head(hidden), -1).gather(-1, targets[:, None]).squeeze(-1), atol=1e-6)
    assert torch.equal(ent, torch.zeros(5))


def test_collate_masks_response_tokens_only():
    batch = batching.collate([[5, 6], [7]], [[8, 9, 2], [4]], 0, "cpu")
    assert batch["input_ids"].tolist() == [[5, 6, 8, 9, 2], [7, 4, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[False, False, True, True, True], [False, True, False, False, False]]


def test_collect_for_gives_the_same_mini_batches_on_any_world_size(testbed):
    """utils.rollouts.collect_for, the path training takes (a stand-in sampler that writes its seed and a boxed answer;
    real tokenizer and math-verify): mini-batch m on one rank is the union of the two ranks' slices of it, prompts,
    seeded samples and rewards alike; the stream is a permutation per epoch (30 prompts all seen once in the first 30
    positions) in the order step_prompt_indices states (benchmarks/experiments/bench_trl.py hands TRL that order)."""
    tok = load_tokenizer(testbed.model_dir)
    args = gv.Args(num_prompts_per_step=8, num_mini_batches=2, group_size=2, seed=3)
    data = [([100 + i], str(i)) for i in range(30)]  # the prompt's one token id names its dataset index

    class Sampler:  # per prompt: sample 0 boxes the right answer, sample 1 a wrong one
        def generate(self, prompts, seeds, n):
            texts = [
                f"{seed + k} \\boxed{{{p[0] - 100 if k == 0 else -1}}}"
                for p, seed in zip(prompts, seeds)
                for k in (0, 1)
            ]
            return [Sample(tok.encode(t, add_special_tokens=False), [], False) for t in texts]

    def collect(consumed, ranks, world_size):
        after, parts = rollouts.collect_for(args, consumed, data, tok, Sampler(), 1, ranks, world_size)
        assert after == consumed + 8  # no --filter-groups: the step takes the next P prompts
        return [parts[r] for r in ranks]

    (one,), two = collect(40, [0], 1), collect(40, [0, 1], 2)  # step 5: the second epoch starts inside it
    for m in range(2):  # mini-batch m: 4 prompts on one rank, 2 on each of two
        whole, half = slice(4 * m, 4 * m + 4), slice(2 * m, 2 * m + 2)
        assert one.prompts[whole] == two[0].prompts[half] + two[1].prompts[half]
        assert torch.equal(one.rewards[whole], torch.cat([two[0].rewards[half], two[1].rewards[half]]))
        halves = [r.samples[4 * m : 4 * m + 4] for r in two]  # G = 2 samples per prompt, group-major
        assert one.samples[8 * m : 8 * m + 8] == halves[0] + halves[1]
    assert one.rewards.tolist() == [[1.0, 0.0]] * 8  # graded: the boxed answer right, then wrong
    assert one.prompts == [data[i][0] for _, i in step_prompt_indices(5, args, 30, 0, 1)]
    seen = [p[0] - 100 for consumed in range(0, 32, 8) for p in collect(consumed, [0], 1)[0].prompts][:30]
    assert sorted(seen) == list(range(30))


VALID = {"num_prompts_per_step": 8, "num_mini_batches": 2, "group_size": 4, "micro_batch_size": 4}
"""settings every script's validate_args accepts on 2 ranks; each row below changes some and must be refused"""
BAD_FLAGS = [
    (gv, {"group_size": 1}, "--group-size must be >= 2"),
    (gv, {"clip_eps_low": 0.0}, "--clip-eps-low must be > 0"),
    (gv, {"max_response_length": 0}, "--max-response-length must be >= 1"),
    (gv, {"zero_stage": 1}, "--zero-stage must be 2 or 3"),
    (gv, {"num_prompts_per_step": 6}, "must be divisible by --num-mini-batches x world size"),
    (gv, {"micro_batch_size": 3}, "--micro-batch-size (3) must divide"),
    (gv, {"vllm_is_cap": 0.5}, "--vllm-is-cap must be 0 (off) or >= 1"),
    (gv, {"vllm_is_min": 1.5}, "--vllm-is-min must be in [0, 1]"),
    (gv, {"top_entropy_quantile": 1.5}, "--top-entropy-quantile must be in"),
    (ga, {"clamp_p": 1.0}, "--clamp-p must be in [0, 1)"),
    (ga, {"entropy_low": 0.5}, "--entropy-low must be <= --entropy-high"),
    (ga, {"entropy_coef_min": 0.1}, "--entropy-coef-min must be in [0, --entropy-coef-max]"),
    (ga, {"entropy_coef_warmup": -1}, "--entropy-coef-warmup must be >= 0"),
    (kc, {"num_mini_batches": 1}, "KL-Cov needs >= 2 updates"),
    (ge, {"entadv_kappa": 0.5}, "--entadv-kappa must be > 1"),  # the paper's Eq. 5: kappa > 1
    (ge, {"entadv_kappa": 1.0}, "--entadv-kappa must be > 1"),
    (ge, {"entadv_alpha": -0.1}, "--entadv-alpha must be >= 0"),
]


@pytest.mark.parametrize("module, bad, message", BAD_FLAGS, ids=[f"{m.__name__}-{b}" for m, b, _ in BAD_FLAGS])
def test_validate_args_rejects_bad_values_with_the_flag_name(module, bad, message):
    """Every script's start-up check of its own flags (and vanilla's shared ones): VALID passes, each bad value exits
    with a message naming the flag (substring match: the messages hold brackets and parentheses)."""
    module.validate_args(make_args(module.Args, **VALID), 2)
    with pytest.raises(SystemExit) as raised:
        module.validate_args(make_args(module.Args, **{**VALID, **bad}), 2)
    assert message in str(raised.value), str(raised.value)


def test_a_gpu_without_bf16_is_one_line_naming_dtype(monkeypatch):
    """bf16, the GPUs' default, on a GPU without it (a V100, a T4): one line naming --dtype, not DeepSpeed's assertion
    after the model loaded; --dtype float32 passes. The GPU's two answers are set: this machine has no GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    for dtype in ("auto", "bfloat16"):
        with pytest.raises(SystemExit, match=f"--dtype {dtype}: this GPU has no bf16"):
            gv.validate_args(make_args(gv.Args, **{**VALID, "dtype": dtype}), 2)
    gv.validate_args(make_args(gv.Args, **{**VALID, "dtype": "float32"}), 2)


def test_kl_cov_accepts_one_mini_batch_with_two_epochs():
    """KL-Cov's check counts updates per rollout batch: 1 mini-batch x 2 epochs is 2 updates, accepted."""
    kc.validate_args(make_args(kc.Args, **{**VALID, "num_mini_batches": 1, "num_epochs": 2}), 2)


def test_fixed_number_of_head_calls_gives_the_same_values():
    """ZeRO-3 mode: a fixed number of chunks (some empty) computes exactly what size-based chunking does."""
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 13, bias=False)
    hidden, targets = torch.randn(5, 8), torch.randint(0, 13, (5,))
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    logp, ent, _ = logprobs.chunked_logprobs_entropy(hidden, head, targets, 1.0, 4)
    fixed_logp, fixed_ent, _ = logprobs.chunked_logprobs_entropy(hidden, head, targets, 1.0, 4, num_chunks=9)
    assert len(calls) == 2 + 9
    assert torch.allclose(logp, fixed_logp) and torch.allclose(ent, fixed_ent)


@pytest.mark.parametrize("temperature, with_entropy", [(1.0, True), (0.7, True), (0.7, False)])
def test_logprob_entropy_backward_is_the_exact_gradient(temperature, with_entropy):
    """The hand-written backward against autograd through log_softmax, in float64 (to rounding), bf16 (dtype kept)."""
    torch.manual_seed(0)
    z = torch.randn(6, 13, dtype=torch.float64, requires_grad=True)
    targets, u, w = torch.randint(0, 13, (6,)), torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    logp, entropy = logprobs._LogprobEntropy.apply(z * 1.0, targets, temperature, with_entropy)
    (grad,) = torch.autograd.grad((u * logp + w * entropy).sum(), z)
    log_probs = torch.log_softmax(z / temperature, dim=-1)
    ref_logp, ref_entropy = log_probs.gather(-1, targets[:, None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)
    (ref_grad,) = torch.autograd.grad((u * ref_logp + w * ref_entropy * with_entropy).sum(), z)
    assert torch.allclose(logp, ref_logp, atol=1e-12) and torch.allclose(grad, ref_grad, atol=1e-12)
    assert torch.allclose(entropy, ref_entropy, atol=1e-12) if with_entropy else not entropy.any()
    half = z.detach().bfloat16().requires_grad_()
    logp, _ = logprobs._LogprobEntropy.apply(half * 1.0, targets, temperature, with_entropy)
    assert logp.dtype == torch.float32 and torch.autograd.grad(logp.sum(), half)[0].dtype == torch.bfloat16


@pytest.mark.parametrize("used", ["logp", "entropy"])
def test_logprob_entropy_backward_with_one_output_outside_the_loss(used):
    """An output the loss does not use gets no gradient (None, not zeros): the other's gradient is still exact."""
    torch.manual_seed(0)
    z = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (5,))
    logp, entropy = logprobs._LogprobEntropy.apply(z * 1.0, targets, 0.8, True)
    (grad,) = torch.autograd.grad((logp if used == "logp" else entropy).sum(), z)
    log_probs = torch.log_softmax(z / 0.8, dim=-1)
    ref = log_probs.gather(-1, targets[:, None]).sum() if used == "logp" else -(log_probs.exp() * log_probs).sum()
    assert torch.allclose(grad, torch.autograd.grad(ref, z)[0], atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_sampler_records_each_sampled_tokens_logprob_after_temperature(testbed, temperature):
    """HFSampler (--no-use-vllm) returns each sampled token's log-prob at the sampling temperature, as vLLM's
    processed log-probs are: equal to a forward of prompt + response through the same model, for left-padded prompts
    of different lengths, one log-prob per response token (responses end at eos)."""
    model = AutoModelForCausalLM.from_pretrained(testbed.model_dir, dtype=torch.float32)
    tok = load_tokenizer(testbed.model_dir)
    args = SimpleNamespace(temperature=temperature, top_p=1.0, max_response_length=16, zero_stage=2)
    sampler = HFSampler(SimpleNamespace(module=model, device=torch.device("cpu")), tok, args)
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("Compute 12 times 7, then add 5 to the result.")]
    samples = sampler.generate(prompts, [5, 6], 3)
    assert len(samples) == 6
    with torch.no_grad():
        for k, s in enumerate(samples):
            prompt = prompts[k // 3]
            ids = torch.tensor([prompt + s.ids])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
            expected = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
            assert len(s.sampler_logps) == len(s.ids) > 0
            assert torch.allclose(torch.tensor(s.sampler_logps), expected, atol=1e-4), (k, s)
