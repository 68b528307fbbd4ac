"""KL-Cov: GRPO with a KL penalty on the tokens whose log-prob and advantage covary most.

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (arXiv 2505.22617).
Entropy falls by about lr x Cov(logp, A); what changes relative to grpo_vanilla.py:
1. The per-token loss is -A r with no PPO clip, plus ppo_kl_coef |logp - old_logp| on the top kl_cov_ratio of the
   mini-batch's tokens by covariance c_t = (A_t - mean A)(logp_t - mean logp) (kl_cov_loss).
2. The selection covers the optimizer mini-batch of all ranks (--cov-scope global; the reference's per micro-batch
   scope: --cov-scope microbatch), so it depends neither on the micro-batch size nor on the number of GPUs.

    deepspeed --num_gpus 8 grpo_klcov.py --model-name-or-path Qwen/Qwen2.5-Math-1.5B --dataset <train file>
"""

import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal, NamedTuple

import numpy as np
import torch
import tyro
from tqdm import tqdm

from utils import batching, checkpoints, distributed, models, ops, process, rollout_rank, rollouts, tracking, updates
from utils.checks import check_args
from utils.data import check_model, eval_prompts, load_tokenizer, tokenized_prompts
from utils.engine import EngineArgs
from utils.evaluation import evaluate
from utils.kl import kl_penalty
from utils.logprobs import current_logprobs, response_logprobs
from utils.resume import open_run
from utils.reward import default_grading_workers
from utils.rollout_correction import CorrectionMode, rollout_weights
from utils.sampler import make_sampler
from utils.split_launch import SplitLaunch


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""

    # Model and data
    model_name_or_path: str = "Qwen/Qwen2.5-Math-1.5B"
    """the policy to train: a hub id or a local HF directory"""
    dataset: str = "DigitalLearningGmbH/MATH-lighteval"
    """training prompts: a hub id or a local .jsonl/.json/.parquet file (default: MATH's 7,500 training problems)"""
    dataset_split: str | None = None
    """split of a hub dataset (default: train)"""
    question_field: str | None = None
    """column holding the problem (default: auto-detect problem/question)"""
    answer_field: str | None = None
    """column holding the reference answer (default: auto-detect answer/final_answer/solution's \\boxed{})"""
    eval_dataset: tuple[str, ...] = ()
    """held-out prompts for periodic evaluation: hub ids or local files, each a set (or one per data_source its rows
    name), logged as eval/<set>/... and their mean as eval/...; off when empty"""
    eval_every: int = 10
    """evaluate every this many steps (and after the last one); 0 disables"""
    eval_num_prompts: int = 500
    """evaluate on at most this many prompts of each held-out set"""
    eval_samples: int = 0
    """also sample this many responses per eval prompt at the training temperature (eval/mean_acc, pass@k, entropy)"""
    max_prompt_length: int = 1024
    """prompts longer than this (in tokens) are dropped and counted, never truncated"""
    max_response_length: int = 3072
    """maximum number of generated tokens per response"""

    # Rollouts
    total_steps: int = 500
    """number of training steps (each: one rollout batch, then its optimizer updates)"""
    num_prompts_per_step: int = 128
    """prompts per step, over all ranks"""
    group_size: int = 8
    """responses sampled per prompt (G)"""
    temperature: float = 1.0
    """sampling temperature; log-probs and entropies are computed at this temperature"""
    top_p: float = 1.0
    """nucleus sampling: must be 1 (checked), the loss's log-probs and entropy are of the full softmax"""
    max_staleness: int = 0
    """--rollout-ranks: each step trains on samples of the policy s updates behind (0: no overlap; 1: one-step-off)"""
    filter_groups: bool = False
    """DAPO's dynamic sampling (arXiv 2503.14476; verl's algorithm.filter_groups): groups whose metric does not vary
    are dropped and more prompts generated until --num-prompts-per-step groups remain (utils/rollouts.py)"""
    filter_groups_metric: Literal["acc", "reward"] = "acc"
    """what must vary within a group: acc, the grader's verdict; reward, with the overlong penalty"""
    max_gen_batches: int = 10
    """at most this many generation rounds per step (0: no limit); then, where verl stops with an error, the first
    dropped groups fill the step (zero advantage: plain GRPO's step) with a warning; rollout/filled_groups: how many"""
    overlong_buffer_len: int = 0
    """DAPO's overlong shaping: the reward falls linearly by up to --overlong-penalty-factor over the last this many
    response tokens (verl's overlong_buffer.len; DAPO: 4096 of 20480); 0: off"""
    overlong_penalty_factor: float = 1.0
    """the overlong penalty at --max-response-length (verl's penalty_factor 1 on DAPO's +-1 rewards; ours are 1 / 0:
    0.5 gives DAPO's advantages)"""
    mask_truncated: bool = False
    """responses cut at --max-response-length leave the loss, its numerator and denominator (TRL's
    mask_truncated_completions); they still count in their group's advantages and in --filter-groups"""

    # Optimisation
    learning_rate: float = 1e-6
    """the learning rate of the optimizer"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """after warm-up: constant, or a linear / cosine decay to 0 at --total-steps"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in training steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """the maximum norm for gradient clipping"""
    num_mini_batches: int = 4
    """optimizer updates per rollout batch and epoch (the batch is split into this many mini-batches).
    KL-Cov needs >= 2: on the first, logp == old_logp, so its penalty and gradient are zero (paper: 8 of 32 prompts)
    (measured bitwise on the CPU testbed, padded, packed, ZeRO-3: the log-prob pass runs the same micro-batches)"""
    num_epochs: int = 1
    """passes over each rollout batch"""
    clip_eps_low: float = 0.2
    """PPO lower clip: ratio >= 1 - eps_low"""
    clip_eps_high: float = 0.2
    """PPO upper clip: ratio <= 1 + eps_high (DAPO's clip-higher: 0.28)"""
    clip_ratio_c: float = 0.0
    """dual clip: where A < 0 the loss is at most -A c (verl's clip_ratio_c, its default 3); 0: PPO's clip alone"""
    rollout_correction: CorrectionMode = "token-truncate"
    """each token's loss weight from r = pi_old / pi_sampler (the sampler's gap to the trainer) per token (token-), the
    sequence's product (sequence-) or geometric mean (geo-), in [--vllm-is-min, --vllm-is-cap]: truncate clips r (TIS),
    mask keeps r, 0 outside (IcePop; TRL's default sequence-mask, C 3); geo-mask: 1, 0 outside (verl's rejection)"""
    vllm_is_cap: float = 2.0
    """the rollout correction's upper bound C; 0 disables the correction (verl's default)"""
    vllm_is_min: float = 0.0
    """its lower bound (0: none): the truncate modes raise a ratio to it, the mask modes drop a ratio below it"""
    kl_coef: float = 0.0
    """coefficient of the KL to the initial policy; 0 (default) does not load a reference model"""
    kl_estimator: Literal["k1", "k2", "k3", "k1+", "k3+", "k3-is"] = "k3"
    """d = log pi - log pi_ref per token (utils/kl.py): verl's k1 d, k2 d^2 / 2, k3 exp(-d) + d - 1, k1+ and k3+
    (with k2's gradient); k3-is: k3 times pi / pi_old, DeepSeek-V3.2's (TRL 1.16's default, use_bias_correction_kl)"""
    scale_rewards: bool = True
    """divide advantages by the group's reward std (GRPO); `--no-scale-rewards` is Dr. GRPO"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """the loss of the mini-batch of all ranks: token-mean, the mean over its tokens; seq-mean-token-mean, the mean of
    each sequence's token mean; seq-mean-token-sum-norm, of each one's token sum / --max-response-length (Dr. GRPO)"""
    top_entropy_quantile: float = 1.0
    """80/20 rule (Wang et al. 2025, arXiv 2506.01939): only tokens whose entropy is at or above the (1 - rho) quantile
    keep their policy-gradient term (a method's own loss terms too; the reference KL stays on every token); 1: off
    (paper: 0.2)"""
    entropy_mask_scope: Literal["global", "microbatch"] = "global"
    """global (ours): one threshold per optimizer mini-batch over its tokens on all ranks, whatever the layout;
    microbatch: TRL 1.16's top_entropy_quantile, from the current forward's entropies of each micro-batch, all ranks"""
    entropy_mask_source: Literal["sampling", "current"] = "sampling"
    """global scope: whose entropies decide: the sampling policy's (no extra forward, the same tokens every epoch) or
    the current policy's, as the paper (section 2.1), TRL and the authors' code (a no-grad forward per mini-batch)"""
    entropy_mask_norm: Literal["all", "kept"] = "all"
    """the policy-gradient term's denominator counts every response token (TRL) or only the kept ones (the paper's
    Eq. 6, the authors' verl code): a mean over the kept tokens of the mini-batch of all ranks (theirs: micro-batch)"""

    # KL-Cov ("The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617)
    kl_cov_ratio: float = 2e-3
    """fraction of a mini-batch's tokens penalised: the top max(1, floor(ratio N)) by covariance (paper: 2e-3 at 7B)"""
    ppo_kl_coef: float = 1.0
    """coefficient of |logp - old_logp| on the selected tokens (paper: 1)"""
    cov_scope: Literal["global", "microbatch"] = "global"
    """global (our deliberate deviation): one selection over the whole optimizer mini-batch of all ranks, the same
    whatever the micro-batch size and world size; costs a no-grad forward per mini-batch after the first.
    microbatch: reproduces the reference, per micro-batch on each rank (local means, local k)."""

    # How and where it runs: hardware, numerics, checkpoints, tracking (utils/engine.py; their own --help group)
    engine: Annotated[EngineArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=EngineArgs)
    """the engine's flags, each by its own name (--zero-stage, --track, ...): none is the method's"""

    # filled in at runtime
    world_size: int = 0
    """the number of processes"""
    run_name: str = ""
    """{exp_name}__{seed}__{unix time}, or the resumed run's name"""
    git_commit: str = ""
    """short hash of the code's commit, "-dirty" with uncommitted changes"""

    def __getattr__(self, name):  # args.zero_stage reads the engine's flag: utils/ takes `args` as one namespace
        if name == "engine":  # not made yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)


def validate_args(args: Args, world_size: int) -> None:
    """Reject impossible settings at start with one line naming the flag (the shared flags: utils.checks.check_args)."""
    method_checks = [
        (0 < args.kl_cov_ratio <= 1, f"--kl-cov-ratio must be in (0, 1] (got {args.kl_cov_ratio})"),
        (args.ppo_kl_coef >= 0, f"--ppo-kl-coef must be >= 0 (got {args.ppo_kl_coef})"),
        (
            args.num_mini_batches * args.num_epochs >= 2,
            "KL-Cov needs >= 2 updates per rollout batch (--num-mini-batches "
            "x --num-epochs): on the first, logp == old_logp and its penalty is zero",
        ),
    ]
    check_args(args, world_size, method_checks)


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A = (R - mean_group(R)) / (std_group(R) + eps) for rewards [prompts, G]; no division when not `scale`."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    return centered / (rewards.std(dim=1, keepdim=True) + eps) if scale else centered


def token_weights(lengths, counted, loss_agg: str, n_tokens: float, n_seqs: float, max_len: int) -> torch.Tensor:
    """Weight of each response token so that sum(weight * loss) is the loss of the optimizer mini-batch of all ranks
    (n_tokens, n_seqs: its totals over the counted sequences; lengths, counted: the local sequences', an uncounted
    one weighs 0): token-mean 1 / n_tokens, seq-mean-token-mean 1 / (len_i n_seqs), seq-mean-token-sum-norm (Dr. GRPO)
    1 / (max_len n_seqs): independent of the layout."""
    n_tokens, n_seqs = max(n_tokens, 1), max(n_seqs, 1)  # none counted (--mask-truncated): every weight 0
    if loss_agg == "token-mean":
        per_seq = torch.full_like(lengths, 1.0 / n_tokens, dtype=torch.float32)
    elif loss_agg == "seq-mean-token-mean":
        per_seq = 1.0 / (lengths.float() * n_seqs)
    elif loss_agg == "seq-mean-token-sum-norm":
        per_seq = torch.full_like(lengths, 1.0 / (max_len * n_seqs), dtype=torch.float32)
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}")
    return (per_seq * counted).repeat_interleave(lengths)


def ppo_clip_loss(logp, old_logp, advantages, eps_low: float, eps_high: float, clip_c: float = 0.0):
    """Per-token PPO-clip loss max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), r = exp(logp - old_logp) (log-ratio
    clamped to +-20 as verl does), with clip_c > 0 capped at -A clip_c where A < 0 (dual clip), and a mask of the
    tokens where a clipped branch is active (no gradient flows there)."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss, cap = torch.maximum(unclipped, clipped), torch.where(advantages < 0, -advantages * clip_c, torch.inf)
    return (loss.clamp(max=cap), (clipped > unclipped) | (loss > cap)) if clip_c else (loss, clipped > unclipped)


# ---- KL-Cov: the covariance, the selection and the loss ----
def token_covariance(logp, advantages) -> torch.Tensor:
    """c_t = (A_t - mean(A)) (logp_t - mean(logp)) over the tokens of the selection set (1-D), logp detached.

    Entropy moves by about -lr * Cov(logp, A): the tokens of largest c_t (confident and rewarded, or unlikely and
    punished) are the ones that drive it down.
    """
    logp = logp.detach()
    return (advantages - advantages.mean()) * (logp - logp.mean())


def kl_cov_select(cov, ratio: float) -> torch.Tensor:
    """Mask of exactly the k = max(1, floor(ratio * N)) tokens of largest covariance."""
    k = min(max(1, int(ratio * cov.numel())), cov.numel())
    selected = torch.zeros_like(cov, dtype=torch.bool)
    selected[torch.topk(cov, k).indices] = True
    return selected


def kl_cov_loss(logp, old_logp, advantages, selected, coef: float):
    """Per-token KL-Cov loss: -A r, r = exp(logp - old_logp), never clipped, plus coef |logp - old_logp| if selected."""
    log_ratio = logp - old_logp
    return -advantages * torch.exp(log_ratio) + coef * selected * log_ratio.abs()


def kl_cov_global_selection(current: list, batches: list, mini: range, ratio: float):
    """--cov-scope global: covariances against the means of the whole optimizer mini-batch of all ranks, and the top
    k of all of them selected; given the current log-probs of this rank's micro-batches `batches[i] for i in mini` (one
    flat tensor each), their (covariances, selection masks)."""

    def select(gathered):
        cov = token_covariance(gathered[:, 0], gathered[:, 1])
        return cov, kl_cov_select(cov, ratio)

    return batching.over_mini_batch([current, [batches[i]["advantages"] for i in mini]], batches, mini, select)


def kl_cov_metrics(summed: dict, num_epochs: int, selection_time: float) -> dict:
    """KL-Cov's metrics from the step's sums over ranks (every token is in one mini-batch per epoch)."""
    considered, selected = summed["tokens"] * num_epochs, max(summed["selected"], 1)
    return {
        "cov/mean": summed["cov"] / considered,
        "cov/selected_frac": summed["selected"] / considered,
        "cov/selected_mean": summed["selected_cov"] / selected,
        "cov/kl_selected": summed["kl_selected"] / selected,  # mean |logp - old_logp| penalised
        "time/cov_selection": selection_time,
    }


class Selection(NamedTuple):
    kept: dict  # micro-batch index -> mask of its tokens at or above the threshold
    entropy: dict  # micro-batch index -> the entropies that decided
    threshold: float
    scale: float  # tokens / kept tokens of the selection set, all ranks: turns a mean over all into one over the kept


def entropy_selection(entropies: dict, rho: float) -> Selection:
    """The 80/20 rule over a selection set of tokens on all ranks (this rank's: a flat tensor of entropies per
    micro-batch index): the tokens whose entropy is at or above the (1 - rho) quantile of the whole set, ties kept
    (rho 0: the maximum only), as TRL's top_entropy_quantile."""
    gathered = distributed.gather_ranks(torch.cat(list(entropies.values())))[0]
    threshold = ops.quantile(gathered, 1 - rho) if gathered.numel() else gathered.new_tensor(math.inf)
    kept = {i: e >= threshold for i, e in entropies.items()}
    return Selection(kept, entropies, threshold.item(), gathered.numel() / max((gathered >= threshold).sum().item(), 1))


