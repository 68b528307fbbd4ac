"""Rollout correction: the sampler's tokens weighted to the trainer's, against the numerical gap between the sampler
(vLLM's bf16 kernels, or a policy some updates behind with --max-staleness) and the trainer's log-probs.

r = pi_old / pi_sampler, per token or per sequence, bounded by [low, cap] (low 0: no lower bound; cap 0: no correction,
every weight 1). The modes, each equal to its framework's code (benchmarks/experiments/reference_corrections.py):
- token-truncate: min(max(r_t, low), cap). TRL 1.16's token_truncate; verl 0.9.1's rollout_is "token" with a single
  threshold (TIS).
- token-mask: r_t where low <= r_t <= cap, else 0. TRL's token_mask; with a lower bound IcePop (verl's rollout_is
  "token" with the threshold "low_cap").
- sequence-truncate / sequence-mask: the same on the sequence's product of ratios, exp(sum_t log r_t), for each of its
  tokens. TRL's sequence_truncate / sequence_mask (its default, at cap 3); verl's rollout_is "sequence".
- geo-mask: weight 1 while the sequence's geometric-mean ratio exp(mean_t log r_t) lies in [low, cap], else 0. verl's
  rejection rollout_rs "seq_mean_k1", whose threshold "L_U" bounds exp(-mean_t log r_t), the inverse: ours [low, cap]
  is its "1/cap_1/low".
A masked token leaves the loss's numerator and stays in its denominator (--loss-agg's token or sequence counts), as in
TRL's masks; verl's rejection takes it out of both (it edits the response mask), a loss larger by all / kept tokens.
Log-ratios are clamped to +-20 before exp, as verl (SAFETY_BOUND); TRL does not clamp, which only turns an overflowing
ratio into the bound it is truncated or masked at anyway.
"""

from typing import Literal

import torch

CorrectionMode = Literal["token-truncate", "token-mask", "sequence-truncate", "sequence-mask", "geo-mask"]


def rollout_weights(old_logp, sampler_logp, lengths, mode: CorrectionMode, low: float, cap: float):
    """(weights, truncated, masked) for the flat response tokens of a micro-batch (lengths: its responses' token counts,
    CPU): each token's weight in the loss (detached, float32, on the tokens' device), and which tokens the mode moved to
    a bound (truncate modes) or dropped (mask modes)."""
    log_ratio = (old_logp.float() - sampler_logp.float()).clamp(-20.0, 20.0)
    none = torch.zeros_like(log_ratio, dtype=torch.bool)
    if not cap:
        return torch.ones_like(log_ratio), none, none
    if not mode.startswith("token"):  # one value per sequence: the sum (or mean) of its log-ratios, on its tokens
        lengths = lengths.to(log_ratio.device)
        seq = torch.zeros(len(lengths), device=log_ratio.device)
        seq.index_add_(0, torch.arange(len(lengths), device=log_ratio.device).repeat_interleave(lengths), log_ratio)
        seq = seq / lengths.clamp(min=1) if mode == "geo-mask" else seq
        log_ratio = seq.clamp(-20.0, 20.0).repeat_interleave(lengths)
    ratio = torch.exp(log_ratio)
    outside = (ratio < low) | (ratio > cap)
    if mode.endswith("truncate"):
        return ratio.clamp(min=low, max=cap), outside, none
    kept = ratio if mode != "geo-mask" else torch.ones_like(ratio)
    return torch.where(outside, torch.zeros_like(ratio), kept), none, outside
