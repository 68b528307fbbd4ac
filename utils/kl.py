"""Estimators of the KL to the reference policy, per token, from the sampled tokens' log-probs (J. Schulman,
"Approximating KL divergence", 2020): what --kl-estimator adds to the loss, times --kl-coef.

With d = log pi - log pi_ref (verl 0.9.1's kl_penalty, core_algos.py, and TRL 1.16's GRPOTrainer._compute_loss, which
has k3 alone; benchmarks/experiments/reference_corrections.py runs both):
- k1: d. Unbiased for KL(pi || pi_ref) in value; its expected gradient is 0 (the score function's mean).
- k2: d^2 / 2. Biased in value; its gradient is the true KL's gradient in expectation over pi's own samples.
- k3: exp(-d) + d - 1, d clamped to +-20 and the value to +-10 as verl (TRL clamps neither). Unbiased, low variance.
- k1+, k3+: the value of k1 / k3 with the gradient of k2 (verl's straight-through "+" variants, verl #2953).
- k3-is: k3 times pi / pi_old (with its gradient): DeepSeek-V3.2's unbiased KL estimate on samples of pi_old (TRL's
  use_bias_correction_kl).
"""

import torch


def kl_penalty(logp, ref_logp, old_logp, estimator: str) -> torch.Tensor:
    """The per-token KL estimate of `estimator` for the current log-probs `logp` (with gradient), the reference
    policy's `ref_logp` and the sampling policy's `old_logp` (k3-is only)."""
    d = logp - ref_logp
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator.startswith("k1"):
        value = d
    else:
        clamped = d.clamp(-20.0, 20.0)
        value = (torch.exp(-clamped) + clamped - 1).clamp(-10.0, 10.0)
    if estimator.endswith("+"):  # straight through: k2's gradient, this value
        k2 = 0.5 * d.square()
        return k2 - k2.detach() + value.detach()
    if estimator == "k3-is":
        return value * torch.exp(logp - old_logp)
    return value
