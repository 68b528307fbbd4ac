"""The rollout correction's modes (utils/rollout_correction.py), the KL estimators (utils/kl.py) and the plain entropy
bonus (grpo_entreg.py's default: --clamp-p 0 --coef-rule constant) against the frameworks' own code, run at run time:
- TRL 1.16.0: the importance-sampling block of GRPOTrainer._generate_and_score_completions (its four
  vllm_importance_sampling_mode values, with and without vllm_importance_sampling_clip_min), and the statements of
  GRPOTrainer._compute_loss from the log-ratio to the KL term (k3, use_bias_correction_kl off and on), each taken out of
  the installed grpo_trainer.py with ast and executed unchanged;
- verl 0.9.1: rollout_corr_helper.compute_rollout_correction_weights (rollout_is token / sequence, a single threshold
  (TIS) or "low_cap" (IcePop)), compute_rollout_rejection_mask (seq_mean_k1, the geometric mean), core_algos.kl_penalty
  (k1, k2, low_var_kl, k1+, k3+), and the plain entropy bonus as workers/utils/losses.ppo_loss makes it:
  entropy_coeff x agg_loss(entropy_from_logits(logits)) (token-mean, seq-mean-token-mean);
- Pass@k Training's advantage (grpo_passk.py): the authors' compute_advantage and calc_adv (RUCAIBox/Passk_Training
  c3ba575 code/passk_adv.py, its text executed unchanged beside numpy and scipy's comb; `--passk-adv FILE`) on every
  count of correct responses in groups of 4, 8 and 16, k 1, 2, 4 and the group size.
Values (and gradients with respect to the log-probs or logits) per valid token, and the masked sets, on micro-batches
of 8 responses of 1 to 16 tokens, log-ratios 0.4 N(0, 1) with spikes of +-1.5 and one of +-25 (beyond the +-20 clamp of
ours and verl's; TRL clamps nothing, so there its tiny weights differ below 1e-8).
`write` (a venv with verl==0.9.1 and trl==1.16.0) saves the inputs and the references' outputs; `check` (the project's
venv) runs ours on them, prints the largest differences and exits 1 beyond tolerance. Result:
benchmarks/results/reference_corrections.txt.

    python -m benchmarks.experiments.reference_corrections write /tmp/corr.pt --passk-adv passk_adv.py
    python -m benchmarks.experiments.reference_corrections check /tmp/corr.pt
"""

import argparse
import ast
import contextlib
import inspect
import io
import math
import sys
import types
from collections import defaultdict

import torch

BOUNDS = [(0.0, 2.0), (0.0, 1.2), (0.5, 2.0), (0.8, 1.25)]  # (low, cap); low 0: no lower bound
TRL_MODES = {"token-truncate": "token_truncate", "token-mask": "token_mask"}
TRL_MODES |= {"sequence-truncate": "sequence_truncate", "sequence-mask": "sequence_mask"}
VERL_KL = {"k1": "k1", "k2": "k2", "k3": "low_var_kl", "k1+": "k1+", "k3+": "k3+"}
SEEDS = range(3)
WEIGHT_RTOL, WEIGHT_ATOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-8, 1e-5, 1e-7


def micro_batch(seed: int, B: int = 8, T: int = 16) -> dict:
    """Responses of 1 to T tokens (right-padded), the sampler's and the trainer's log-probs, the reference's."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    sampler = -torch.rand(B, T, generator=g) * 3
    log_ratio = 0.4 * torch.randn(B, T, generator=g)
    log_ratio[1, 0], log_ratio[2, 0], log_ratio[3, 0] = 1.5, -1.5, 25.0 if seed == 0 else -25.0
    ref = sampler + 0.5 * torch.randn(B, T, generator=g)
    upstream = torch.rand(B, T, generator=g)
    return dict(lengths=lengths, mask=mask, sampler=sampler, old=sampler + log_ratio, ref=ref, upstream=upstream)


def statements(source_file: str, function: str, first: str, last: str, containing: str = "") -> types.CodeType:
    """The statements of a block of `function` from the one whose source starts with `first` (and holds `containing`)
    to the next one starting with `last`, compiled as they stand in the file."""
    tree = ast.parse(open(source_file).read())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    bodies = [s.body for s in ast.walk(fn) if isinstance(getattr(s, "body", None), list)]

    def match(x):
        return ast.unparse(x).startswith(first) and containing in ast.unparse(x)

    body = next(b for b in bodies if any(match(x) for x in b))
    start = next(i for i, s in enumerate(body) if match(s))
    end = next(i for i, s in enumerate(body) if i >= start and ast.unparse(s).startswith(last))
    return compile(ast.Module(body=body[start : end + 1], type_ignores=[]), source_file, "exec")


def passk_cases(path: str) -> list:
    """The authors' Pass@k advantage (compute_advantage over calc_adv, as their verl hook calls it: a reward on each
    response's last token, the group by `index`) on every count of correct responses, groups of 4, 8 and 16."""
    import numpy as np
    from scipy.special import comb

    from benchmarks.experiments.reference_losses import authors

    theirs = authors(path, ["calc_adv", "compute_advantage"], np=np, torch=torch, comb=comb, defaultdict=defaultdict)
    cases = []
    for G in (4, 8, 16):
        rewards = torch.tensor([[float(i < c) for i in range(G)] for c in range(G + 1)])  # one group per count
        lengths = torch.randint(1, 9, (rewards.numel(),), generator=torch.Generator().manual_seed(G))
        mask = (torch.arange(8)[None, :] < lengths[:, None]).float()
        scores = torch.zeros(rewards.numel(), 8).scatter(1, (lengths - 1)[:, None], rewards.flatten()[:, None])
        index = [f"prompt{p}" for p in range(G + 1) for _ in range(G)]
        for k in sorted({1, 2, 4, G}):
            with contextlib.redirect_stdout(io.StringIO()):  # their function prints each group's indices
                adv, _ = theirs.compute_advantage(scores.clone(), mask, index, k)
            cases.append(dict(G=G, k=k, rewards=rewards, advantages=adv[:, 0].reshape(G + 1, G)))
    return cases


