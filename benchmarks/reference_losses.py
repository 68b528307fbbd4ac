"""The references' own code for CISPO (verl 0.9.1 compute_policy_loss_cispo; TRL 1.16.0 GRPOTrainer._compute_loss),
CE-GPPO (Kwai-Klear/CE-GPPO 10558fe compute_gppo_loss_general_beta) and Lp-Reg (CarlanLark/Lp-Reg-dev 33b27e2
compute_policy_loss_lp_reg, apply_min_p) against grpo_cispo.py, grpo_cegppo.py and grpo_lpreg.py, on the cases of
tests/test_remedies.py (which checks transcriptions). verl and TRL are installed; the authors' functions are taken out
of their files with ast (their modules import their old verl) and run unchanged beside torch, numpy and their verl_F.
`write` (a venv with verl==0.9.1, trl==1.16.0) saves the inputs and the references' loss, gradient with respect to the
[B, T] log-probs, clip fractions, regularised tokens and min-p proxies; `check` (the project's venv) runs ours as the
scripts do (flat valid tokens, token-mean weights), prints the largest differences, exits 1 beyond tolerance.
Setup and result: benchmarks/results/reference_losses.txt.

    python benchmarks/reference_losses.py write /tmp/ref.pt --cegppo-core-algos cegppo_core_algos.py \
        --lpreg-core-algos lpreg_core_algos.py --lpreg-dp-actor lpreg_dp_actor.py --torch-functional lpreg_tf.py
    python benchmarks/reference_losses.py check /tmp/ref.pt
"""

import argparse
import ast
import contextlib
import hashlib
import importlib.metadata
import io
import math
import os
import sys
import tempfile
import textwrap
import types
from collections import defaultdict
from functools import partial
from itertools import product

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CISPO_CLIPS = [(10.0, 0.2), (0.2, 0.28), (1.0, 4.0)]  # verl's example (no lower bound), DAPO's, bounds [0, 5]
TRL_CAPS = [5.0, 1.2, 0.2]  # ScaleRL's 5; 0.2: TRL's epsilon_high left unset (falls back to epsilon)
BETAS = [(0.5, 1.0), (0.75, 1.0), (0.25, 0.6), (1.0, 1.0), (0.0, 0.0)]  # the 1.5B and 7B scripts', their default
DUAL_C = [10.0, 3.0, 0.0]  # 0: no dual clip (ours); theirs asserts c > 1 and gets c = inf
LPREG_CLIPS = [(1.0, 9.0), (0.2, 0.28)]  # the authors' scripts' (A < 0 never clipped); one that clips
RHOS = [0.01, 0.05, 0.3, 1.0]  # 0.01: k < 2 in these micro-batches, their guard regularises nothing
MINP = [(0.02, 1.0), (0.1, 0.7), (0.5, 1.3)]  # (kappa, temperature)
# loss: relative to max(|loss|, token-mean |per-token loss|) (float32 sums whose terms cancel: rounding of the terms)
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL, METRIC_RTOL, METRIC_ATOL = 1e-6, 1e-6, 1e-8, 1e-6, 1e-9


# ---- inputs (tests/test_remedies.py builds its cases with these too) ----
def exact_log(value: float) -> float:
    """A float32 x with exp(x) == float32(value): a ratio exactly on a clip bound."""
    target, x = torch.tensor(value), torch.tensor(math.log(value))
    for _ in range(200):
        if (r := torch.exp(x)) == target:
            return x.item()
        x = torch.nextafter(x, torch.tensor(math.inf if r < target else -math.inf))
    raise ValueError(f"no float32 log of {value}")


