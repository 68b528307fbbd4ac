"""Entropy-based token selection (the 80/20 rule, --top-entropy-quantile) in every method: the selection against TRL
1.16's published definition on 2 real gloo ranks, TRL's micro-batch scope through every script. The global scope's
layout independence: tests/test_selection_layouts.py; the target rule synced with it: tests/test_entreg.py."""

import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch import free_port, read_metrics, run_dir, run_script, script_flags

import grpo_vanilla as gv
from utils import ops, tracking


def bf16_values(n: int, seed: int) -> torch.Tensor:
    """Entropy-like values with many exact ties (bf16-rounded, as a bf16 model's entropies are)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g).mul(3).to(torch.bfloat16).float()


@pytest.mark.parametrize("n", [1, 2, 3, 10, 97, 1000, 4097])
@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 0.999, 1.0])
def test_quantile_is_torch_quantile_bit_for_bit(n, q):
    for x in (torch.randn(n, generator=torch.Generator().manual_seed(n)), bf16_values(n, n)):
        assert torch.equal(ops.quantile(x, q), torch.quantile(x, q)), (n, q)


def test_quantile_beyond_torch_quantiles_limit():
    """torch.quantile refuses more than 2^24 values; ours gives the linear-interpolation quantile there."""
    n = (1 << 24) + 3
    x = torch.rand(n, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError):
        torch.quantile(x, 0.8)
    values = np.sort(x.numpy().astype(np.float64))
    pos = 0.8 * (n - 1)
    expected = values[int(pos)] + (pos - int(pos)) * (values[int(pos) + 1] - values[int(pos)])
    assert ops.quantile(x, 0.8).item() == pytest.approx(expected, abs=1e-6)


def trl_high_entropy_mask(entropies, mask, q):
    """TRL 1.16's rule for top_entropy_quantile (GRPOTrainer.get_high_entropy_mask), stated in our words: every rank's
    response-token entropies are pooled, the threshold is their q-quantile with linear interpolation (torch.quantile),
    and a response token is kept where its entropy is at or above it."""
    pooled = [None] * dist.get_world_size()
    dist.all_gather_object(pooled, entropies[mask].float().tolist())
    everything = torch.tensor([e for part in pooled for e in part])
    return mask & (entropies >= torch.quantile(everything, q)) if everything.numel() else torch.zeros_like(mask)


def _selection_worker(rank, world_size, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for case in range(6):
            g = torch.Generator().manual_seed(100 * case + rank)
            rows, width = (3, 9) if rank == 0 else (2 + case % 2, 5 + case)  # unequal token counts per rank
            lengths = torch.randint(1, width + 1, (rows,), generator=g)
            mask = torch.arange(width)[None, :] < lengths[:, None]
            entropies = torch.rand(rows, width, generator=g).mul(2).to(torch.bfloat16).float()  # ties
            entropies[mask.logical_not()] = 7.0  # padding holds garbage: it must not count
            if case >= 3:
                entropies[mask] = entropies[mask].round()  # few distinct values: the threshold sits on ties
            flat = entropies[mask]  # a micro-batch's response tokens, as the scripts hold them
            top = trl_high_entropy_mask(entropies, mask, 0.8)  # the step's 20% highest-entropy tokens, both ranks
            total = torch.tensor([entropies[top].sum().item(), top.sum().item()], dtype=torch.float64)
            dist.all_reduce(total)
            results[(rank, case, "top20")] = tracking.top_entropy(flat) == pytest.approx((total[0] / total[1]).item())
            for rho in (0.0, 0.2, 1.0):
                ours = gv.entropy_selection({0: flat}, rho)
                trl = trl_high_entropy_mask(entropies, mask, 1 - rho)
                same = torch.equal(ours.kept[0], trl[mask])
                results[(rank, case, rho)] = (same, int(trl.sum()), ours.threshold, flat.numel())
                n_kept = torch.tensor([int(trl.sum())])
                dist.all_reduce(n_kept)
                n_all = torch.tensor([flat.numel()])
                dist.all_reduce(n_all)
                results[(rank, case, rho, "scale")] = ours.scale == pytest.approx(n_all.item() / n_kept.item())
    finally:
        dist.destroy_process_group()


@pytest.mark.launches
def test_selection_equals_trls_published_mask_on_two_ranks():
    """TRL 1.16's top_entropy_quantile on entropies with ties and unequal token counts per rank, rho 0, 0.2, 1: the
    same tokens on each rank (rho 0: the maximum only; rho 1: every token), and the same threshold on both ranks; the
    entropy/top20 metric is the mean entropy of the tokens that mask keeps at rho 0.2."""
    results = mp.Manager().dict()
    mp.spawn(_selection_worker, args=(2, free_port(), results), nprocs=2, join=True)
    for case in range(6):
        for rho in (0.0, 0.2, 1.0):
            (same0, kept0, t0, n0), (same1, kept1, t1, n1) = results[(0, case, rho)], results[(1, case, rho)]
            assert same0 and same1 and t0 == t1, (case, rho)
            assert results[(0, case, rho, "scale")] and results[(1, case, rho, "scale")]
            assert kept0 + kept1 == n0 + n1 if rho == 1.0 else 1 <= kept0 + kept1 < n0 + n1, (case, rho)
        assert results[(0, case, "top20")] and results[(1, case, "top20")], case


# ---- end to end: real scripts, DeepSpeed on gloo ----
# 8 prompts x 4 samples, 2 mini-batches of 16 sequences (the layouts: tests/test_selection_layouts.py)
SELECT = {"total-steps": 1, "num-prompts-per-step": 8, "group-size": 4, "num-mini-batches": 2}
METHODS = {
    "grpo_vanilla.py": {"top-entropy-quantile": 0.2},
    "grpo_aent.py": {"top-entropy-quantile": 0.2, "entropy-mask-norm": "kept", "entropy-coef-warmup": 0},
    "grpo_klcov.py": {"top-entropy-quantile": 0.3, "kl-cov-ratio": 0.05},
    "grpo_clipcov.py": {"top-entropy-quantile": 0.2, "clip-cov-ratio": 0.05, "clip-cov-lb": 0.0},
}


@pytest.mark.launches
@pytest.mark.parametrize("script", list(METHODS))
def test_microbatch_scope_selects_per_micro_batch_from_the_current_entropies(testbed, tmp_path, script):
    """TRL's scope, 2 ranks x 2 micro-batches per mini-batch: one threshold per micro-batch (of both ranks), from the
    training forward's entropies; vanilla at one update per step, where the training forward is on-policy."""
    flags = {
        **SELECT,
        **METHODS[script],
        "entropy-mask-scope": "microbatch",
        "micro-batch-size": 4,
        "no-use-vllm": True,
    }
    if script == "grpo_vanilla.py":
        flags["num-mini-batches"] = 1  # one on-policy update: the training forward is the only forward
    run_script(script, script_flags(testbed, **flags), tmp_path, nproc=2)
    (r,) = read_metrics(run_dir(tmp_path))
    rho = METHODS[script]["top-entropy-quantile"]
    assert rho - 0.01 <= r["entropy/kept_frac"] < rho + 0.05 and r["entropy/kept"] > r["entropy/full"]
    assert r["entropy/mask_threshold"] > 0 and math.isfinite(r["losses/policy_loss"]) and r["losses/grad_norm"] > 0


@pytest.mark.launches
def test_current_entropies_select_as_trls_scope_where_a_mini_batch_is_one_micro_batch(testbed, tmp_path):
    """--entropy-mask-source current: the current policy's entropies, as TRL's scope, which sees the same set where a
    mini-batch is one micro-batch (16 sequences, 1 rank): the same run; the sampling policy's differ after an update."""
    flags = {**SELECT, **METHODS["grpo_vanilla.py"], "micro-batch-size": 16, "no-use-vllm": True, "total-steps": 2}
    rows = {}
    for name, extra in {
        "trl": {"entropy-mask-scope": "microbatch"},
        "current": {"entropy-mask-source": "current"},
        "sampling": {},
    }.items():
        run_script("grpo_vanilla.py", script_flags(testbed, **flags, **extra), tmp_path / name, nproc=0)
        rows[name] = read_metrics(run_dir(tmp_path / name))
    for x, y in zip(rows["trl"], rows["current"]):
        for key in x:
            if not key.startswith(("time/", "charts/tokens_per_second")):
                assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-9), (x["step"], key)
    assert rows["sampling"][0]["entropy/mask_threshold"] != rows["current"][0]["entropy/mask_threshold"]
