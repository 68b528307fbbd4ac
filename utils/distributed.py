"""Process setup and collectives, shared by the method scripts and utils/: torch.distributed through DeepSpeed (one
line, not a traceback, when a peer process is gone), sums and gathers over the ranks, the tensor-parallel groups of the
vLLM engines."""

import importlib
import os
import sys
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import groups

from .versions import too_old

TIMEOUT = timedelta(hours=2)
"""How long a collective, a message or a store key is waited for before the process fails, in every process group the
launch makes (here and in utils/split_launch.py): a generation round of a long-context recipe (trainer 0 waits in the
weight push while the other trainers wait in a collective), rank 0's save of a 32B model behind a barrier. torch's own
defaults are 10 minutes for NCCL, 30 for gloo (torch/distributed/distributed_c10d.py l. 1623), DeepSpeed's 10."""


def reason(error: Exception) -> str:
    """gloo's reason for a failed send or collective, without its source location and advice."""
    return str(error).splitlines()[0].split("] ")[-1].split(". ")[0] if str(error) else type(error).__name__


def init_distributed(launch=None):
    """(rank, local_rank, world_size, device, on_gpu) of this process, torch.distributed initialised through
    DeepSpeed. `launch`: its place in the launch (utils/split_launch.py SplitLaunch, started here before DeepSpeed);
    None: every process trains.

    Without a launcher (`python grpo_vanilla.py`) it is a world of one process. Beside rollout ranks (the launch's
    last `launch.rollouts` processes only generate) world_size counts the trainers, and a rollout rank's rank is its
    rank in the launch (>= world_size).
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
    rollouts = launch.rollouts if launch else 0
    if rollouts:  # two torch.distributed worlds: the trainers' and the rollout ranks'
        launch.start(accelerator.communication_backend_name(), device)
    serving = bool(rollouts) and launch.serving  # a rollout rank: its world has no ZeRO group
    # every group on TIMEOUT: DeepSpeed's default is 10 minutes (deepspeed/constants.py l. 19, comm/comm.py l. 848), and
    # a new_group given no timeout takes torch's default of its backend, not the world's (distributed_c10d.py l. 5982)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), timeout=TIMEOUT)
    if not serving:  # ZeRO's data-parallel group, a copy of the world that DeepSpeed makes without a timeout
        groups._WORLD_GROUP = dist.new_group(list(range(dist.get_world_size())), timeout=TIMEOUT)  # groups.py l. 734
    if world_size > 1:
        one_line_when_a_peer_is_gone(rank)
    return rank, local_rank, world_size - rollouts, device, on_gpu


def full_determinism(on: bool, on_gpu: bool) -> None:
    """--full-determinism (`on`; else nothing): the same seed gives the same bits on the same GPUs, in the trainer and
    the sampler.
    - torch's deterministic algorithms (torch 2.13 __init__.py l. 1388-1480): ops with a deterministic CUDA kernel use
      it, the sums of GSPO's and the sequence-level correction's index_add among them (l. 1428: index_add on CUDA acts
      deterministically); an op without one warns once, naming itself (warn_only: a warning in the log, not a crashed
      run), and the run is not bitwise repeatable then. Uninitialised memory is filled (l. 1476), at some cost.
    - cuBLAS with a fixed workspace, before its first handle: CUBLAS_WORKSPACE_CONFIG=:4096:8, the setting torch asks
      for with deterministic algorithms and vLLM sets in its batch-invariant mode (0.32
      model_executor/determinism/batch_invariant.py l. 1391-1396).
    - vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT, read when vLLM is imported: later, in utils/vllm_engine.py
      import_vllm): a request's logits do not depend on the other requests in its batch. vLLM registers them for
      aten's mm, addmm, matmul, linear, softmax, log_softmax, bmm and mean on CUDA for the whole process
      (batch_invariant.py l. 1347-1375, from its GPU worker: v1/worker/gpu_worker.py l. 1651), so the colocated
      trainer's matmuls run them too. GPU only: vLLM-CPU has no batch-invariant kernels, and CPU runs repeat anyway.
    Not pinned: NCCL's choice of reduction algorithm for DeepSpeed's gradients (by message size and topology: the same
    on the same GPUs and world size; vLLM pins NCCL's settings only for communicators made after its start)."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    if on_gpu:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")
"""gloo's and NCCL's words for a send or collective whose peer process has ended"""


def one_line_when_a_peer_is_gone(rank: int) -> None:
    """A process whose collective fails because another process of the launch has ended (killed, or stopped by its own
    error, which it printed) ends with one line, not torch.distributed's traceback of the collective; any other
    uncaught exception keeps its traceback."""
    previous = sys.excepthook  # torch.distributed's: each line prefixed with [rank<n>]

    def hook(kind, error, traceback):
        if isinstance(error, RuntimeError) and any(words in str(error) for words in PEER_GONE):
            why = reason(error)
            print(f"error: another process of the launch has ended ({why}); rank {rank} stops too", file=sys.stderr)
        else:
            previous(kind, error, traceback)

    sys.excepthook = hook


def all_reduce_sums(values: dict, device) -> dict:
    """Sum every value (a number, or a one-element tensor on the device) over all ranks, keys in a fixed order on
    every rank: one collective and one read of the results, so statistics can stay on the device until then."""
    keys = sorted(values)

    def on_device(value):  # a number filled in on the device: not a copy from the host (each waits for a GPU)
        if isinstance(value, torch.Tensor):
            return value.to(device, torch.float64).reshape(())
        return torch.full((), value, dtype=torch.float64, device=device)

    tensor = torch.stack([on_device(values[k]) for k in keys])
    dist.all_reduce(tensor)
    return dict(zip(keys, tensor.tolist()))


def gather_ranks(x: torch.Tensor):
    """Concatenate x (any first-dim length) over all ranks in rank order; also return where this rank's rows start."""
    size = torch.full((1,), x.shape[0], device=x.device)  # filled in on the device: not a copy from the host
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    sizes = [int(n) for n in sizes]
    parts = [x.new_empty((max(sizes), *x.shape[1:])) for _ in sizes]
    dist.all_gather(parts, torch.cat([x, x.new_zeros((max(sizes) - x.shape[0], *x.shape[1:]))]))
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]), sum(sizes[: dist.get_rank()])


def tensor_parallel_group(tp: int, launch):
    """This rank's process group of the tp consecutive ranks that share one vLLM engine (None when tp is 1, and on
    trainers beside rollout ranks); every rank creates every group, in the same order, as torch.distributed requires."""
    if tp == 1 or launch.trains:
        return None
    made = [dist.new_group(list(range(g, g + tp)), timeout=TIMEOUT) for g in range(0, dist.get_world_size(), tp)]
    return made[dist.get_rank() // tp]
