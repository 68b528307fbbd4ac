"""The log-prob kernel of the method scripts: each response token's log-prob and full-vocabulary entropy under a model
(and a method's own per-token value from the logits and targets, `extra`), the output head run chunk by chunk so that
the [tokens, vocab] logits are never built, with a backward that keeps one float32 chunk. Knows no method."""

import math

import torch
from torch.utils.checkpoint import checkpoint


class _LogprobEntropy(torch.autograd.Function):
    """Log-prob of each target and the entropy H = -sum p log p from a chunk of logits [N, vocab] at a temperature.

    Autograd would keep ~5 chunk-sized tensors for the backward; this keeps the scaled float32 logits only and
    writes the gradient over them in place: d(u logp + w H)/dz_i = u (onehot_i - p_i) - w p_i (log p_i + H).
    Its backward runs once per forward (each chunk is recomputed for its backward); an output outside the loss gets
    no gradient term (the entropy of a metric costs nothing in the backward).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        z = logits.to(dtype) / temperature if temperature != 1 or logits.dtype != dtype else logits
        log_norm = z.logsumexp(dim=-1)
        logp = z.gather(-1, targets[:, None]).squeeze(-1) - log_norm
        entropy = (
            log_norm - torch.linalg.vecdot(torch.softmax(z, dim=-1), z) if with_entropy else torch.zeros_like(logp)
        )
        ctx.save_for_backward(z, targets, log_norm, entropy)
        ctx.set_materialize_grads(False)  # None, not zeros, for an output the loss does not use
        ctx.temperature, ctx.dtype, ctx.with_entropy = temperature, logits.dtype, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        z, targets, log_norm, entropy = ctx.saved_tensors
        grad_logp = torch.zeros_like(log_norm) if grad_logp is None else grad_logp
        log_p = z.sub_(log_norm[:, None])  # z is not needed again: reuse its memory
        p = log_p.exp()
        if ctx.with_entropy and grad_entropy is not None:  # log_p becomes -(w (log p + H) + u), then p times it
            factor = log_p.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_logp[:, None]).neg_()
        else:
            factor = log_p.copy_(-grad_logp[:, None].expand_as(log_p))
        grad = p.mul_(factor).scatter_add_(-1, targets[:, None], grad_logp[:, None]).div_(ctx.temperature)
        return grad.to(ctx.dtype), None, None, None


def _logprob_entropy_chunk(lm_head, hidden, targets, temperature: float, with_entropy: bool, extra):
    logits = lm_head(hidden)
    logp, entropy = _LogprobEntropy.apply(logits, targets, temperature, with_entropy)
    return logp, entropy, torch.zeros_like(logp) if extra is None else extra(logits, targets)


def chunked_logprobs_entropy(
    hidden, head, targets, temperature, chunk_size, with_entropy=True, num_chunks=None, extra=None
):
    """Log-prob of each target token, full-vocabulary entropy and `extra(logits, targets)` (a method's own per-token
    value from each chunk's raw logits [n, vocab] and targets [n]; zeros without it) from final hidden states [N, H]:
    three [N] tensors.

    The [N, vocab] logits are never built: rows go through the head `chunk_size` at a time, each chunk recomputed in
    the backward pass, so peak memory is bounded by one chunk's logits. `num_chunks` fixes the number of head calls
    instead (chunks of at most `chunk_size` rows if N <= num_chunks * chunk_size): ZeRO-3 gathers the head's weight
    on every call, so all ranks must call it equally often whatever their token counts.
    """
    outputs = []
    n = num_chunks or max(1, math.ceil(hidden.shape[0] / chunk_size))
    for h, y in zip(hidden.tensor_split(n), targets.tensor_split(n)):
        chunk = (head, h, y, temperature, with_entropy, extra)
        if torch.is_grad_enabled():
            outputs.append(checkpoint(_logprob_entropy_chunk, *chunk, use_reentrant=False))
        else:
            outputs.append(_logprob_entropy_chunk(*chunk))
    return tuple(torch.cat(values) for values in zip(*outputs))


def current_logprobs(logprobs, policy, batches: list, mb, old_logps: list, updated: bool) -> list:
    """The policy's log-probs of the micro-batches `mb` without gradient, for a selection made before an update:
    before the step's first update (`updated` False) the sampling policy's, which the log-prob pass has (`old_logps`);
    after it a forward of each (`logprobs`: the script's log-prob function)."""
    with torch.no_grad():
        return [logprobs(policy, batches[i])[0] if updated else old_logps[i] for i in mb]


def response_logprobs(model, batch, temperature, chunk_size, with_entropy, num_chunks=None, extra=None):
    """Per-token log-probs, entropies and extra values of the response tokens of a collated batch, in order."""
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids") if key in batch}
    module = model.module if hasattr(model, "module") else model  # a DeepSpeed engine, or the model itself
    # logits_to_keep=1: the head runs chunk by chunk below, not over [batch, time, vocab]. The hidden states of the last
    # decoder layer alone: transformers records that layer's output only and puts the final (normed) states in its
    # place (5.19 utils/output_capturing.py l. 273-278, 292-305), the same tensor as hidden_states[-1] with True, which
    # kept every layer's [batch, time, hidden] to the end of a no-grad pass (65 x 10k x 5120 bf16 = 6.8 GB at 32B).
    last = [module.config.num_hidden_layers - 1]
    output = model(**inputs, output_hidden_states=last, logits_to_keep=1, use_cache=False)
    at = batch["target_at"]  # the flat position before each response token (utils/batching.py collate)
    hidden = output.hidden_states[-1].flatten(0, 1).index_select(0, at)
    targets = batch["input_ids"].flatten().index_select(0, at + 1)
    head = module.get_output_embeddings()
    return chunked_logprobs_entropy(hidden, head, targets, temperature, chunk_size, with_entropy, num_chunks, extra)
