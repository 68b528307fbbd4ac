"""Token-budget micro-batches and padding-free sequences (--max-tokens-per-micro-batch, --padding-free) change the
layout of the work, not the update: the real scripts, the real DeepSpeed engine, on the CPU testbed."""

import pytest
import torch
from launch import METHOD, final_weights, read_metrics, run_dir, run_script, script_flags
from transformers import AutoModelForCausalLM

import grpo_vanilla as gv
from utils import run


def test_packed_and_padded_sequences_give_the_same_logprobs_entropies_and_gradients(testbed):
    """One row without padding, positions restarting per sequence (transformers' block-causal mask under sdpa), against
    right-padded rows: the same per-token log-probs and entropies, loss and gradient."""
    model = AutoModelForCausalLM.from_pretrained(testbed.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 9, 3)]
    responses = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (7, 2, 11)]
    advantages = torch.tensor([1.0, -0.5, 0.25])
    results = []
    for packed in (False, True):
        batch = run.collate(prompts, responses, 0, "cpu", advantages, packed)
        assert batch["input_ids"].shape == ((1, 37) if packed else (3, 14))
        model.zero_grad()
        logp, entropy, _ = gv.response_logprobs(model, batch, 0.7, 4, True)
        loss = (logp * batch["advantages"]).sum() + 0.1 * entropy.sum()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((logp.detach(), entropy.detach(), loss.detach(), grads))
    (lp_a, h_a, loss_a, grads_a), (lp_b, h_b, loss_b, grads_b) = results
    assert lp_a.shape == (20,) and torch.allclose(lp_a, lp_b, atol=1e-5) and torch.allclose(h_a, h_b, atol=1e-5)
    assert torch.allclose(loss_a, loss_b, atol=1e-5)
    # float32 sums in another order (the packed row's shapes take other kernel blockings): the differences scale with
    # the gradient's size (entries up to ~30 here); measured <= 1.1e-6 of each tensor's largest entry (AVX-512 Xeon)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-5 * a.abs().max()) for a, b in zip(grads_a, grads_b))
    empty = run.collate([], [], 0, "cpu", torch.zeros(0), True)  # an empty micro-batch: one token, no response
    assert all(x.numel() == 0 for x in gv.response_logprobs(model, empty, 1.0, 4, True))


@pytest.mark.parametrize(
    "script, extra",
    [
        ("grpo_vanilla.py", {"no-use-vllm": True, "zero-stage": 3, "loss-agg": "seq-mean-token-mean"}),
        ("grpo_aent.py", {"no-use-vllm": True}),
        ("grpo_klcov.py", {"no-use-vllm": True}),
        ("grpo_clipcov.py", {}),  # vLLM: the sampler's log-probs regrouped with the micro-batches (--vllm-is-cap 2)
    ],
)
def test_token_budget_micro_batches_give_the_same_update(testbed, tmp_path, script, extra):
    """2 ranks: micro-batches of 4 sequences, right-padded, against micro-batches of at most 168 tokens packed into one
    row each (a different number per rank and mini-batch, padded with empty ones): the same metrics and weights,
    the Cov methods' global selections included."""
    common = {"total-steps": 1, "num-mini-batches": 2, "micro-batch-size": 4, **METHOD[script], **extra}
    layouts = {"fixed": {}, "budget": {"max-tokens-per-micro-batch": 168, "padding-free": True}}
    for name, layout in layouts.items():
        run_script(script, script_flags(testbed, **common, **layout), tmp_path / name, nproc=2)
    a, b = (read_metrics(run_dir(tmp_path / name)) for name in layouts)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1]  # 2 updates: the 2nd off-policy
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if not key.startswith("time/") and key not in ("charts/tokens_per_second", "charts/padding_frac"):
                assert rb[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (ra["step"], key)
        assert rb["charts/padding_frac"] < ra["charts/padding_frac"]
    wa, wb = final_weights(run_dir(tmp_path / "fixed")), final_weights(run_dir(tmp_path / "budget"))
    # Adam divides by sqrt(v): float-rounding differences in a near-zero gradient move a weight by up to ~1e-5 (lr 5e-4)
    assert all(torch.allclose(wa[k], wb[k], atol=5e-5) for k in wa)
