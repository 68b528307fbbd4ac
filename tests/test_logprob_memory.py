"""The log-prob forward keeps one hidden state: utils.logprobs.response_logprobs asks the model for the final (normed)
hidden states only, not every layer's (which a no-grad pass kept alive to the end of the forward: 6.7 GB at 32B x 10k
tokens), with the values and gradients of the pass that took them from every layer's. Measured sizes:
benchmarks/experiments/bench_hidden_states_memory.py, benchmarks/results/logprob_hidden_states_memory.md."""

import torch
from transformers import AutoModelForCausalLM

from utils import batching, logprobs


def test_the_logprob_forward_keeps_only_the_final_hidden_state(testbed):
    """The forward's output holds one hidden-state tensor, [batch, time, hidden]; log-probs, entropies and gradients
    equal, bit for bit, those computed from output_hidden_states=True's last state, padded and packed, with and without
    gradient."""
    model = AutoModelForCausalLM.from_pretrained(testbed.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    outputs = []
    model.register_forward_hook(lambda module, args, output: outputs.append(output))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 9, 3)]
    responses = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (7, 2, 11)]
    for packed in (False, True):
        batch = batching.collate(prompts, responses, 0, "cpu", torch.tensor([1.0, -0.5, 0.25]), packed)
        for grad in (False, True):
            results = []
            for every_layer in (False, True):
                model.zero_grad()
                outputs.clear()
                with torch.set_grad_enabled(grad):
                    if every_layer:  # the pass as it was: every layer's states, the last one used
                        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
                        output = model(**inputs, output_hidden_states=True, logits_to_keep=1, use_cache=False)
                        hidden = output.hidden_states[-1]
                        mask = batch["response_mask"][:, 1:]
                        values = logprobs.chunked_logprobs_entropy(
                            hidden[:, :-1][mask], model.lm_head, batch["input_ids"][:, 1:][mask], 0.7, 4
                        )
                    else:
                        values = logprobs.response_logprobs(model, batch, 0.7, 4, True)
                        states = [h for h in outputs[0].hidden_states if h is not None]
                        assert len(states) == 1, f"{len(states)} hidden states kept, not the final one alone"
                        assert states[0].shape == (*batch["input_ids"].shape, model.config.hidden_size)
                if grad:
                    ((values[0] * batch["advantages"]).sum() + 0.1 * values[1].sum()).backward()
                grads = [p.grad.clone() for p in model.parameters()] if grad else []
                results.append([v.detach() for v in values[:2]] + grads)
            assert all(torch.equal(a, b) for a, b in zip(*results)), (packed, grad)