def write(path: str, passk_adv: str | None) -> None:
    import trl.trainer.grpo_trainer as grpo
    from verl.trainer.ppo import core_algos, rollout_corr_helper
    from verl.utils import torch_functional as verl_F

    source = inspect.getsourcefile(grpo)
    first = "if self.use_vllm and self.vllm_importance_sampling_correction:"  # the block that makes the ratio
    trl_is = statements(source, "_generate_and_score_completions", first, first, "vllm_importance_sampling_ratio = ")
    trl_kl = statements(source, "_compute_loss", "log_ratio = per_token_logps - old_per_token_logps", "if self.beta")
    cases = []
    for seed in SEEDS:
        c = micro_batch(seed)
        mask, old, sampler = c["mask"], c["old"], c["sampler"]
        for low, cap in BOUNDS:
            for ours, mode in TRL_MODES.items():  # TRL's block, as it stands
                trainer = types.SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True)
                trainer.vllm_importance_sampling_mode = mode
                trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = low or None, cap
                ns = dict(self=trainer, completion_mask=mask.int(), tool_mask=None, torch=torch, math=math)
                ns.update(old_per_token_logps=old, sampling_per_token_logps=sampler)
                exec(trl_is, ns)
                weights = ns["vllm_importance_sampling_ratio"].expand_as(old)
                cases.append(dict(seed=seed, ref="trl", mode=ours, low=low, cap=cap, weights=weights))
            levels = {"token-truncate": "token", "sequence-truncate": "sequence"} if not low else {}
            levels |= {"token-mask": "token", "sequence-mask": "sequence"} if low else {}
            for ours, level in levels.items():  # verl: TIS (a single threshold) or IcePop ("low_cap")
                threshold = f"{low}_{cap}" if low else cap
                weights, _ = rollout_corr_helper.compute_rollout_correction_weights(
                    old - sampler, mask.float(), level, threshold
                )
                cases.append(dict(seed=seed, ref="verl", mode=ours, low=low, cap=cap, weights=weights))
            if low:  # verl's rejection on the geometric mean: seq_mean_k1 bounds exp(-mean log r), ours its inverse
                kept, _ = rollout_corr_helper.compute_rollout_rejection_mask(
                    old - sampler, mask.float(), rollout_rs="seq_mean_k1", rollout_rs_threshold=f"{1 / cap}_{1 / low}"
                )
                cases.append(dict(seed=seed, ref="verl", mode="geo-mask", low=low, cap=cap, weights=kept))
        for ours, name in VERL_KL.items():
            logp = old.clone().requires_grad_()
            kl = core_algos.kl_penalty(logp, c["ref"], name)
            (kl * c["upstream"]).sum().backward()
            cases.append(dict(seed=seed, ref="verl", estimator=ours, value=kl.detach(), grad=logp.grad))
        for ours, correction in (("k3", False), ("k3-is", True)):  # the trainer's log-probs one update on: pi != pi_old
            logp = (old + 0.1 * c["upstream"]).requires_grad_()
            trainer = types.SimpleNamespace(
                beta=0.04, importance_sampling_level="token", off_policy_mask_threshold=None
            )
            trainer.args = types.SimpleNamespace(use_bias_correction_kl=correction)
            ns = dict(self=trainer, per_token_logps=logp, old_per_token_logps=old, mask=mask.float(), torch=torch)
            ns["inputs"] = {"ref_per_token_logps": c["ref"]}
            exec(trl_kl, ns)
            (ns["per_token_kl"] * c["upstream"]).sum().backward()
            cases.append(dict(seed=seed, ref="trl", estimator=ours, value=ns["per_token_kl"].detach(), grad=logp.grad))
        logits = (2 * torch.randn(8, 16, 50, generator=torch.Generator().manual_seed(seed))).requires_grad_()
        for agg in ("token-mean", "seq-mean-token-mean"):  # ppo_loss: policy_loss -= entropy_coeff * agg_loss(entropy)
            x = logits.detach().clone().requires_grad_()
            entropy = verl_F.entropy_from_logits(x)
            info = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=8)
            bonus = -0.01 * core_algos.agg_loss(entropy, mask, agg, **info)
            bonus.backward()
            cases.append(
                dict(seed=seed, ref="verl", bonus=agg, logits=logits.detach(), value=bonus.detach(), grad=x.grad)
            )
    passk = passk_cases(passk_adv) if passk_adv else []
    torch.save({"inputs": {s: micro_batch(s) for s in SEEDS}, "cases": cases, "passk": passk}, path)
    print(f"{len(cases)} cases written to {path}")


