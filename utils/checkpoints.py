"""Resumable checkpoints of the method scripts, knowing no method: written atomically, with every file's size and
sha256 recorded; verified before a resume, falling back to the newest intact one; never written silently short (a full
disk is a warning for a periodic checkpoint, a one-line error for the final one). Collective calls: every rank calls
`save` and `find_intact` at the same point.

    runs/<run>/checkpoints/step_0000050/
        state/...                 DeepSpeed's engine state (weights, optimizer, LR scheduler), one file per rank or so
        rng_rank<r>.pt            rank r's RNG states, and the step and method state it held
        trainer_state.json        step, method_state, consumed (prompts of the stream used), the run's args
        checksums.json            {file: [size, sha256]} of all of the above, written last
"""

import errno
import hashlib
import json
import os
import random
import shutil
import sys

import numpy as np
import torch
import torch.distributed as dist

from .engine import flat_args

CHECKSUMS = "checksums.json"


def _complete(path: str) -> list:
    """The complete checkpoints of a run directory, oldest first, or [path] if it is a checkpoint itself."""
    if os.path.exists(os.path.join(path, "trainer_state.json")):
        return [path]
    root = os.path.join(path, "checkpoints")
    done = sorted(d for d in os.listdir(root) if d.startswith("step_")) if os.path.isdir(root) else []
    return [os.path.join(root, d) for d in done]


def latest(path: str) -> str | None:
    """The newest complete checkpoint under a run directory, or `path` itself if it is a checkpoint."""
    return (_complete(path) or [None])[-1]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: str) -> list:
    return sorted(
        os.path.relpath(os.path.join(d, name), directory) for d, _, names in os.walk(directory) for name in names
    )


