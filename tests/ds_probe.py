"""Run by tests/test_deepspeed.py under torchrun on CPU: the policy's DeepSpeed config and ZeRO-3 loading in the real
DeepSpeed engine; `ds_probe.py CHECKS MODEL_DIR STAGE` runs the comma-separated checks in turn. `load`: the model is
built partitioned (each rank holds its shards from the start) with exactly the checkpoint's weights, and torch's
linear is left alone. `bf16`: the GPU config (bf16 weights) accumulates and reduces gradients in fp32, and the first
step allocates what utils.models.later_training_bytes assumes (Adam's moments, ZeRO-2's gradient partition). `bucket`:
with overlap_comm on (as on GPUs) and a reduce bucket smaller than the embedding, whose gradient then takes
DeepSpeed's oversized-gradient path (ZeRO-2), the same update as with the default bucket."""

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import deepspeed  # noqa: E402

from grpo_vanilla import Args  # noqa: E402
from utils import distributed, models  # noqa: E402
from utils.engine import make_args  # noqa: E402


def train(args, config, rank: int, sizes: list) -> tuple:
    """Two updates of two micro-batches each: (grad norm, gathered weights); reduced tensor sizes go to `sizes`."""
    torch.manual_seed(0)
    model = models.load_model(args, torch.float32, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    if hasattr(policy.optimizer, "average_tensor"):  # ZeRO-2's reduction of one bucket, or of one oversized gradient
        average = policy.optimizer.average_tensor
        policy.optimizer.average_tensor = lambda tensor, *a, **k: (
            sizes.append(tensor.numel()) or average(tensor, *a, **k)
        )
    ids = torch.arange(24).view(2, 12) + 10 * rank
    for _ in range(4):
        policy.backward(policy(input_ids=ids, labels=ids).loss)
        policy.step()
    with deepspeed.zero.GatheredParameters(list(policy.module.parameters()), enabled=args.zero_stage == 3):
        return policy.get_global_grad_norm(), [p.detach().clone() for p in policy.module.parameters()]


def check_load(args, model_dir: str, rank: int, world_size: int) -> None:
    linear = torch.nn.functional.linear
    model = models.load_model(args, torch.float32, models.deepspeed_config(args, False, 1))
    assert torch.nn.functional.linear is linear, "zero.Init replaced torch.nn.functional.linear for the process"
    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    for name, param in model.named_parameters():
        assert hasattr(param, "ds_id") and param.ds_tensor.numel() <= -(-param.ds_numel // world_size), name
        with deepspeed.zero.GatheredParameters([param]):
            assert torch.equal(param.data, saved[name]), name


def check_bucket(args, model_dir: str, rank: int, world_size: int) -> None:
    default, sizes = models.deepspeed_config(args, False, 2), []
    small = models.deepspeed_config(args, False, 2)
    small["zero_optimization"] |= {"reduce_bucket_size": 1000, "allgather_bucket_size": 1000, "overlap_comm": True}
    norm_a, weights_a = train(args, default, rank, [])
    norm_b, weights_b = train(args, small, rank, sizes)
    embedding = weights_a[0].numel()  # the first parameter: the (tied) embedding, 334 x 128
    assert embedding > 1000 and norm_a == norm_b, (embedding, norm_a, norm_b)
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))
    if args.zero_stage == 2:  # the embedding's gradient reduced on its own, outside the bucket
        assert embedding in sizes and max(sizes) == embedding, sizes


def check_bf16(args, model_dir: str, rank: int, world_size: int) -> None:
    """The config a GPU gets (bf16 weights), on CPU: under ZeRO-3 with DeepSpeed's persistence threshold, below which
    every tensor of the testbed model stays whole on each rank (tests/test_zero3_bf16.py partitions them in bf16)."""
    config = models.deepspeed_config(args, True, 2)
    model = models.load_model(args, torch.bfloat16, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    policy = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    assert policy.communication_data_type == torch.float32 and policy.get_data_types()[1] == torch.float32
    state = policy.optimizer.optimizer.state  # torch's AdamW over the fp32 partition
    moments = lambda: sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if t.dim())  # noqa: E731
    assert moments() == 0, "Adam's moments exist before the first step"  # what vLLM's start-up check cannot see
    n = sum(getattr(p, "ds_numel", p.numel()) for p in policy.module.parameters())
    ids = torch.arange(24).view(2, 12) + 10 * rank
    for micro in range(2):
        policy.backward(policy(input_ids=ids, labels=ids).loss)
        if micro == 1 and args.zero_stage == 2:  # the accumulated gradient partition, before the update consumes it
            grads = [t for ts in policy.optimizer.averaged_gradients.values() for t in ts if t is not None]
            assert {t.dtype for t in grads} == {torch.float32}, {t.dtype for t in grads}
            grad_bytes = sum(t.numel() * 4 for t in grads)  # 4 bytes x n / ranks (models.later_training_bytes)
            assert abs(grad_bytes - 4 * n / world_size) <= 0.02 * 4 * n / world_size, (grad_bytes, n)
        policy.step()
    assert policy.was_step_applied()
    # the first step created Adam's two fp32 moments of this rank's partition: 8 bytes x n / ranks
    assert abs(moments() - 8 * n / world_size) <= 0.02 * 8 * n / world_size, (moments(), n)


CHECKS = {"load": check_load, "bucket": check_bucket, "bf16": check_bf16}


def main(modes: str, model_dir: str, stage: int) -> None:
    """The comma-separated checks in turn, in one pair of processes (`load` first: it checks process-wide state)."""
    rank, _, world_size, _, _ = distributed.init_distributed()
    args = make_args(Args, model_name_or_path=model_dir, zero_stage=stage, micro_batch_size=2)
    for mode in modes.split(","):
        CHECKS[mode](args, model_dir, rank, world_size)
        dist.barrier()
        if rank == 0:
            print(f"OK {mode} zero-{stage}", flush=True)
    dist.destroy_process_group()  # before exit: gloo's threads torn down at interpreter exit once aborted a rank


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
