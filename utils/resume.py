"""The run directory: a new run's name, or the run a --resume continues (its newest intact checkpoint, refusing
changed training settings). The checkpoints themselves: utils/checkpoints.py."""

import json
import os
import time

import torch
import torch.distributed as dist

from . import checkpoints
from .engine import flat_args

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
    changed = changed_settings(saved_args, json.loads(json.dumps(flat_args(args))))
    if changed and not args.resume_allow_changes:
        raise SystemExit(
            f"error: --resume {args.resume}: settings differ from the checkpoint's: {'; '.join(changed)} "
            "(pass --resume-allow-changes to resume anyway)"
        )
    return run_dir, checkpoint
