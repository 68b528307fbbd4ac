"""The references' own code for CISPO (verl 0.9.1 compute_policy_loss_cispo; TRL 1.16.0 GRPOTrainer._compute_loss),
CE-GPPO (Kwai-Klear/CE-GPPO 10558fe compute_gppo_loss_general_beta) and Lp-Reg (CarlanLark/Lp-Reg-dev 33b27e2
compute_policy_loss_lp_reg, apply_min_p) against grpo_cispo.py, grpo_cegppo.py and grpo_lpreg.py, on the cases of
tests/test_remedies.py (which checks transcriptions); and for SAPO (verl's registered "sapo" loss; TRL's _compute_loss,
loss_type "sapo"), GSPO (verl's registered "gspo" loss, token-mean and seq-mean-token-mean; TRL's _compute_loss,
importance_sampling_level "sequence", loss_type "grpo") and W-REINFORCE (TianHongZXY/RLVR-Decomposed a5d4e7c
compute_psr_nsr_outcome_advantage, advantage "weighted", and its compute_policy_loss) against grpo_sapo.py,
grpo_gspo.py (level "token" against verl, "sequence" against TRL) and grpo_wreinforce.py (tests/test_loss_variants.py
states their formulas). verl and TRL are installed; the authors' functions are taken out of their files with ast (their
modules import their old verl) and run unchanged beside torch, numpy and their verl_F.
`write` (a venv with verl==0.9.1, trl==1.16.0) saves the inputs and the references' loss, gradient with respect to the
[B, T] log-probs, clip fractions, regularised tokens, min-p proxies and W-REINFORCE advantages; `check` (the project's
venv) runs ours as the scripts do (flat valid tokens; each script's token_weights, grpo_vanilla's text: token-mean,
SAPO seq-mean-token-mean, GSPO verl's mode or TRL's seq-mean-token-mean), prints the largest differences, exits 1
beyond tolerance. GSPO on micro-batches, near on policy (log-ratios 1e-3 N(0, 1): clipped and unclipped sequences at
eps 3e-4 / 4e-4) and with sequence log-ratios of +-12 (verl's GSPO-token clamps log s at 10, TRL does not).
Also: log-ratios of +-25 (CE-GPPO: checked; where A < 0 meets r = e^25 unclamped, CE-GPPO without dual clip and
Lp-Reg: our +-20 clamp, a documented deviation, printed, never failed; SAPO, clamped +-20 by verl and ours, not by
TRL: checked, the differences printed by token); TRL's optimizer steps when a generation batch is spread over 4
mini-batches (GRPOTrainer.training_step through transformers' Trainer.training_step: checked against ours times
spg N_step / (ga N_gen)); the per-token weights of an optimizer step under verl 0.9.1 (checked equal to our --loss-agg
modes) and CE-GPPO's fork (printed) on mini-batches laid out as its 1.5B script lays them.
Setup and result: benchmarks/results/reference_losses.txt. The rollout correction's modes, the KL estimators and the
plain entropy bonus against TRL's and verl's code: reference_corrections.py beside this file, the same write / check.

    python -m benchmarks.experiments.reference_losses write /tmp/ref.pt --cegppo-core-algos cegppo_core_algos.py \
        --lpreg-core-algos lpreg_core_algos.py --lpreg-dp-actor lpreg_dp_actor.py --torch-functional lpreg_tf.py \
        --cegppo-seqlen-balancing cegppo_seqlen_balancing.py --wr-core-algos wr_core_algos.py \
        --wr-torch-functional wr_torch_functional.py
    python -m benchmarks.experiments.reference_losses check /tmp/ref.pt
"""

import argparse
import ast
import contextlib
import hashlib
import heapq
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

CISPO_CLIPS = [(10.0, 0.2), (0.2, 0.28), (1.0, 4.0)]  # verl's example (no lower bound), DAPO's, bounds [0, 5]
TRL_CAPS = [5.0, 1.2, 0.2]  # ScaleRL's 5; 0.2: TRL's epsilon_high left unset (falls back to epsilon)
BETAS = [(0.5, 1.0), (0.75, 1.0), (0.25, 0.6), (1.0, 1.0), (0.0, 0.0)]  # the 1.5B and 7B scripts', their default
DUAL_C = [10.0, 3.0, 0.0]  # 0: no dual clip (ours); theirs asserts c > 1 and gets c = inf
LPREG_CLIPS = [(1.0, 9.0), (0.2, 0.28)]  # the authors' scripts' (A < 0 never clipped); one that clips
RHOS = [0.01, 0.05, 0.3, 1.0]  # 0.01: k < 2 in these micro-batches, their guard regularises nothing
MINP = [(0.02, 1.0), (0.1, 0.7), (0.5, 1.3)]  # (kappa, temperature)
# log-ratios beyond the +-20 clamp of our losses (and of verl's PPO loss), the references' loss unclamped: (row, column,
# log r) in micro_batch's rows 5 (A > 0) and 6 (A < 0); the last one, A < 0 and r = e^25, only where a dual clip caps it
BEYOND = [(5, 1, 25.0), (5, 2, -25.0), (6, 1, -25.0), (6, 2, 25.0)]
SAPO_TAUS = [(1.0, 1.05), (0.5, 2.0), (1.0, 1.0)]  # (tau_pos, tau_neg): the paper's (verl's and TRL's defaults)
GSPO_CLIPS = [(3e-4, 4e-4), (0.2, 0.2)]  # (eps_low, eps_high): the paper's, and PPO's usual
NEAR = 1e-3  # near on policy: log-ratios NEAR N(0, 1), sequence ratios about 1 +- 3e-4 (some clipped at 3e-4, some not)
WR_LAMBDAS = [0.1, 0.0, 1.0]  # positive_advantage_weight: the paper's W-REINFORCE, NSR's weights, both 1
TRL_STEPS = 4, [1, 2, 4]  # TRL: steps_per_generation; gradient_accumulation_steps (1: each mini-batch its own update)
# CE-GPPO's 1.5B script: 16 prompts x 8 responses a mini-batch on 16 x 8 GPUs / sp 4 = 32 data-parallel ranks: 4
# sequences a rank; dynamic bsz, (4096 + 16384) / 4 tokens a GPU x sp 4 = 20480 tokens (prompt + response) a micro-batch
CEGPPO_1_5B = dict(ranks=32, seqs=4, max_token_len=20480, max_prompt=4096, max_response=16384)
# (name, seed, response lengths uniform in [low, high], share truncated at 16384): 4, 4, 3, 2, 1 micro-batches a rank
LAYOUTS = [("mixed", 0, 200, 16384, 0.25), ("mixed", 1, 200, 16384, 0.25), ("up to 14000", 2, 500, 14000, 0.0)]
LAYOUTS += [("up to 8000", 2, 200, 8000, 0.0), ("up to 4000", 3, 200, 4000, 0.0)]
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