class TokenSelection:
    """The 80/20 rule in the loop, asked before each optimizer mini-batch (`start`) and for each micro-batch's loss
    (`keep`); with --top-entropy-quantile 1 it keeps every token and costs nothing."""

    def __init__(self, args, logprobs, policy):
        self.rho, self.logprobs, self.policy = args.top_entropy_quantile, logprobs, policy
        self.scope = args.entropy_mask_scope if self.rho < 1 else None
        self.current, self.kept_mean = args.entropy_mask_source == "current", args.entropy_mask_norm == "kept"
        self.selection = None

    def start(self, mini: range, batches: list, entropies: list, later: bool) -> None:
        """Global scope: one threshold over the mini-batch `mini` (micro-batch indices) of all ranks from the sampling
        policy's entropies (the current policy's until an update) or, with --entropy-mask-source current after the
        step's first update (`later`), from a no-grad forward of the mini-batch's batches by the policy."""
        if self.scope == "global":
            with torch.no_grad():
                current = self.current and later
                decide = {
                    i: self.logprobs(self.policy, batches[i], with_entropy=True)[1] if current else entropies[i]
                    for i in mini
                }
            self.selection = entropy_selection(decide, self.rho)

    def keep(self, i: int, token_loss, entropy, sums: dict):
        """Micro-batch i's per-token loss on its kept tokens only (x tokens / kept tokens with --entropy-mask-norm
        kept: a mean over the kept); the microbatch scope selects here, from the training forward's entropies (TRL
        1.16); adds to the metrics' sums. The selection it applied stays in `selection` (kept masks, scale)."""
        if self.scope is None:
            return token_loss
        if self.scope == "microbatch":  # TRL 1.16: this micro-batch's current entropies, all ranks
            self.selection = entropy_selection({i: entropy.detach()}, self.rho)
        s = self.selection
        kept = s.kept[i]
        sums["kept"] += kept.sum().double()
        sums["kept_entropy"] += (s.entropy[i] * kept).sum().double()
        sums["threshold"] += s.threshold
        sums["selections"] += 1
        return token_loss * kept * (s.scale if self.kept_mean else 1.0)


