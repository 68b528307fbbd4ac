"""The training process between its steps and at its end: the stop signal agreed by every rank, the heap handed back
to the system, the shutdown of the engine and the process groups."""

import ctypes
import signal
import time

import deepspeed.comm
import torch
import torch.distributed as dist


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


def shutdown(sampler, launch) -> None:
    """The end of a run: the sampler closed (utils/sampler.py: the vLLM engine shut down explicitly, or the rollout
    ranks told to stop), then the process groups it left, and with --rollout-ranks the two between the worlds
    (SplitLaunch.close)."""
    sampler.close()
    if dist.is_initialized():  # DeepSpeed's, which also drops its references to the groups (its data-parallel group)
        deepspeed.comm.destroy_process_group()  # deepspeed/comm/comm.py l. 187-196
    launch.close()  # their gloo threads joined before the interpreter's exit, which would abort one still busy