def check(path: str) -> int:
    import grpo_entreg as ge
    from utils.kl import kl_penalty
    from utils.rollout_correction import rollout_weights

    data = torch.load(path, weights_only=False)
    worst, failures, masked_tokens, unclamped = {}, [], {}, 0
    for c in data["cases"]:
        x = data["inputs"][c["seed"]]
        mask, lengths = x["mask"], x["lengths"]
        if "mode" in c:
            family = f"{c['ref']} {c['mode']}"
            weights, _, masked = rollout_weights(
                x["old"][mask], x["sampler"][mask], lengths, c["mode"], c["low"], c["cap"]
            )
            theirs = c["weights"][mask].float()
            diff = (weights - theirs).abs().max().item()
            ok = torch.allclose(weights, theirs, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL) and (
                "mask" not in c["mode"] or torch.equal(masked, theirs == 0)
            )
            masked_tokens[family] = masked_tokens.get(family, 0) + int(masked.sum())
        elif "estimator" in c:
            family = f"{c['ref']} kl {c['estimator']}"
            logp = (x["old"] if c["ref"] == "verl" else x["old"] + 0.1 * x["upstream"]).clone().requires_grad_()
            kl = kl_penalty(logp, x["ref"], x["old"], c["estimator"])
            (kl * x["upstream"]).sum().backward()
            d = (logp - x["ref"]).detach()
            # TRL clamps neither d nor k3 (verl and ours: +-20, +-10): compared where the clamps are idle
            idle = mask & ((d.abs() <= 20) & (torch.exp(-d) + d - 1 <= 10) if c["ref"] == "trl" else True)
            unclamped += int((mask & ~idle).sum())
            pairs = ((kl.detach()[idle], c["value"][idle]), (logp.grad[idle], c["grad"][idle]))
            diff = max((a - b).abs().max().item() for a, b in pairs)
            ok = all(torch.allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL) for a, b in pairs)
        else:  # grpo_entreg.py at --clamp-p 0, a constant 0.01: -coef H aggregated with the script's token weights
            family = f"verl plain entropy bonus {c['bonus']}"
            logits = c["logits"].clone().requires_grad_()
            weights = ge.token_weights(lengths, 1, c["bonus"], int(mask.sum()), len(lengths), mask.shape[1])
            bonus = -0.01 * (ge.clamped_entropy(logits[mask], 0.0) * weights).sum()
            bonus.backward()
            diff = max(abs(bonus.item() - c["value"].item()), (logits.grad - c["grad"]).abs().max().item())
            ok = math.isclose(bonus.item(), c["value"].item(), rel_tol=GRAD_RTOL)
            ok = ok and torch.allclose(logits.grad, c["grad"], rtol=GRAD_RTOL, atol=GRAD_ATOL)
        worst[family] = max(worst.get(family, 0.0), diff)
        if not ok:
            failures.append(f"{family} seed {c['seed']} {c.get('low', '')} {c.get('cap', '')}")
    import grpo_passk as gp

    for c in data["passk"]:
        family = "passk (authors' compute_advantage)"
        ours = gp.passk_advantages(c["rewards"], c["k"])
        worst[family] = max(worst.get(family, 0.0), (ours - c["advantages"]).abs().max().item())
        if not torch.allclose(ours, c["advantages"], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL):
            failures.append(f"{family} G {c['G']} k {c['k']}")
    print(f"{len(data['passk'])} Pass@k cases (groups of 4, 8, 16: every count of correct responses; k 1, 2, 4, G)")
    for family, diff in worst.items():
        masked = f", {masked_tokens[family]} tokens masked" if "mask" in family else ""
        print(f"{family:45s} largest |ours - theirs| {diff:.2e}{masked}")
    print(f"TRL's KL: {unclamped} tokens left out where verl's and our clamps act (TRL clamps nothing)")
    print(f"{len(data['cases'])} cases, {len(failures)} failed" + "".join(f"\n  {f}" for f in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["write", "check"])
    parser.add_argument("path")
    parser.add_argument("--passk-adv", help="write: the authors' code/passk_adv.py (RUCAIBox/Passk_Training c3ba575)")
    a = parser.parse_args()
    sys.exit(write(a.path, a.passk_adv) if a.command == "write" else check(a.path))
