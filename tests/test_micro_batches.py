"""Padding-free sequences (--padding-free) change the layout of the work, not the values: one packed row against
right-padded rows through the policy. The token-budget micro-batches (--max-tokens-per-micro-batch) through the real
scripts, each method packed on 2 ranks against fixed micro-batches: tests/test_selection_layouts.py."""

import torch
from transformers import AutoModelForCausalLM

from utils import batching, logprobs


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
        batch = batching.collate(prompts, responses, 0, "cpu", advantages, packed)
        assert batch["input_ids"].shape == ((1, 37) if packed else (3, 14))
        model.zero_grad()
        logp, entropy, _ = logprobs.response_logprobs(model, batch, 0.7, 4, True)
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
    empty = batching.collate([], [], 0, "cpu", torch.zeros(0), True)  # an empty micro-batch: one token, no response
    assert all(x.numel() == 0 for x in logprobs.response_logprobs(model, empty, 1.0, 4, True))