def near_policy(seed: int) -> dict:
    """micro_batch(seed) with log-probs near the old ones: log-ratios NEAR N(0, 1) on every token."""
    c = micro_batch(seed)
    g = torch.Generator().manual_seed(200 + seed)
    c["logp"] = c["old"] + NEAR * torch.randn(c["old"].shape, generator=g)
    return c


def far_policy(seed: int) -> dict:
    """micro_batch(seed) with sequence log-ratios beyond verl's GSPO clamp (log s <= 10): every token of rows 5 (A > 0)
    and 6 (A < 0) at log r = +12, of row 2 (A > 0) at -12."""
    c = micro_batch(seed)
    for row, value in ((5, 12.0), (6, 12.0), (2, -12.0)):
        c["logp"][row] = c["old"][row] + value
    return c


def outcome_rewards(seed: int, groups: int, G: int = 8) -> torch.Tensor:
    """[groups x G] 0/1 verifier rewards: the first group all wrong, the second all right, the others random."""
    g = torch.Generator().manual_seed(300 + seed)
    rewards = (torch.rand(groups, G, generator=g) < 0.5).float()
    rewards[0], rewards[1] = 0.0, 1.0
    return rewards.flatten()


def last_token_scores(rewards, lengths, T: int) -> torch.Tensor:
    """[B, T] token-level scores: the response's reward on its last token (verl's reward layout), 0 elsewhere."""
    scores = torch.zeros(len(lengths), T)
    scores[torch.arange(len(lengths)), lengths - 1] = rewards
    return scores


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


def trl_trainer(cap: float = 0.2, loss_type: str = "cispo", **config):
    """A GRPOTrainer built without __init__ (no model; glue): the attributes its loss reads, set as __init__ sets them
    from a real GRPOConfig(loss_type=loss_type, epsilon_high=cap (unset where 0.2), **config)."""
    from accelerate import Accelerator
    from trl import GRPOConfig, GRPOTrainer

    epsilon_high = None if cap == 0.2 else cap
    args = GRPOConfig(tempfile.mkdtemp(), loss_type=loss_type, epsilon_high=epsilon_high, use_cpu=True, **config)
    tr = object.__new__(GRPOTrainer)
    tr.args, tr.loss_type, tr.beta, tr.epsilon_low = args, args.loss_type, args.beta, args.epsilon
    tr.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    for name in ("importance_sampling_level", "off_policy_mask_threshold", "top_entropy_quantile", "use_vllm"):
        setattr(tr, name, getattr(args, name))
    tr.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    tr.aux_loss_enabled = tr._entropy_bonus_enabled = tr.use_adaptive_entropy = False
    tr.accelerator, tr.model, tr.current_gradient_accumulation_steps = Accelerator(cpu=True), torch.nn.Linear(1, 1), 1
    return tr


def trl_loss(tr, metrics: tuple = ()):
    """TRL's _compute_loss on the trainer tr, the model forward replaced by the given log-probs; the named metrics it
    logs."""

    def loss(c, logp):
        tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        tr._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
        ids = torch.zeros(logp.shape, dtype=torch.long)
        inputs = dict(
            prompt_ids=ids[:, :1], prompt_mask=ids[:, :1] + 1, completion_ids=ids, old_per_token_logps=c["old"]
        )
        inputs.update(completion_mask=c["mask"].long(), advantages=c["adv"][:, 0], num_items_in_batch=c["mask"].sum())
        return tr._compute_loss(tr.model, inputs), {k: tr._metrics["train"][k][-1] for k in metrics}

    return loss


def trl_cispo(cap: float):
    """TRL's _compute_loss on trl_trainer(cap), loss_type "cispo"."""
    return trl_loss(trl_trainer(cap), ("cispo_clip_ratio",))