def micro_batch(seed: int, bounds=(0.8, 1.2), dual: float = 10.0, B: int = 8, T: int = 12) -> dict:
    """Right-padded [B, T] log-probs, old log-probs, advantages (both signs and 0) and mask: log-ratios over [-3, 3],
    one per row beyond the dual clip, and in rows 0-3 ratios exactly on both bounds."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    old = -4 * torch.rand(B, T, generator=g)
    log_ratio = torch.randn(B, T, generator=g).clamp(-3, 3)
    log_ratio[:, 0] = math.log(dual) + 0.5
    logp = old + log_ratio
    adv = torch.tensor([1.0, -1.0, 0.5, -0.7, 0.0, 2.0, -2.0, 0.3])[:B, None].expand(B, T) * (1 + 0.1 * seed)
    for row in range(4):
        old[row, 1:3] = 0.0
        logp[row, 1], logp[row, 2] = exact_log(bounds[0]), exact_log(bounds[1])
    return dict(logp=logp, old=old, adv=adv.contiguous(), mask=mask, lengths=lengths)


def lpreg_inputs(seed: int, ties: bool) -> dict:
    """Near on-policy log-probs (ties: rounded to 1/4), a proxy log pi_old - log(kept mass) with 10% of the tokens
    outside the min-p set (ours -inf, theirs -1e4 - 3), five tokens far below the proxy (k3 clamped at 10)."""
    c = micro_batch(seed, B=8, T=40)
    g = torch.Generator().manual_seed(100 + seed)
    c["logp"] = c["old"] + 0.3 * torch.randn(c["old"].shape, generator=g)
    if ties:
        c["logp"] = (c["logp"] * 4).round() / 4
    proxy = c["old"] - torch.log(torch.rand(c["old"].shape, generator=g) * 0.5 + 0.5)
    outside = torch.rand(c["old"].shape, generator=g) < 0.1
    c["logp"][1, :5] = proxy[1, :5] - 4.0
    return dict(c, proxy=proxy.masked_fill(outside, -math.inf), proxy_theirs=proxy.masked_fill(outside, -1e4 - 3.0))


# ---- write: the references ----
def authors(path: str, names: list, **namespace) -> types.SimpleNamespace:
    """The named functions of one of the authors' files (a method too, dedented), their text executed unchanged in
    `namespace` (their module's imports), line numbers kept for tracebacks."""
    text = open(path).read()
    lines, defs = text.splitlines(), {}
    for node in ast.walk(ast.parse(text)):  # breadth first: a top-level name before a nested one
        if isinstance(node, ast.FunctionDef):
            defs.setdefault(node.name, node)
    for node in (defs[name] for name in names):
        code = "\n" * (node.lineno - 1) + textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        exec(compile(code, path, "exec"), namespace)
    return types.SimpleNamespace(**namespace)


class Writes(TorchFunctionMode):
    """The indices of every `tensor[index] = value`: Lp-Reg's regularised tokens are those its `pg_losses[batch_idx,
    seq_idx] = ...` writes (the function returns no mask)."""

    def __init__(self):
        super().__init__()
        self.indices = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__setitem__:
            self.indices.append(args[1])
        return func(*args, **(kwargs or {}))


def trl_cispo(cap: float):
    """TRL's _compute_loss on a trainer built without __init__ (no model; glue): the attributes it reads, set as
    __init__ sets them from a real GRPOConfig; the model forward replaced by the given log-probs."""
    from accelerate import Accelerator
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(tempfile.mkdtemp(), loss_type="cispo", epsilon_high=None if cap == 0.2 else cap, use_cpu=True)
    tr = object.__new__(GRPOTrainer)
    tr.args, tr.loss_type, tr.beta, tr.epsilon_low = args, args.loss_type, args.beta, args.epsilon
    tr.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    for name in ("importance_sampling_level", "off_policy_mask_threshold", "top_entropy_quantile", "use_vllm"):
        setattr(tr, name, getattr(args, name))
    tr.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    tr.aux_loss_enabled = tr._entropy_bonus_enabled = tr.use_adaptive_entropy = False
    tr.accelerator, tr.model, tr.current_gradient_accumulation_steps = Accelerator(cpu=True), torch.nn.Linear(1, 1), 1

    def loss(c, logp):
        tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        tr._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
        ids = torch.zeros(logp.shape, dtype=torch.long)
        inputs = dict(
            prompt_ids=ids[:, :1], prompt_mask=ids[:, :1] + 1, completion_ids=ids, old_per_token_logps=c["old"]
        )
        inputs.update(completion_mask=c["mask"].long(), advantages=c["adv"][:, 0], num_items_in_batch=c["mask"].sum())
        return tr._compute_loss(tr.model, inputs), {"cispo_clip_ratio": tr._metrics["train"]["cispo_clip_ratio"][-1]}

    return loss


def write(a) -> None:
    from verl.trainer.ppo.core_algos import compute_policy_loss_cispo
    from verl.workers.config import ActorConfig, PolicyLossConfig

    if a.torch_functional:  # their verl_F: masked_mean (the same text in both forks), logprobs_from_logits_v2
        names = ["masked_mean", "logprobs_from_logits_v2"]
        verl_F = authors(a.torch_functional, names, torch=torch, F=torch.nn.functional)
    else:  # verl 0.9.1's: the same computations
        import verl.utils.torch_functional as verl_F
    ns = dict(torch=torch, np=np, verl_F=verl_F)
    gppo = authors(a.cegppo_core_algos, ["agg_loss", "compute_gppo_loss_general_beta"], **ns)
    lpreg = authors(a.lpreg_core_algos, ["agg_loss", "kl_penalty", "compute_policy_loss_lp_reg"], **ns)
    cases = []

    def record(family, params, c, fn):  # fn(c, logp leaf) -> (loss, metrics[, regularised [B, T]])
        logp = c["logp"].detach().clone().requires_grad_()
        with contextlib.redirect_stdout(io.StringIO()):  # Lp-Reg's dev_debug prints
            loss, metrics, *regularised = fn(c, logp)
        (grad,) = torch.autograd.grad(loss, logp)
        metrics = {k: float(v) for k, v in metrics.items()}
        cases.append(dict(c, family=family, params=params, ref_loss=loss.detach(), ref_grad=grad, ref_metrics=metrics))
        cases[-1]["ref_regularised"] = regularised[0] if regularised else None

    def verl(c, logp, cfg):
        loss, metrics = compute_policy_loss_cispo(c["old"], logp, c["adv"], c["mask"], "token-mean", cfg)
        return loss, {"pg_clipfrac": metrics["actor/pg_clipfrac"]}

    def cegppo(c, logp, beta1, beta2, dual):  # dual 0: no dual clip; theirs asserts c > 1: c = inf
        args = c["old"], logp, c["adv"], c["mask"], None, 0.2, 0.2, dual or math.inf, "token-mean", beta1, beta2
        loss, clipfrac, _, lower = gppo.compute_gppo_loss_general_beta(*args)
        return loss, {"pg_clipfrac": clipfrac, "pg_clipfrac_lower": lower}

    def lp_reg(c, logp, rho, low, high):
        args = c["old"], logp, c["proxy_theirs"], c["proxy_theirs"], c["adv"], c["mask"], None, low, high
        with Writes() as writes:
            loss, clipfrac, _ = lpreg.compute_policy_loss_lp_reg(*args, "token-mean", 0, rho, 1.0, "low_var_kl")
        regularised = torch.zeros_like(c["mask"])
        for index in writes.indices:
            regularised[index] = True
        return loss, {"pg_clipfrac": clipfrac}, regularised

    for seed in range(3):
        for low, high in CISPO_CLIPS:
            c = micro_batch(seed, bounds=(max(1 - low, 0.5), 1 + high))
            c["logp"][5, 3] = c["old"][5, 3] + 25.0  # beyond verl's +-20 log-ratio clamp
            cfg = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=low)
            cfg = ActorConfig(**cfg, clip_ratio_high=high, policy_loss=PolicyLossConfig(loss_mode="cispo"))
            record("verl cispo", dict(seed=seed, low=low, high=high), c, partial(verl, cfg=cfg))
        for cap in TRL_CAPS:
            c = micro_batch(seed, bounds=(0.5, cap if cap > 1 else 1.2))
            c["logp"][5, 3], c["logp"][6, 4] = c["old"][5, 3] + 25.0, c["old"][6, 4] - 25.0  # no clamp, no floor
            record("trl cispo", dict(seed=seed, cap=cap), c, trl_cispo(cap))
        for (beta1, beta2), dual in product(BETAS, DUAL_C):
            p = dict(beta1=beta1, beta2=beta2, dual=dual)
            record("ce-gppo", dict(seed=seed, **p), micro_batch(seed, dual=dual or 10.0), partial(cegppo, **p))
    for seed, rho, ties, (low, high) in product(range(4), RHOS, (0, 1), LPREG_CLIPS):
        p = dict(rho=rho, low=low, high=high)
        record("lp-reg", dict(seed=seed, ties=ties, **p), lpreg_inputs(seed, ties), partial(lp_reg, **p))
    minp = []
    if a.lpreg_dp_actor:
        apply_min_p = authors(a.lpreg_dp_actor, ["apply_min_p"], torch=torch).apply_min_p
        for kappa, temperature in MINP:
            g = torch.Generator().manual_seed(0)
            logits = 3 * torch.randn(64, 50, generator=g)
            labels = torch.randint(0, 50, (64,), generator=g)
            labels[:8] = logits[:8].argmax(-1)  # surely kept
            with contextlib.redirect_stdout(io.StringIO()):
                filtered = apply_min_p(None, logits, kappa, False, "minp")  # self: unused
            # then as their _forward_micro_batch: divided in place by the temperature, logprobs_from_logits (its v2
            # without flash-attn's cross-entropy kernel)
            proxy = verl_F.logprobs_from_logits_v2(filtered.div_(temperature), labels)
            minp.append(dict(kappa=kappa, temperature=temperature, logits=logits, labels=labels, ref_proxy=proxy))
    paths = [a.cegppo_core_algos, a.lpreg_core_algos, a.lpreg_dp_actor, a.torch_functional]
    sources = {os.path.basename(p): hashlib.sha256(open(p, "rb").read()).hexdigest()[:16] for p in paths if p}
    versions = {p: importlib.metadata.version(p) for p in ("torch", "verl", "trl", "transformers", "accelerate")}
    torch.save(dict(cases=cases, minp=minp, sources=sources, versions=versions), a.path)
    print(f"{len(cases)} loss cases, {len(minp)} min-p cases -> {a.path}; {versions}; sha256[:16] {sources}")


