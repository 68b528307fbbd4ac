"""Run a method script with a fault injected into a real library call: how the tests crash or poison a run.

    GRPO_FAULT=<fault>:<n>[:<rank>] python tests/inject.py grpo_vanilla.py [flags]   (or under torch.distributed.run)

Faults, at the n-th call (from 1; "<n>+": that call and every later one) on `rank` (default: every rank):
    nan-loss       DeepSpeedEngine.backward receives a NaN loss (a numerical fault on that rank only)
    kill-generate  SIGKILL when generation starts (vLLM's LLM.generate, or HF generate with --no-use-vllm)
    kill-step      SIGKILL in an optimizer step (DeepSpeedEngine.step at a gradient-accumulation boundary)
    kill-save      SIGKILL in a checkpoint write (after the engine state, before the RNG state and the rename)
    disk-full      a checkpoint's engine-state file is cut at 1000 bytes and its torch.save raises ENOSPC (the disk
                   filling during a checkpoint write)
    sampler-ratio  vLLM's LLM.generate reports every sampled token's log-prob log($GRPO_RATIO) lower than it is, so
                   that pi_trainer / pi_vllm = $GRPO_RATIO (a sampler that disagrees with the trainer)
"""

import errno
import math
import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def patch(owner, name, fault, n, rank, every, when=lambda *a, **k: True, after=None):
    """Wrap owner.name so that its n-th matching call (and every later one if `every`) on `rank` applies `fault` to
    its arguments (or `after` to its result)."""
    original, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        hit = False
        if (rank is None or int(os.environ.get("RANK", "0")) == rank) and when(*args, **kwargs):
            calls[0] += 1
            hit = calls[0] == n or (every and calls[0] > n)
            if hit and fault is not None:
                args, kwargs = fault(args, kwargs)
        result = original(*args, **kwargs)
        return after(result) if hit and after is not None else result

    setattr(owner, name, wrapper)


def kill(args, kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def disk_full(args, kwargs):
    obj, path, *_ = args
    with open(path, "wb") as f:
        f.write(b"\0" * 1000)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def lower_logprobs(outputs):
    ratio = float(os.environ["GRPO_RATIO"])
    for completion in (c for o in outputs for c in o.outputs):
        for position in completion.logprobs or []:
            for logprob in position.values():
                logprob.logprob -= math.log(ratio)
    return outputs


def nan_loss(args, kwargs):
    engine, loss, *rest = args
    return (engine, loss * float("nan"), *rest), kwargs


if __name__ == "__main__":
    fault, n, *rank = os.environ["GRPO_FAULT"].split(":")
    n, every, rank = int(n.rstrip("+")), n.endswith("+"), int(rank[0]) if rank else None
    from deepspeed.runtime.engine import DeepSpeedEngine

    if fault == "nan-loss":
        patch(DeepSpeedEngine, "backward", nan_loss, n, rank, every)
    elif fault == "kill-step":
        patch(
            DeepSpeedEngine,
            "step",
            kill,
            n,
            rank,
            every,
            when=lambda engine, *a, **k: engine.is_gradient_accumulation_boundary(),
        )
    elif fault == "kill-save":
        import torch

        patch(torch, "save", kill, n, rank, every, when=lambda obj, path, *a, **k: "rng_rank" in str(path))
    elif fault == "disk-full":
        import torch

        patch(torch, "save", disk_full, n, rank, every, when=lambda obj, path, *a, **k: "_states.pt" in str(path))
    elif fault == "kill-generate":
        if "--no-use-vllm" in sys.argv:
            from transformers.generation.utils import GenerationMixin as owner
        else:
            from vllm import LLM as owner
        patch(owner, "generate", kill, n, rank, every)
    elif fault == "sampler-ratio":
        from vllm import LLM

        patch(LLM, "generate", None, n, rank, every, after=lower_logprobs)
    else:
        raise SystemExit(f"error: unknown GRPO_FAULT {fault!r}")
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, ROOT)
    runpy.run_path(script, run_name="__main__")
