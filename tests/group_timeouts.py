"""Run by tests/test_timeouts.py under several processes: `group_timeouts.py ROLLOUT_RANKS TP` starts the launch as
the scripts do (utils.distributed.init_distributed), makes the groups they make before training (the vLLM engines'
tensor-parallel groups, distributed.tensor_parallel_group; DeepSpeed's data-parallel group, which its engine takes in
deepspeed.initialize: deepspeed/runtime/engine.py l. 2162-2164), then prints one line per process group it belongs to
and per store, `timeout <what> <seconds>`: the timeout a collective (or a wait for a key) of it fails after."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepspeed.utils import groups  # noqa: E402

from utils import distributed  # noqa: E402
from utils.split_launch import SplitLaunch  # noqa: E402


def timeout(backend) -> float:
    """A c10d backend's timeout (torch 2.13: ProcessGroupGloo.options and ProcessGroupNCCL.options carry `_timeout`,
    which distributed_c10d._new_process_group_helper sets from the group's timeout)."""
    return backend.options._timeout.total_seconds()


rollout_ranks, tp = int(sys.argv[1]), int(sys.argv[2])
launch = SplitLaunch(rollout_ranks)
rank, _, _, device, _ = distributed.init_distributed(launch)
tp_group = distributed.tensor_parallel_group(tp, launch)
zero_group = None if launch.serving else groups._get_data_parallel_group()  # ZeRO's reductions and gathers
names = {dist.group.WORLD: "world", tp_group: "tensor-parallel", zero_group: "deepspeed-data-parallel"}
lines = []
for group, (_, store) in dist.distributed_c10d._world.pg_map.items():  # every group of this process's world
    name = names.get(group, "group-" + ",".join(map(str, dist.get_process_group_ranks(group))))
    lines.append(f"{name} {timeout(group._get_backend(torch.device(device.type)))}")
    lines.append(f"store-of-{name} {store.timeout.total_seconds()}")
for name in ("bridge", "link", "weights"):  # the groups between the worlds, made outside torch's registry
    if getattr(launch, name) is not None:
        lines.append(f"{name} {timeout(getattr(launch, name))}")
who = launch.global_rank if launch.rollouts else rank
sys.stdout.write("".join(f"rank {who} timeout {line}\n" for line in lines))  # one write: the ranks share the file
sys.stdout.flush()
launch.close()
dist.destroy_process_group()