# ---- check: ours ----
def check(a) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, ROOT)
    import grpo_cegppo as ce
    import grpo_cispo as ci
    import grpo_lpreg as lp
    import grpo_vanilla as gv
    from utils import tracking

    def ours(c, logp, w):
        """Our per-token loss on the flat valid tokens, as the script computes it; the clip fractions as the reference
        counts them (from our masks, token-mean weights w); Lp-Reg's selected tokens."""
        p, mask = c["params"], c["mask"]
        old, adv, family = c["old"][mask], c["adv"][mask], c["family"]
        frac = lambda m: (m * w).sum().item()  # noqa: E731
        if family == "verl cispo":
            loss, clipped = ci.cispo_loss(logp, old, adv, p["low"], p["high"])
            return loss, {"pg_clipfrac": frac(clipped)}, None
        if family == "trl cispo":  # TRL's metric: the capped tokens with A > 0 only (ours logs every capped one)
            loss, clipped = ci.cispo_loss(logp, old, adv, 0.2, 0.2, p["cap"])
            return loss, {"cispo_clip_ratio": frac(clipped & (adv > 0))}, None
        if family == "ce-gppo":  # their pg_clipfrac: the bounded branches, our clip_frac_low_neg + clip_frac_high_pos
            loss, dual = ce.gppo_loss(logp, old, adv, 0.2, 0.2, p["dual"], p["beta1"], p["beta2"])
            sums = dict.fromkeys(tracking.CLIP_SUMS, 0.0)
            tracking.clip_sums(sums, logp.detach() - old, adv, w, 0.2, 0.2)
            bounded = (sums["clip_frac_low_neg"] + sums["clip_frac_high_pos"]).item()
            return loss, {"pg_clipfrac": bounded, "pg_clipfrac_lower": frac(dual)}, None
        proxy = c["proxy"][mask]  # Lp-Reg, as the script's --lpreg-scope microbatch (the reference's scope and guard)
        loss, clipped = gv.ppo_clip_loss(logp, old, adv, p["low"], p["high"])
        selected = lp.lpreg_select(logp, proxy, adv, p["rho"], min_count=2)
        policy, penalty, _ = lp.lpreg_loss(loss, logp, old, adv, proxy, selected, 1.0)
        return policy + penalty, {"pg_clipfrac": frac(clipped)}, selected

    data, rows, failures = torch.load(a.path), defaultdict(list), []
    print(f"references: {data['versions']}; files sha256[:16] {data['sources']}")
    for c in data["cases"]:
        logp, mask, n = c["logp"].clone().requires_grad_(), c["mask"], c["lengths"]
        w = gv.token_weights(n, "token-mean", int(mask.sum()), len(n), mask.shape[1])
        token_loss, metrics, selected = ours(c, logp[mask], w)
        loss = (token_loss * w).sum()
        (grad,) = torch.autograd.grad(loss, logp)
        ref, scale = c["ref_loss"].item(), max(abs(c["ref_loss"].item()), (token_loss.abs() * w).sum().item())
        d = dict(loss=abs(loss.item() - ref), grad=(grad - c["ref_grad"]).abs().max().item())
        d["rel"], d["metric"] = d["loss"] / scale, max(abs(metrics[k] - v) for k, v in c["ref_metrics"].items())
        d["mismatched"] = 0 if selected is None else int((selected != c["ref_regularised"][mask]).sum())
        d["regularised"] = 0 if selected is None else int(c["ref_regularised"].sum())
        rows[c["family"]].append(d)
        close = [
            math.isclose(metrics[k], v, rel_tol=METRIC_RTOL, abs_tol=METRIC_ATOL) for k, v in c["ref_metrics"].items()
        ]
        close += [d["rel"] <= LOSS_RTOL, torch.allclose(grad, c["ref_grad"], GRAD_RTOL, GRAD_ATOL), not d["mismatched"]]
        if not all(close):
            failures.append(f"FAIL {c['family']} {c['params']}: loss {loss.item():.9g} vs {ref:.9g}, {d}, {metrics}")
    for family, ds in rows.items():
        top = {k: (sum if k in ("mismatched", "regularised") else max)(d[k] for d in ds) for k in ds[0]}
        lpreg = f", regularised tokens {top['regularised']}, mismatched {top['mismatched']}" if "lp" in family else ""
        line = f"{family:12s} {len(ds):3d} cases: loss max|d| {top['loss']:.2g} (rel {top['rel']:.2g}), grad max|d| "
        print(line + f"{top['grad']:.2g}, clip fractions max|d| {top['metric']:.2g}{lpreg}")
    d_value, mismatched, kept_total = 0.0, 0, 0
    for m in data["minp"]:
        mine, ref = lp.proxy_logprobs(m["logits"], m["labels"], m["kappa"], m["temperature"]), m["ref_proxy"]
        kept = ref > -1000  # theirs: a logit of -1e4 outside the min-p set; ours: -inf
        wrong, d = int((torch.isinf(mine) == kept).sum()), (mine[kept] - ref[kept]).abs()
        d_value, mismatched, kept_total = max(d_value, d.max().item()), mismatched + wrong, kept_total + int(kept.sum())
        if (d > LOSS_RTOL * ref[kept].abs()).any() or wrong:
            failures.append(f"FAIL min-p kappa {m['kappa']} T {m['temperature']}: max|d| {d.max():.3g}, {wrong} sets")
    if data["minp"]:
        line = (
            f"lp-reg min-p {len(data['minp']):3d} cases: proxy log-prob max|d| {d_value:.2g} on the {kept_total} kept"
        )
        print(line + f" tokens of {sum(len(m['labels']) for m in data['minp'])}, kept/outside mismatched {mismatched}")
    tolerance = f"loss rel {LOSS_RTOL} (of max(|loss|, token-mean |token loss|)), grad rel {GRAD_RTOL} abs "
    tolerance += f"{GRAD_ATOL}, clip fractions rel {METRIC_RTOL} abs {METRIC_ATOL}, the same tokens"
    print("\n".join(failures) or f"all within tolerance: {tolerance}")
    return 1 if failures else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("write", help="run the references (verl==0.9.1, trl==1.16.0 installed), save to PATH")
    w.add_argument("path")
    w.add_argument("--cegppo-core-algos", required=True, help="CE-GPPO 10558fe verl/trainer/ppo/core_algos.py")
    w.add_argument("--lpreg-core-algos", required=True, help="Lp-Reg-dev 33b27e2 verl/trainer/ppo/core_algos.py")
    w.add_argument("--lpreg-dp-actor", help="Lp-Reg-dev 33b27e2 verl/workers/actor/dp_actor.py (the min-p proxy)")
    w.add_argument("--torch-functional", help="either fork's verl/utils/torch_functional.py (default: verl 0.9.1's)")
    sub.add_parser("check", help="compare ours with the references saved in PATH").add_argument("path")
    args = parser.parse_args()
    sys.exit(write(args) if args.mode == "write" else check(args))