if __name__ == "__main__":
    args = tyro.cli(Args)
    launch = SplitLaunch(args.rollout_ranks)  # with --rollout-ranks, the launch split into trainers and rollout ranks
    rank, local_rank, world_size, device, on_gpu = distributed.init_distributed(launch)
    validate_args(args, world_size)
    check_model(args)  # the model loads and the context fits it
    args.world_size, args.git_commit = world_size, tracking.git_commit()
    run_dir, resumed = open_run(args, world_size, device)  # resume continues the run directory of its checkpoint

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    distributed.full_determinism(args.full_determinism, on_gpu)  # bitwise-repeatable GPU runs, or nothing

    # data: prompts tokenised once; over-long prompts dropped and counted
    tokenizer = load_tokenizer(args.model_name_or_path)
    train_data, dropped = tokenized_prompts(args.dataset, args.dataset_split, tokenizer, args)
    eval_data = eval_prompts(args.eval_dataset, tokenizer, args, train_data)  # (prompt, answer, set name)
    if rank == 0:
        print(f"{len(train_data)} training prompts ({dropped} dropped: longer than {args.max_prompt_length} tokens)")

    # the policy (DeepSpeed engine), the reference policy, the sampler (vLLM engine)
    G, mbs, clip = args.group_size, args.micro_batch_size, (args.clip_eps_low, args.clip_eps_high, args.clip_ratio_c)
    updates_per_step = args.num_mini_batches * args.num_epochs
    correction = (args.rollout_correction, args.vllm_is_min, args.vllm_is_cap)  # the sampler's tokens to the trainer's
    grading_workers = args.grading_workers or default_grading_workers()
    if launch.serving:  # a rollout rank generates for the trainers until they stop: its process ends here
        raise SystemExit(rollout_rank.serve(launch, args, tokenizer, train_data, grading_workers))
    grad_accum = args.num_prompts_per_step // (args.num_mini_batches * world_size) * G // mbs  # micro-batches/update
    policy, scheduler, ref_policy = models.make_policy(args, on_gpu, grad_accum, updates_per_step)
    # consumed: prompts of the seeded stream used so far; method_state: what a method carries across steps (both saved)
    start_step, consumed, method_state = 0, 0, {}
    if resumed:
        start_step, method_state, consumed = checkpoints.load(policy, resumed, rank)
    head_calls = models.head_calls(args)  # ZeRO-3: every rank calls the output head equally often (None: any number)

    def logprobs(model, batch, with_entropy=False, extra=None):
        return response_logprobs(
            model, batch, args.temperature, args.logprob_chunk_size, with_entropy, head_calls, extra
        )

    selector = TokenSelection(args, logprobs, policy)  # the 80/20 rule: its scope global, microbatch or None (off)
    train_entropy = selector.scope == "microbatch"  # the training forward's entropies: to select by
    sampler = make_sampler(args, rank, on_gpu, policy, tokenizer, launch)  # vLLM (or HF generate): utils/sampler.py
    if resumed:  # the checkpoint's weights, and beside rollout ranks its batches in flight
        sampler.resume(policy, resumed)
    tracker = tracking.Tracker(args, run_dir, rank, start_step if resumed else None)  # metrics.jsonl; wandb: --track
    stop, trim_heap = process.StopSignal(sampler), process.HeapTrim()
    if eval_data and args.eval_every and start_step == 0:
        tracker.log(evaluate(args, sampler, policy, tokenizer, eval_data, logprobs), 0)  # the base policy
    bad_steps, stopping = 0, False
    progress = tqdm(range(start_step, args.total_steps), disable=rank != 0, initial=start_step, total=args.total_steps)
    for step in progress:
        step_start = time.time()
        # ---- rollouts: G samples per prompt, graded (utils/rollouts.py: dynamic sampling, rollout ranks) ----
        rollout = rollouts.collect(args, consumed, train_data, tokenizer, sampler, grading_workers)
        sampler.sleep()  # GPUs: the engine's memory goes to training until the weight push
        prompts, samples, graded, rewards = rollout.prompts, rollout.samples, rollout.graded, rollout.rewards
        consumed = rollout.consumed  # where the next step's prompts start in the stream (checkpointed)
        metrics = {"time/generation": rollout.seconds[0], "time/reward": rollout.seconds[1]}

        # ---- advantages; the micro-batches, collated once ----
        seq_prompts, responses = [prompts[k // G] for k in range(len(samples))], [s.ids for s in samples]
        advantages = group_advantages(rewards, args.scale_rewards).flatten()
        # each micro-batch's samples; mini-batch m is micro-batches minis[m]
        indices, minis = batching.micro_batches([len(p) + len(r) for p, r in zip(seq_prompts, responses)], args, device)
        inputs = [([seq_prompts[k] for k in idx], [responses[k] for k in idx], advantages[idx], idx) for idx in indices]
        batches = [
            batching.collate(p, r, tokenizer.pad_token_id, device, a, args.padding_free, idx) for p, r, a, idx in inputs
        ]
        # --mask-truncated: the responses cut at the length limit weigh 0 in the loss (counted: the others)
        counted = torch.tensor([not (args.mask_truncated and s.truncated) for s in samples])
        # the sampler's log-probs of each micro-batch's tokens, in its order
        sampler_logps = [torch.tensor([x for k in idx for x in samples[k].sampler_logps]).to(device) for idx in indices]

        # ---- log-prob pass: the sampling policy's log-probs and entropy, the reference policy's log-probs ----
        t0 = time.time()
        old_logps, ref_logps, entropies, is_weights = [], [], [], []  # one flat tensor per micro-batch
        sums = dict.fromkeys(["entropy", "loss", "clipped", "approx_kl", "ref_kl"], 0.0)  # over the step, then ranks
        sums.update(dict.fromkeys(["kept", "kept_entropy", "threshold", "selections"], 0.0))  # the 80/20 rule
        sums.update(dict.fromkeys(tracking.CLIP_SUMS, 0.0))  # where the ratio left the clip range
        with torch.no_grad():
            for batch, sampler_logp in zip(batches, sampler_logps):
                logp, entropy, _ = logprobs(policy, batch, with_entropy=True)
                old_logps.append(logp)
                # the rollout correction: each token's weight (1 with --vllm-is-cap 0), what it truncated and masked
                is_weights.append(rollout_weights(logp, sampler_logp, batch["lengths"], *correction))
                entropies.append(entropy)
                sums["entropy"] += entropy.sum().double()
                if ref_policy is not None:
                    ref_logps.append(logprobs(ref_policy, batch)[0])
        metrics["time/logprob"] = time.time() - t0

        # ---- training: mini-batches of the rollout batch, the loss normalised over all ranks ----
        t0 = time.time()
        grad_norms, skipped = [], 0
        sums.update(dict.fromkeys(["cov", "selected", "selected_cov", "kl_selected"], 0.0))  # KL-Cov
        selection_time = 0.0
        for epoch in range(args.num_epochs):
            for m in range(args.num_mini_batches):
                mini = minis[m]
                lengths, in_loss, sizes = batching.mini_batch_samples(batches, mini, counted)  # on the CPU
                totals = distributed.all_reduce_sums(
                    {"tokens": lengths[in_loss].sum().item(), "seqs": lengths[in_loss].count_nonzero().item()}, device
                )
                aggregation = (args.loss_agg, totals["tokens"], totals["seqs"], args.max_response_length)
                mini_weights = token_weights(lengths, in_loss, *aggregation).to(device)  # one copy per mini-batch
                selector.start(mini, batches, entropies, bool(epoch or m))  # the 80/20 rule, global scope
                # KL-Cov: one selection over the mini-batch of all ranks, before its updates
                if args.cov_scope == "global":
                    t1 = time.time()
                    current = current_logprobs(logprobs, policy, batches, mini, old_logps, bool(epoch or m))
                    mini_cov, mini_selected = kl_cov_global_selection(current, batches, mini, args.kl_cov_ratio)
                    selection_time += time.time() - t1
                for i, weights in zip(mini, mini_weights.split(sizes)):
                    batch = batches[i]
                    logp, entropy, _ = logprobs(policy, batch, with_entropy=train_entropy)
                    old_logp, adv = old_logps[i], batch["advantages"]
                    if args.cov_scope == "global":
                        cov, selected = mini_cov[i - mini.start], mini_selected[i - mini.start]
                    else:  # the reference: local means and local k, per micro-batch and rank
                        cov = token_covariance(logp, adv)
                        selected = kl_cov_select(cov, args.kl_cov_ratio)
                    token_loss = kl_cov_loss(logp, old_logp, adv, selected, args.ppo_kl_coef)
                    clipped = torch.zeros_like(selected)  # no PPO clipping in KL-Cov
                    token_loss = token_loss * is_weights[i][0]  # the sampler's tokens, weighted to the trainer's
                    token_loss = selector.keep(i, token_loss, entropy, sums)  # the 80/20 rule: the kept tokens only
                    if ref_policy is not None:
                        ref_kl = kl_penalty(logp, ref_logps[i], old_logp, args.kl_estimator)  # k3 by default
                        token_loss = token_loss + args.kl_coef * ref_kl
                        sums["ref_kl"] += (ref_kl.detach() * weights).sum().double()
                    loss = (token_loss * weights).sum()
                    # DeepSpeed divides by the accumulation steps and averages over ranks; the weights already normalise
                    policy.set_gradient_accumulation_boundary(i == mini[-1])  # the update: after the last
                    policy.backward(loss * grad_accum * world_size)
                    policy.step()
                    with torch.no_grad():
                        log_ratio = logp - old_logp
                        sums["loss"] += loss.detach().double()
                        sums["clipped"] += (clipped.float() * weights).sum().double()
                        tracking.clip_sums(sums, log_ratio, adv, weights, *clip[:2])
                        sums["approx_kl"] += ((torch.exp(log_ratio) - 1 - log_ratio) * weights).sum().double()
                        sums["cov"] += cov.sum().double()
                        sums["selected"] += selected.sum().double()
                        sums["selected_cov"] += torch.where(selected, cov, 0).sum().double()
                        sums["kl_selected"] += torch.where(selected, log_ratio.abs(), 0).sum().double()
                skipped += updates.record_update(policy, scheduler, grad_norms)  # or skipped (non-finite)
        metrics["time/training"] = time.time() - t0

        # ---- weight push: the sampler gets the new policy ----
        t0 = time.time()
        sampler.push(policy)  # awake afterwards, for evaluation and the next rollouts
        metrics["time/weight_push"] = time.time() - t0

        # ---- metrics: sums over ranks, then means ----
        old_logp = torch.cat(old_logps)
        sums.update(seqs=len(samples), tokens=old_logp.numel(), prompt_tokens=sum(len(p) for p in seq_prompts))
        sums["positions"] = sum(batch["input_ids"].numel() for batch in batches)  # padding included
        sums.update(tracking.rollout_sums(rewards, graded, samples))
        sums.update(rollout.sums)  # --filter-groups: the generation rounds
        sums["nll"] = -old_logp.sum().item()
        # the sampler's log-probs against the trainer's, the correction's weights
        sums.update(tracking.sampler_sums(old_logp, torch.cat(sampler_logps), is_weights))
        summed = distributed.all_reduce_sums(sums, device)
        maxima = tracking.step_maxima(samples, old_logp, torch.cat(sampler_logps), device)  # longest, largest gap
        metrics.update(
            tracking.step_metrics(summed, args, grad_norms, skipped, scheduler, time.time() - step_start, maxima)
        )
        metrics.update(tracking.opening_metrics(entropies, batches, samples))  # the top 20% and first tokens
        metrics.update(kl_cov_metrics(summed, args.num_epochs, selection_time))
        tracker.log(metrics, step + 1)
        progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", entropy=f"{metrics['entropy/full']:.3f}")

        # ---- evaluation and checkpoint ----
        # every rank agrees: the skipped updates are global
        bad_steps = updates.check_bad_steps(bad_steps, skipped, args.max_bad_steps, run_dir, tracker)
        done = step + 1 == args.total_steps
        if eval_data and args.eval_every and ((step + 1) % args.eval_every == 0 or done):
            tracker.log(evaluate(args, sampler, policy, tokenizer, eval_data, logprobs), step + 1)
        trim_heap()
        stopping = stop.agreed(device)  # a signal to any rank stops them all
        if (args.save_every and (step + 1) % args.save_every == 0) or done or stopping:
            checkpoints.save(policy, run_dir, step + 1, method_state, args, rank, done or stopping, consumed, sampler)
        if stopping:
            break

    checkpoints.save_final(policy, tokenizer, run_dir, rank, tracker, stopped_at=step + 1 if stopping else None)
    process.shutdown(sampler, launch)  # the engine first, then the process groups