def trl_cispo_steps(cap: float, c: dict, seed: int, ga: int, spg: int) -> list:
    """The optimizer steps of TRL on one generation batch c of spg mini-batches, end to end: GRPOTrainer.training_step
    (its _prepare_inputs shuffles the batch, splits it into spg mini-batches and buffers them; generation replaced by
    c), which calls transformers' Trainer.training_step (compute_loss, its gradient-accumulation scaling decision,
    accelerator.backward), ga times a step, as Trainer's loop does (current_gradient_accumulation_steps = ga); the
    forward returns the rows' log-probs (the completion ids carry the row). Per step: its rows, its loss, the gradient
    accumulated on those rows, and the same from TRL's _compute_loss alone on each buffered mini-batch."""
    (B, T), steps = c["logp"].shape, []
    tr = trl_trainer(
        cap, per_device_train_batch_size=B // spg, steps_per_generation=spg, gradient_accumulation_steps=ga
    )
    tr.current_gradient_accumulation_steps, tr.num_iterations, tr.optimizer = ga, tr.args.num_iterations, None
    tr._step, tr._buffered_inputs, tr._current_train_step_time = 0, None, 0.0
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    generation = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long))
    generation.update(completion_ids=torch.arange(B)[:, None].repeat(1, T), completion_mask=c["mask"].long())
    generation.update(old_per_token_logps=c["old"], advantages=c["adv"][:, 0], num_items_in_batch=c["mask"].sum())
    tr._generate_and_score_completions = lambda batch: dict(generation)
    current, rows = {"logp": c["logp"].detach().clone().requires_grad_()}, []

    def forward(model, input_ids, *args, **kwargs):
        rows.append(input_ids[:, -1])
        return current["logp"][rows[-1]], torch.zeros(len(rows[-1]), T), None

    tr._get_per_token_logps_and_entropies = forward
    torch.manual_seed(seed)  # TRL's shuffle of the generation batch
    for _ in range(spg // ga):
        current["logp"].grad, first = None, len(rows)
        loss = sum(tr.training_step(tr.model, {}, None) for _ in range(ga))
        r = torch.cat(rows[first:])
        steps.append(dict(rows=r, loss=loss, grad=current["logp"].grad[r].clone()))
    for k, step in enumerate(steps):  # _compute_loss alone, as trl_cispo, on the step's buffered mini-batches
        current["logp"] = c["logp"].detach().clone().requires_grad_()
        loss = sum(tr._compute_loss(tr.model, inputs) for inputs in tr._buffered_inputs[k * ga : (k + 1) * ga])
        step["compute_loss_grad"] = torch.autograd.grad(loss, current["logp"])[0][step["rows"]]
    return steps


def layout_weights(response, micro: list, loss_fn) -> torch.Tensor:
    """[ranks, seqs] the weight of each token of each response in the step's gradient (the same on all of its tokens):
    loss_fn(loss matrix, mask, micro-batch size) on each rank's micro-batches (lists of its sequences), d / d matrix;
    the ranks' gradients averaged (FSDP)."""
    w = torch.zeros(response.shape, dtype=torch.float64)
    for rank in range(len(response)):
        for idx in micro[rank]:
            mask = torch.arange(int(response[rank, idx].max()))[None] < response[rank, idx][:, None]
            mat = torch.zeros(mask.shape, dtype=torch.float64, requires_grad=True)
            (grad,) = torch.autograd.grad(loss_fn(mat, mask, len(idx)), mat)
            assert torch.equal(grad[mask], grad[:, :1].expand_as(mask)[mask])
            w[rank, idx] = grad[:, 0] / len(response)
    return w


def fork_loss(mat, mask, size: int, agg, n: int, ga: int = 0):
    """CE-GPPO's dp_actor.py update_policy on a micro-batch: its agg_loss (token-mean), times len(micro-batch) /
    ppo_mini_batch_size (per GPU: n) with dynamic bsz, divided by the gradient accumulation ga without."""
    return agg(mat, mask, "token-mean") / ga if ga else agg(mat, mask, "token-mean") * (size / n)


def verl_loss(mat, mask, size: int, agg, mode: str, **global_batch_info):
    """verl 0.9.1's ppo_loss on a micro-batch: agg_loss with the mini-batch's global_batch_info."""
    return agg(mat, mask, mode, **global_batch_info)


def layouts(seqlen_balancing: str, fork_agg_loss, verl_agg_loss) -> list:
    """Each token's weight in an optimizer step (d step loss / d its per-token loss) on the mini-batches of LAYOUTS,
    laid out as CE-GPPO's 1.5B script lays them (CEGPPO_1_5B): CE-GPPO's fork at 10558fe (fork_loss; micro-batches by
    its rearrange_micro_batches: ceil(tokens / budget), the max over ranks, its get_seqlen_balanced_partitions) and
    verl 0.9.1 (verl_loss: dp_size, the mini-batch's token count over ranks, ppo_mini_batch_size x n as
    global_batch_size). The scalings and the layout are this code's, from their text; agg_loss and the partition
    theirs."""
    names = ["ceildiv", "karmarkar_karp", "get_seqlen_balanced_partitions"]
    bal = authors(seqlen_balancing, names, heapq=heapq, List=list, Tuple=tuple)
    R, n, budget, horizon = (CEGPPO_1_5B[k] for k in ("ranks", "seqs", "max_token_len", "max_response"))
    out = []
    for name, seed, low, high, truncated in LAYOUTS:
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(64, 1025, (R, n), generator=g)
        response = torch.randint(low, high + 1, (R, n), generator=g)
        response[torch.rand(R, n, generator=g) < truncated] = horizon
        k = max(bal.ceildiv(int(t), budget) for t in (prompt + response).sum(1))  # all_reduce MAX over ranks
        dynamic = [bal.get_seqlen_balanced_partitions((prompt[r] + response[r]).tolist(), k, False) for r in range(R)]
        schemes = {"fork dynamic bsz": (dynamic, partial(fork_loss, agg=fork_agg_loss, n=n))}
        for mbs in (2, 1):  # without dynamic bsz: ppo_micro_batch_size_per_gpu mbs, mini_batch.split(mbs)
            fixed = [[list(range(i, i + mbs)) for i in range(0, n, mbs)]] * R
            schemes[f"fork micro-batch {mbs}"] = fixed, partial(fork_loss, agg=fork_agg_loss, n=n, ga=n // mbs)
        info = dict(agg=verl_agg_loss, dp_size=R, batch_num_tokens=int(response.sum()), global_batch_size=R * n)
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            schemes[f"verl {mode}"] = dynamic, partial(verl_loss, mode=mode, **info)
        norm = partial(verl_loss, mode="seq-mean-token-sum-norm", loss_scale_factor=horizon, **info)
        schemes["verl seq-mean-token-sum-norm 16384"] = dynamic, norm
        weights = {scheme: layout_weights(response, micro, fn) for scheme, (micro, fn) in schemes.items()}
        out.append(dict(name=name, seed=seed, k=k, prompt=prompt, response=response, micro=dynamic, weights=weights))
    return out


def write(a) -> None:
    from verl.trainer.ppo.core_algos import compute_policy_loss_cispo, get_policy_loss_fn
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

    def beyond(c, tokens):  # log-ratios of +-25 (BEYOND)
        for row, col, value in tokens:
            c["logp"][row, col] = c["old"][row, col] + value
        return c

    for seed, (beta1, beta2), dual in product(range(3), BETAS[:3:2], (10.0, 0.0)):
        p = dict(beta1=beta1, beta2=beta2, dual=dual)  # c off: A < 0 at r = e^25 apart (unclamped -A r there)
        variants = (
            [("ce-gppo |lr| 25", BEYOND)] if dual else [("ce-gppo |lr| 25", BEYOND[:3]), ("ce-gppo lr 25 A<0", BEYOND)]
        )
        for family, tokens in variants:
            record(
                family, dict(seed=seed, **p), beyond(micro_batch(seed, dual=dual or 10.0), tokens), partial(cegppo, **p)
            )
    for seed, rho, (low, high) in product(range(2), RHOS[1:3], LPREG_CLIPS):
        p = dict(rho=rho, low=low, high=high)
        record(
            "lp-reg |lr| 25",
            dict(seed=seed, ties=0, **p),
            beyond(lpreg_inputs(seed, False), BEYOND),
            partial(lp_reg, **p),
        )

    # SAPO and GSPO: verl's registered losses called as its ppo_loss calls them (loss_agg_mode=config.loss_agg_mode;
    # SAPO ignores it and takes seq-mean-token-mean), global_batch_info empty (one rank: agg_loss counts the
    # micro-batch); TRL's _compute_loss with loss_type "sapo" / importance_sampling_level "sequence"
    def verl_registered(c, logp, name, cfg):
        loss, metrics = get_policy_loss_fn(name)(c["old"], logp, c["adv"], c["mask"], cfg.loss_agg_mode, cfg)
        return loss, ({"pg_clipfrac": metrics["actor/pg_clipfrac"]} if name == "gspo" else {})

    def actor(loss_mode, **config):
        base = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
        return ActorConfig(**base, **config, policy_loss=PolicyLossConfig(loss_mode=loss_mode))

    def sapo_cases(family, seeds, tokens, taus):
        for seed, (tau_pos, tau_neg) in product(seeds, taus):
            p = dict(seed=seed, tau_pos=tau_pos, tau_neg=tau_neg, agg="seq-mean-token-mean")
            cfg = actor("sapo", tau_pos=tau_pos, tau_neg=tau_neg)  # loss_agg_mode: the default token-mean
            record(
                "verl " + family, p, beyond(micro_batch(seed), tokens), partial(verl_registered, name="sapo", cfg=cfg)
            )
            tr = trl_trainer(loss_type="sapo", sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg)
            record("trl " + family, p, beyond(micro_batch(seed), tokens), trl_loss(tr))

    sapo_cases("sapo", range(3), [], SAPO_TAUS)
    sapo_cases("sapo |lr| 25", range(2), BEYOND, SAPO_TAUS[:2])
    trl_clips = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
    trl_clips += ("clip_ratio/low_min", "clip_ratio/high_max")
    kinds = [("", micro_batch, 3), (" near", near_policy, 3), (" lr 12", far_policy, 2)]  # (family, inputs, seeds)
    for (suffix, inputs, seeds), (low, high), seed in product(kinds, GSPO_CLIPS, range(3)):
        if seed >= seeds:
            continue
        for agg in ("seq-mean-token-mean", "token-mean"):
            cfg = actor("gspo", clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=agg)
            p = dict(seed=seed, low=low, high=high, agg=agg)
            record("verl gspo" + suffix, p, inputs(seed), partial(verl_registered, name="gspo", cfg=cfg))
        tr = trl_trainer(high, "grpo", epsilon=low, importance_sampling_level="sequence")
        p = dict(seed=seed, low=low, high=high, agg="seq-mean-token-mean")
        record("trl gspo" + suffix, p, inputs(seed), trl_loss(tr, trl_clips))
    wr_adv = []
    if a.wr_core_algos:  # W-REINFORCE: the authors' advantage (their trainer: rewards = scores, gamma 1) and PPO loss
        if a.wr_torch_functional:
            wr_F = authors(a.wr_torch_functional, ["masked_mean"], torch=torch)
        else:  # verl 0.9.1's: the same computation
            import verl.utils.torch_functional as wr_F
        names = ["compute_psr_nsr_outcome_advantage", "compute_policy_loss"]
        wrd = authors(a.wr_core_algos, names, torch=torch, np=np, defaultdict=defaultdict, verl_F=wr_F)

        def psr_nsr(rewards, lengths, mask, lam):
            scores = last_token_scores(rewards, lengths, mask.shape[1])
            return wrd.compute_psr_nsr_outcome_advantage(scores, scores, mask.float(), 1.0, "weighted", lam)[0], scores

        for seed, lam in product(range(3), WR_LAMBDAS):
            rewards = outcome_rewards(seed, 4)
            g = torch.Generator().manual_seed(400 + seed)
            lengths = torch.randint(1, 17, (len(rewards),), generator=g)
            mask = torch.arange(16)[None] < lengths[:, None]
            adv, _ = psr_nsr(rewards, lengths, mask, lam)
            wr_adv.append(dict(seed=seed, lam=lam, rewards=rewards, lengths=lengths, mask=mask, ref_adv=adv))

        def wr_loss(c, logp):
            loss, clipfrac, _ = wrd.compute_policy_loss(c["old"], logp, c["adv"], c["mask"].float(), 0.2, c["scores"])
            return loss, {"pg_clipfrac": clipfrac}

        for seed, lam in product(range(3), WR_LAMBDAS):
            c = micro_batch(seed)  # ratios exactly on 0.8 and 1.2 in rows 0-3
            c["rewards"] = ((torch.arange(len(c["lengths"])) + seed) % 3 == 0).float()
            c["adv"], c["scores"] = psr_nsr(c["rewards"], c["lengths"], c["mask"], lam)
            record("wr ppo", dict(seed=seed, lam=lam), c, wr_loss)
    else:
        print("no --wr-core-algos: the W-REINFORCE cases left out")
    spg, gas = TRL_STEPS
    for seed, cap, ga in product(range(2), TRL_CAPS[:2], gas):  # a generation batch of 16 sequences of 3 to 40 tokens
        parts = [micro_batch(2 * seed + k, bounds=(0.5, cap), T=40) for k in range(2)]
        c = {k: torch.cat([part[k] for part in parts]) for k in ("logp", "old", "adv", "mask", "lengths")}
        for step, s in enumerate(trl_cispo_steps(cap, c, seed, ga, spg)):
            params = dict(seed=seed, cap=cap, spg=spg, ga=ga, step=step, n_gen=int(c["mask"].sum()))
            case = {k: c[k][s["rows"]] for k in ("logp", "old", "adv", "mask", "lengths")}
            case.update(family="trl cispo steps", params=params, ref_loss=s["loss"].detach(), ref_grad=s["grad"])
            cases.append(dict(case, ref_metrics={}, ref_regularised=None, ref_compute_loss_grad=s["compute_loss_grad"]))
    aggregation = []
    if a.cegppo_seqlen_balancing:
        from verl.trainer.ppo.core_algos import agg_loss

        aggregation = layouts(a.cegppo_seqlen_balancing, gppo.agg_loss, agg_loss)
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
    paths = [a.cegppo_core_algos, a.lpreg_core_algos, a.lpreg_dp_actor, a.torch_functional, a.cegppo_seqlen_balancing]
    paths += [a.wr_core_algos, a.wr_torch_functional]
    sources = {os.path.basename(p): hashlib.sha256(open(p, "rb").read()).hexdigest()[:16] for p in paths if p}
    versions = {p: importlib.metadata.version(p) for p in ("torch", "verl", "trl", "transformers", "accelerate")}
    data = dict(cases=cases, minp=minp, aggregation=aggregation, wr_adv=wr_adv, sources=sources, versions=versions)
    torch.save(data, a.path)
    line = f"{len(cases)} loss cases, {len(minp)} min-p cases, {len(aggregation)} mini-batch layouts, "
    line += f"{len(wr_adv)} W-REINFORCE advantage cases -> {a.path}; "
    print(line + f"{versions}; sha256[:16] {sources}")


# ---- check: ours ----
# log-ratios of +-25 (BEYOND)
BEYOND_FAMILIES = ("ce-gppo |lr| 25", "ce-gppo lr 25 A<0", "lp-reg |lr| 25", "verl sapo |lr| 25", "trl sapo |lr| 25")
# our +-20 log-ratio clamp, their none: A < 0 at r = e^25 unclamped; printed, not failed
DEVIATIONS = ("ce-gppo lr 25 A<0", "lp-reg |lr| 25")
LOSS_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check(a) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import grpo_cegppo as ce
    import grpo_cispo as ci
    import grpo_gspo as gs
    import grpo_lpreg as lp
    import grpo_sapo as sa
    import grpo_vanilla as gv
    import grpo_wreinforce as wr
    from utils import tracking

    def script(family):  # the script whose functions a family runs (its token_weights the same text as vanilla's)
        return sa if "sapo" in family else gs if "gspo" in family else wr if family.startswith("wr") else gv

    def ours(c, logp, w):
        """Our per-token loss on the flat valid tokens, as the script computes it; the clip fractions as the reference
        counts them (from our masks, token-mean weights w); Lp-Reg's selected tokens."""
        p, mask = c["params"], c["mask"]
        old, adv, family = c["old"][mask], c["adv"][mask], c["family"]
        frac = lambda m: (m * w).sum().item()  # noqa: E731
        if family.startswith("verl cispo"):
            loss, clipped = ci.cispo_loss(logp, old, adv, p["low"], p["high"])
            return loss, {"pg_clipfrac": frac(clipped)}, None
        if family.startswith("trl cispo"):  # TRL's metric: the capped tokens with A > 0 (ours: every capped one)
            loss, clipped = ci.cispo_loss(logp, old, adv, 0.2, 0.2, p["cap"])
            return loss, {"cispo_clip_ratio": frac(clipped & (adv > 0))}, None
        if "sapo" in family:  # verl's metrics: constants 0
            return sa.sapo_loss(logp, old, adv, p["tau_pos"], p["tau_neg"])[0], {}, None
        if "gspo" in family:  # verl: GSPO-token, token-weighted clip fraction; TRL: sequence ratios, per sequence
            lengths = c["lengths"]
            seq_log_ratio = gs.sequence_log_ratios(logp, old, lengths)
            level = "token" if family.startswith("verl") else "sequence"
            loss, clipped = gs.gspo_loss(logp, seq_log_ratio, adv, p["low"], p["high"], level)
            first = torch.cumsum(lengths, 0) - lengths
            seqs = {"_clipped sequences": int(clipped[first].sum())}  # "_": not the reference's, printed
            if family.startswith("verl"):
                return loss, {"pg_clipfrac": frac(clipped), **seqs}, None
            low, high = (clipped & (adv < 0))[first].float(), (clipped & (adv > 0))[first].float()
            metrics = {"clip_ratio/low_mean": low.mean().item(), "clip_ratio/high_mean": high.mean().item()}
            metrics.update({"clip_ratio/region_mean": clipped[first].float().mean().item()})
            metrics.update({"clip_ratio/low_min": low.min().item(), "clip_ratio/high_max": high.max().item()})
            return loss, {**metrics, **seqs}, None
        if family.startswith("wr"):  # ours from the rewards: weighted_advantages, per token
            adv = wr.weighted_advantages(c["rewards"], p["lam"]).repeat_interleave(c["lengths"])
            loss, clipped = wr.ppo_clip_loss(logp, old, adv, 0.2, 0.2)
            return loss, {"pg_clipfrac": frac(clipped)}, None
        if family.startswith("ce-gppo"):  # their pg_clipfrac: the bounded branches, our clip_frac_low_neg + high_pos
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

    data, rows, failures, deviations = torch.load(a.path), defaultdict(list), [], []
    beyond, steps, clip_counts = defaultdict(lambda: defaultdict(list)), defaultdict(list), defaultdict(lambda: [0, 0])
    print(f"references: {data['versions']}; files sha256[:16] {data['sources']}")
    for c in data["cases"]:
        logp, mask, n, p = c["logp"].clone().requires_grad_(), c["mask"], c["lengths"], c["params"]
        token_weights = partial(script(c["family"]).token_weights, n, 1, n_tokens=int(mask.sum()), n_seqs=len(n))
        w = token_weights(loss_agg="token-mean", max_len=mask.shape[1])  # the clip fractions' weights
        weights = token_weights(loss_agg=p.get("agg", "token-mean"), max_len=mask.shape[1])  # the loss's
        token_loss, metrics, selected = ours(c, logp[mask], w)
        factor = 1.0  # TRL's loss of an optimizer step: its tokens / (n_gen ga / spg); ours: / its tokens
        if c["family"] == "trl cispo steps":
            factor = p["spg"] * int(mask.sum()) / (p["ga"] * p["n_gen"])
        loss = (token_loss * weights).sum() * factor
        (grad,) = torch.autograd.grad(loss, logp)
        scale = max(abs(c["ref_loss"].item()), factor * (token_loss.abs() * weights).sum().item())
        ref = c["ref_loss"].item()
        if "_clipped sequences" in metrics:
            count = clip_counts[(c["family"], p["low"], p["high"], p["agg"])]
            count[0], count[1] = count[0] + metrics["_clipped sequences"], count[1] + len(n)
        d = dict(loss=abs(loss.item() - ref), grad=(grad - c["ref_grad"]).abs().max().item())
        d["rel"] = d["loss"] / scale
        d["metric"] = max((abs(metrics[k] - v) for k, v in c["ref_metrics"].items()), default=0.0)
        d["mismatched"] = 0 if selected is None else int((selected != c["ref_regularised"][mask]).sum())
        d["regularised"] = 0 if selected is None else int(c["ref_regularised"].sum())
        rows[c["family"]].append(d)
        close = [
            math.isclose(metrics[k], v, rel_tol=METRIC_RTOL, abs_tol=METRIC_ATOL) for k, v in c["ref_metrics"].items()
        ]
        close += [d["rel"] <= LOSS_RTOL, torch.allclose(grad, c["ref_grad"], GRAD_RTOL, GRAD_ATOL), not d["mismatched"]]
        if "ref_compute_loss_grad" in c:  # TRL end to end (training_step) against its _compute_loss alone
            close.append(torch.allclose(c["ref_compute_loss_grad"], c["ref_grad"], GRAD_RTOL, GRAD_ATOL))
            measured = (c["ref_grad"].abs().sum() / (grad / factor).abs().sum()).item()
            e2e = (c["ref_compute_loss_grad"] - c["ref_grad"]).abs().max().item()
            steps[(p["seed"], p["cap"], p["ga"], p["n_gen"])].append((int(mask.sum()), measured, factor, e2e))
        if c["family"].endswith("lr 12"):  # far_policy's rows: log s = +12 (A > 0, A < 0) and -12 (A > 0)
            for row, key in ((5, "A>0, log s +12"), (6, "A<0, log s +12"), (2, "A>0, log s -12")):
                beyond[c["family"]][key].append((grad - c["ref_grad"])[row].abs().max().item())
                beyond[c["family"]][key + " theirs"].append(c["ref_grad"][row].abs().max().item())
        if c["family"] in BEYOND_FAMILIES:  # the tokens beyond +-20 by advantage sign and log-ratio, and all the others
            log_ratio, adv = (c["logp"] - c["old"]).round(), c["adv"]
            for sign, value in product((1, -1), (25.0, -25.0)):
                group = mask & (adv * sign > 0) & (log_ratio == value)
                if group.any():
                    key = f"A{'>' if sign > 0 else '<'}0, log r {value:+.0f}"
                    beyond[c["family"]][key].append((grad - c["ref_grad"])[group].abs().max().item())
                    beyond[c["family"]][key + " theirs"].append(c["ref_grad"][group].abs().max().item())
            group = mask & (log_ratio.abs() != 25.0)
            beyond[c["family"]]["other tokens"].append((grad - c["ref_grad"])[group].abs().max().item())
        if not all(close):
            line = f"{c['family']} {c['params']}: loss {loss.item():.9g} vs {ref:.9g}, {d}, {metrics}"
            (deviations if c["family"] in DEVIATIONS else failures).append(line)
    for family, ds in rows.items():
        top = {k: (sum if k in ("mismatched", "regularised") else max)(d[k] for d in ds) for k in ds[0]}
        lpreg = f", regularised tokens {top['regularised']}, mismatched {top['mismatched']}" if "lp" in family else ""
        line = f"{family:17s} {len(ds):3d} cases: loss max|d| {top['loss']:.2g} (rel {top['rel']:.2g}), grad max|d| "
        note = " (documented deviation: not checked)" if family in DEVIATIONS else ""
        print(line + f"{top['grad']:.2g}, clip fractions max|d| {top['metric']:.2g}{lpreg}{note}")
        for key, values in beyond[family].items():
            if not key.endswith("theirs"):
                theirs = beyond[family].get(key + " theirs")
                theirs = f" (theirs max|grad| {max(theirs):.3g})" if theirs else ""
                print(f"    {key:16s} grad max|d| {max(values):.3g}{theirs}")
        counts = [
            f"{low:g}/{high:g} {agg} {k} of {m}" for (f, low, high, agg), (k, m) in clip_counts.items() if f == family
        ]
        if counts:
            print("    sequences clipped (ours; eps low/high, loss agg): " + ", ".join(counts))
        if family == "trl cispo steps":
            print(
                "    TRL's gradient / ours per optimizer step (expected spg N_step / (ga N_gen), spg 4), by generation:"
            )
            for (seed, cap, ga, n_gen), values in steps.items():
                step_tokens = " ".join(str(v[0]) for v in values)
                measured, expected = " ".join(f"{v[1]:.4f}" for v in values), " ".join(f"{v[2]:.4f}" for v in values)
                e2e = max(v[3] for v in values)
                line = f"    seed {seed} cap {cap:g} ga {ga}: N_gen {n_gen}, N_step {step_tokens}: {measured} "
                print(line + f"(expected {expected}); training_step vs _compute_loss max|d| {e2e:.2g}")
    d_value, mismatched, kept_total = 0.0, 0, 0
    for m in data["minp"]:
        mine, ref = lp.proxy_logprobs(m["logits"], m["labels"], m["kappa"], m["temperature"]), m["ref_proxy"]
        kept = ref > -1000  # theirs: a logit of -1e4 outside the min-p set; ours: -inf
        wrong, d = int((torch.isinf(mine) == kept).sum()), (mine[kept] - ref[kept]).abs()
        d_value, mismatched, kept_total = max(d_value, d.max().item()), mismatched + wrong, kept_total + int(kept.sum())
        if (d > LOSS_RTOL * ref[kept].abs()).any() or wrong:
            failures.append(f"min-p kappa {m['kappa']} T {m['temperature']}: max|d| {d.max():.3g}, {wrong} sets")
    if data["minp"]:
        line = (
            f"lp-reg min-p {len(data['minp']):3d} cases: proxy log-prob max|d| {d_value:.2g} on the {kept_total} kept"
        )
        print(line + f" tokens of {sum(len(m['labels']) for m in data['minp'])}, kept/outside mismatched {mismatched}")
    d_adv = 0.0
    for case in data.get("wr_adv", []):  # W-REINFORCE's advantages on every token, 0 on the padding
        mine = wr.weighted_advantages(case["rewards"], case["lam"])[:, None] * case["mask"]
        d = (mine - case["ref_adv"]).abs().max().item()
        d_adv = max(d_adv, d)
        if not torch.allclose(mine, case["ref_adv"], rtol=LOSS_RTOL, atol=0):
            failures.append(f"wr advantage seed {case['seed']} lambda {case['lam']}: max|d| {d:.3g}")
    if data.get("wr_adv"):
        cases, lams = data["wr_adv"], sorted({case["lam"] for case in data["wr_adv"]})
        values = sorted({v for case in cases for v in case["ref_adv"][case["mask"]].tolist()})
        line = f"wr advantage {len(cases):3d} cases ({len(cases[0]['rewards'])} responses, lambda {lams}): "
        print(line + f"max|d| {d_adv:.2g}; their values on the response tokens {values}")
    failures += aggregation(data.get("aggregation", []), gv.token_weights)
    if deviations:
        print(f"{len(deviations)} cases of the documented deviations beyond tolerance (not failures)")
    tolerance = f"loss rel {LOSS_RTOL} (of max(|loss|, token-mean |token loss|)), grad rel {GRAD_RTOL} abs "
    tolerance += f"{GRAD_ATOL}, clip fractions rel {METRIC_RTOL} abs {METRIC_ATOL}, the same tokens"
    print("\n".join(f"FAIL {line}" for line in failures) or f"all within tolerance: {tolerance}")
    return 1 if failures else 0


def aggregation(layouts: list, token_weights) -> list:
    """The layouts' per-token weights against ours (token_weights, --loss-agg): verl 0.9.1's equal to ours for the
    same mode (checked; its seq-mean-token-sum-norm with loss_scale_factor 16384, our max_len); CE-GPPO's fork and
    verl's sum-norm without loss_scale_factor printed. The ratio of the weight of the shortest response's tokens to
    the longest's under each. Returns the failures."""
    failures, H = [], CEGPPO_1_5B["max_response"]
    for lay in layouts:
        L, weights = lay["response"].flatten(), {k: v.flatten() for k, v in lay["weights"].items()}
        N, S, first = int(L.sum()), len(L), torch.cumsum(L, 0) - L
        ours = {mode: token_weights(L, 1, mode, N, S, H)[first].double() for mode in LOSS_AGG}
        pairs = [("verl token-mean", "token-mean"), ("verl seq-mean-token-mean", "seq-mean-token-mean")]
        pairs.append(("verl seq-mean-token-sum-norm 16384", "seq-mean-token-sum-norm"))
        rel = max(((weights[v] - ours[o]).abs() / ours[o]).max().item() for v, o in pairs)
        if rel > 1e-6:
            failures.append(f"layout {lay['name']} seed {lay['seed']}: verl 0.9.1 vs ours weights rel |d| {rel:.3g}")
        short, long = L.argmin(), L.argmax()
        ratio = {k: (v[short] / v[long]).item() for k, v in list(weights.items()) + list(ours.items())}
        fork = weights["fork dynamic bsz"]
        size = f"{CEGPPO_1_5B['ranks']} ranks x {CEGPPO_1_5B['seqs']} responses of {int(L.min())}..{int(L.max())}"
        print(f"layout {lay['name']} seed {lay['seed']}: {size} tokens ({N}), {lay['k']} micro-batches a rank; weight")
        theirs = ", ".join(f"{k} {v:.3g}" for k, v in ratio.items() if k.startswith(("fork", "verl")))
        print(f"    of a token of the shortest response / of the longest: {theirs}")
        print(
            "    ours: "
            + ", ".join(f"{k} {ratio[k]:.3g}" for k in LOSS_AGG)
            + f"; verl 0.9.1 = ours: rel |d| {rel:.2g}"
        )
        as_tm, as_sm = fork * N, fork * S * L
        line = f"    fork dynamic bsz: weight x N_tokens in [{as_tm.min():.3g}, {as_tm.max():.3g}] (1: token-mean), "
        print(line + f"x n_seqs x len in [{as_sm.min():.3g}, {as_sm.max():.3g}] (1: seq-mean-token-mean)")
    return failures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("write", help="run the references (verl==0.9.1, trl==1.16.0 installed), save to PATH")
    w.add_argument("path")
    w.add_argument("--cegppo-core-algos", required=True, help="CE-GPPO 10558fe verl/trainer/ppo/core_algos.py")
    w.add_argument("--lpreg-core-algos", required=True, help="Lp-Reg-dev 33b27e2 verl/trainer/ppo/core_algos.py")
    w.add_argument("--lpreg-dp-actor", help="Lp-Reg-dev 33b27e2 verl/workers/actor/dp_actor.py (the min-p proxy)")
    w.add_argument("--torch-functional", help="either fork's verl/utils/torch_functional.py (default: verl 0.9.1's)")
    w.add_argument("--cegppo-seqlen-balancing", help="CE-GPPO 10558fe verl/utils/seqlen_balancing.py (the layouts)")
    w.add_argument("--wr-core-algos", help="RLVR-Decomposed a5d4e7c verl/trainer/ppo/core_algos.py (W-REINFORCE)")
    w.add_argument(
        "--wr-torch-functional", help="RLVR-Decomposed a5d4e7c verl/utils/torch_functional.py (default: verl 0.9.1's)"
    )
    sub.add_parser("check", help="compare ours with the references saved in PATH").add_argument("path")
    args = parser.parse_args()
    sys.exit(write(args) if args.mode == "write" else check(args))
