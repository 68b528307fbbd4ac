"""A run's life between its steps and at its end: the stop signal agreed by every rank, heap trimming, the stop
after consecutive non-finite gradients, and the shutdown of the engines and process groups."""

import ctypes
import os
import signal
import time

import deepspeed.comm
import torch
import torch.distributed as dist

from . import checkpoints


class StopSignal:
    """SIGTERM (schedulers send it before preemption) and SIGINT set a flag; the loop checkpoints, then exits. Beside
    rollout ranks a rollout rank's signal counts too (`sampler`: utils/sampler.py RolloutRankSampler)."""

    def __init__(self, sampler):
        self.requested, self.sampler = False, sampler
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum, frame):
        self.requested = True

    def agreed(self, device) -> bool:
        """Whether any rank got a signal (a collective: every rank calls it at the same point)."""
        flag = torch.tensor([float(self.requested or self.sampler.stop_requested())], device=device)
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


def record_update(policy, scheduler, grad_norms: list) -> int:
    """After an optimizer update: its global gradient norm (the same on every rank) appended to grad_norms, 0 returned;
    or, where a non-finite gradient on any rank made DeepSpeed skip it on every rank, the LR schedule stepped anyway
    (it follows the optimizer calls) and 1 returned."""
    if policy.was_step_applied():
        grad_norms.append(float(policy.get_global_grad_norm()))
        return 0
    scheduler.step()
    return 1


def check_bad_steps(bad_steps: int, skipped: int, max_bad_steps: int, run_dir: str, tracker) -> int:
    """The count of consecutive steps with a skipped update (a non-finite gradient: DeepSpeed skipped it on every
    rank, the weights are still finite), this step's `skipped` updates included; stops with one line at max_bad_steps,
    naming the newest checkpoint and the metrics."""
    bad_steps = bad_steps + 1 if skipped else 0
    if bad_steps >= max_bad_steps:
        raise SystemExit(
            f"error: {bad_steps} consecutive steps had a non-finite gradient (updates skipped, weights still "
            f"finite); newest checkpoint: {checkpoints.latest(run_dir)}; metrics: {tracker.path}"
        )
    return bad_steps


def shutdown(sampler, launch) -> None:
    """The end of a run: the sampler closed (utils/sampler.py: the vLLM engine shut down explicitly, or the rollout
    ranks told to stop), then the process groups it left, and with --rollout-ranks the two between the worlds
    (SplitLaunch.close)."""
    sampler.close()
    if dist.is_initialized():  # DeepSpeed's, which also drops its references to the groups (its data-parallel group)
        deepspeed.comm.destroy_process_group()  # deepspeed/comm/comm.py l. 187-196
    launch.close()  # their gloo threads joined before the interpreter's exit, which would abort one still busy


def finish(engine, tokenizer, run_dir: str, rank: int, tracker, stopped_at=None) -> None:
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