def _gather(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _first_problem(problem):
    """The first rank's problem (or None), the same on every rank."""
    return next((p for p in _gather(problem) if p), None)


def damage(checkpoint: str) -> list:
    """What is wrong with a checkpoint's files against its checksums.json ([] if intact; each rank hashes a share).
    A checkpoint written before checksums were recorded has nothing to check against: []."""
    recorded_path = os.path.join(checkpoint, CHECKSUMS)
    if not os.path.exists(recorded_path):
        return []
    try:
        with open(recorded_path) as f:
            recorded = json.load(f)
    except (OSError, ValueError) as e:
        return [f"{CHECKSUMS} unreadable ({e})"]
    problems = []
    for name in sorted(recorded)[dist.get_rank() :: dist.get_world_size()]:
        size, digest = recorded[name]
        path = os.path.join(checkpoint, name)
        if not os.path.exists(path):
            problems.append(f"{name} missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{name} has {os.path.getsize(path)} bytes, {size} when written")
        elif _sha256(path) != digest:
            problems.append(f"{name} does not match its sha256")
    return sorted(p for share in _gather(problems) for p in share)


def find_intact(path: str) -> str | None:
    """The newest checkpoint under a run directory (or `path`, a checkpoint) whose files are intact; each damaged one
    passed over is named in a warning. None if there is none."""
    for candidate in reversed(_complete(path)):
        problems = damage(candidate)
        if not problems:
            return candidate
        if dist.get_rank() == 0:
            print(f"warning: checkpoint {candidate} is damaged, not used: {'; '.join(problems)}", file=sys.stderr)
    return None


def load(engine, checkpoint: dict, rank: int):
    """Restore the DeepSpeed engine (weights, optimizer, scheduler) and this rank's RNG states (the sampler gets the
    weights and any batches in flight in its `resume`: utils/sampler.py); (step, method_state, prompts consumed: where
    the next step's prompts start in the stream, step x P in checkpoints that predate it)."""
    engine.load_checkpoint(checkpoint["path"], tag="state")
    rng = torch.load(os.path.join(checkpoint["path"], f"rng_rank{rank}.pt"), weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    consumed = checkpoint.get("consumed", checkpoint["step"] * checkpoint["args"]["num_prompts_per_step"])
    return checkpoint["step"], checkpoint["method_state"], consumed


def _size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in _files(directory))


def needed_bytes(engine, root: str) -> tuple:
    """(bytes, how they were found) a new checkpoint needs: the newest complete one's size, else an estimate from the
    parameter count (the weights, and fp32 master weights plus Adam's two moments: 12 bytes per parameter)."""
    done = latest(os.path.dirname(root))
    if done:
        return _size(done), "the size of the previous checkpoint"
    params = [(getattr(p, "ds_numel", p.numel()), p.element_size()) for p in engine.module.parameters()]
    return int(1.1 * sum(n * (size + 12) for n, size in params)), "estimated from the parameter count"


def _write_problem(error: Exception, where: str) -> str:
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left" in str(error) or "unexpected pos" in str(error):
        return f"no space left on the device of {where}"
    return f"{type(error).__name__} writing {where}: {str(error).splitlines()[0] if str(error) else ''}"


def save(
    engine, run_dir: str, step: int, method_state: dict, args, rank: int, final: bool, consumed: int, sampler
) -> bool:
    """Write a checkpoint to a temporary directory with every file's size and sha256, then rename it: a crash never
    leaves a partial step_* dir; older checkpoints are rotated only after the new one is complete. Every rank must hold
    the same step, method state and `consumed` (the prompts of the stream used: utils.rollouts) (checked here); beside
    rollout ranks a trainer's batches in flight go with it (`sampler`, utils/sampler.py: nothing where colocated).

    It is checked first that the disk has room for it. A checkpoint that cannot be written (no room, or a write error
    such as a full disk) leaves no partial directory behind; a periodic one is skipped with a warning naming the
    cause, the newest complete checkpoint and how much room it needs, and training goes on (False); a final one
    (`final`: the last step or a stop signal) is the same message as a one-line error.
    """
    state = json.dumps({"step": step, "method_state": method_state, "consumed": consumed}, sort_keys=True)
    states = _gather(state)
    if len(set(states)) > 1:
        raise RuntimeError(f"ranks disagree on the training state at step {step}: {sorted(set(states))}")
    root = os.path.join(run_dir, "checkpoints")
    done, tmp = os.path.join(root, f"step_{step:07d}"), os.path.join(root, f".tmp_step_{step:07d}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    need, how = needed_bytes(engine, root)
    free = shutil.disk_usage(root).free
    room = f"{free / 2**20:.0f} MB free in {root}, the checkpoint needs ~{need / 2**20:.0f} MB ({how})"
    problem = _first_problem(None if free >= need else f"not enough free space: {room}")
    if problem is None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        try:
            engine.save_checkpoint(tmp, tag="state")
        except (OSError, RuntimeError) as e:
            problem = _write_problem(e, tmp)
            # the other ranks wait in DeepSpeed's closing barrier (every collective of its save precedes the writes;
            # DeepSpeed 0.19.8 runtime/engine.py save_checkpoint): meet them there
            dist.barrier()
        if problem is None:
            try:
                rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
                torch.save({"state": state, **rng}, os.path.join(tmp, f"rng_rank{rank}.pt"))
                sampler.save_in_flight(tmp)  # beside rollout ranks: the batches in flight (--max-staleness)
            except (OSError, RuntimeError) as e:
                problem = _write_problem(e, tmp)
        problem = _first_problem(problem)
    if problem is None and rank == 0:
        try:
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(
                    {"step": step, "method_state": method_state, "consumed": consumed, "args": flat_args(args)}, f
                )
        except OSError as e:
            problem = _write_problem(e, tmp)
    problem = _first_problem(problem)
    if problem is None:  # every file written: each rank hashes a share, rank 0 records them all
        names = _files(tmp)
        share = {
            n: [os.path.getsize(os.path.join(tmp, n)), _sha256(os.path.join(tmp, n))]
            for n in names[rank :: dist.get_world_size()]
        }
        recorded = {n: v for part in _gather(share) for n, v in part.items()}
        if rank == 0:
            try:
                with open(os.path.join(tmp, CHECKSUMS), "w") as f:
                    json.dump(recorded, f, indent=0, sort_keys=True)
            except OSError as e:
                problem = _write_problem(e, tmp)
        problem = _first_problem(problem)
    if problem is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        newest = latest(run_dir) or "none yet"
        message = f"checkpoint of step {step} not written: {problem}; newest complete checkpoint: {newest}"
        if final:
            raise SystemExit(f"error: {message}")
        if rank == 0:
            print(f"warning: {message}; training goes on", file=sys.stderr)
        return False
    if rank == 0:
        replaced = os.path.join(root, f".old_step_{step:07d}")
        shutil.rmtree(replaced, ignore_errors=True)
        if os.path.exists(done):  # resumed from an older checkpoint: this step is written again
            os.replace(done, replaced)
        os.replace(tmp, done)
        for old in sorted(d for d in os.listdir(root) if d.startswith("step_"))[: -args.keep_checkpoints]:
            shutil.rmtree(os.path.join(root, old))
        shutil.rmtree(replaced, ignore_errors=True)
    dist.barrier()
    return True


def save_final(engine, tokenizer, run_dir: str, rank: int, tracker, stopped_at=None) -> None:
    """End of training: the trained policy in HF format under run_dir/final (loads in transformers and vLLM), or
    after a stop signal at step `stopped_at` the command that resumes; then wandb's end, on every rank together."""
    if stopped_at is not None:
        if rank == 0:
            print(f"stopped by signal after step {stopped_at}; resume with --resume {run_dir}")
    else:
        zero3 = engine.zero_optimization_stage() == 3  # every rank holds a shard: they gather the weights together
        state_dict = engine._zero3_consolidated_16bit_state_dict() if zero3 else engine.module.state_dict()
        if rank == 0:
            engine.module.save_pretrained(os.path.join(run_dir, "final"), state_dict=state_dict)
            tokenizer.save_pretrained(os.path.join(run_dir, "final"))
    tracker.finish()
    dist.barrier()
