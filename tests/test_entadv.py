"""The entropy-based advantage (grpo_entadv.py, Cheng et al. 2025, arXiv 2506.14758): the shaping term against the
published formula, its sign guarantee, and the real script end to end: with alpha 0 it is vanilla, step for step."""

import math

import pytest
import torch
from launch import final_weights, read_metrics, run_dir, run_script, script_flags

import grpo_entadv as ge


def published(a: float, h: float, alpha: float, kappa: float) -> float:
    """psi(H) = min(alpha H^detach, |A| / kappa), A' = A + psi, one token at a time in float64."""
    return a + min(alpha * h, abs(a) / kappa)


@pytest.mark.parametrize("alpha, kappa", [(0.4, 2.0), (0.1, 2.0), (1.0, 1.5), (0.0, 3.0)])
def test_shaping_is_the_published_formula(alpha, kappa):
    g = torch.Generator().manual_seed(0)
    adv = torch.cat([torch.randn(500, generator=g, dtype=torch.float64) * 2, torch.zeros(20, dtype=torch.float64)])
    entropy = torch.rand(520, generator=g, dtype=torch.float64) * 5
    shaped, psi = ge.entropy_advantages(adv, entropy, alpha, kappa)
    want = [published(a, h, alpha, kappa) for a, h in zip(adv.tolist(), entropy.tolist())]
    want = torch.tensor(want, dtype=torch.float64)
    assert torch.equal(shaped, want)
    assert torch.allclose(psi, shaped - adv, rtol=0, atol=1e-15)
    assert (psi >= 0).all() and (psi[-20:] == 0).all()  # A = 0: no bonus
    assert ((shaped * adv) >= 0).all() and ((shaped > 0) == (adv > 0)).all()  # kappa > 1: never a sign flip
    if alpha == 0:
        assert torch.equal(shaped, adv)


def test_entropy_is_detached():
    adv = torch.tensor([1.0, -1.0, 0.5])
    entropy = torch.tensor([0.1, 0.2, 3.0], requires_grad=True)
    shaped, _ = ge.entropy_advantages(adv, entropy, 0.4, 2.0)
    assert not shaped.requires_grad  # no gradient flows into the entropy through the advantage
    assert shaped.tolist() == pytest.approx([1.04, -0.92, 0.75])  # 0.5 + min(1.2, 0.25)


# ---- end to end: real scripts, DeepSpeed on gloo, 2 ranks ----
RUN = {"total-steps": 2, "num-prompts-per-step": 8, "group-size": 4, "num-mini-batches": 2, "micro-batch-size": 4}


@pytest.mark.launches
def test_alpha_zero_is_vanilla_and_alpha_shapes(testbed, tmp_path):
    """alpha 0 follows vanilla's trajectory exactly (every metric, the final weights): the file is vanilla plus the
    shaping. With the paper's alpha and the 80/20 selection on, the shaping is measured and bounded by |A| / kappa."""
    runs = {}
    for name, script, extra in [
        ("vanilla", "grpo_vanilla.py", {}),
        ("alpha0", "grpo_entadv.py", {"entadv-alpha": 0.0}),
        ("shaped", "grpo_entadv.py", {"entadv-alpha": 0.4, "top-entropy-quantile": 0.5}),
    ]:
        out = tmp_path / name
        run_script(script, script_flags(testbed, **RUN, **extra, **{"no-use-vllm": True}), out, nproc=2)
        runs[name] = run_dir(out)
    vanilla, alpha0 = read_metrics(runs["vanilla"]), read_metrics(runs["alpha0"])
    for v, e in zip(vanilla, alpha0, strict=True):
        shared = [k for k in v if not k.startswith("time/") and k != "charts/tokens_per_second"]
        assert {k: v[k] for k in shared} == {k: e[k] for k in shared}
        assert e["entadv/bonus"] == 0 and e["entadv/bonus_rel"] == 0
    w0, w1 = final_weights(runs["vanilla"]), final_weights(runs["alpha0"])
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    for r in read_metrics(runs["shaped"]):
        assert r["entadv/bonus"] > 0 and 0 < r["entadv/bonus_rel"] <= 1 / 2 + 1e-9
        assert 0 < r["entadv/capped_frac"] < 1 and 0.45 <= r["entropy/kept_frac"] < 0.6
        assert math.isfinite(r["losses/policy_loss"]) and r["losses/grad_norm"] > 0
