"""Every process group of a launch fails a collective after one timeout, utils/distributed.TIMEOUT (issue 57): the
trainers' world beside rollout ranks, the colocated world, the vLLM engines' tensor-parallel groups, DeepSpeed's
data-parallel group, the groups between the worlds, and their stores. Before, the worlds and the groups made without a
timeout kept their library's default (10 minutes for NCCL), which a generation round or a 32B save outlasts while the
other ranks wait in a collective."""

import os

import pytest
from launch import CPU_ENV, ROOT, free_port, run_python

from utils.distributed import TIMEOUT

pytestmark = pytest.mark.launches  # every test here launches a run (conftest.py)


@pytest.mark.parametrize(
    "nproc, rollout_ranks, expected",
    [
        # colocated engines, 2 ranks sharing one (--vllm-tensor-parallel-size 2)
        (2, 0, {r: {"world", "tensor-parallel", "deepspeed-data-parallel"} for r in range(2)}),
        # 2 trainers, 2 rollout ranks sharing one tensor-parallel engine
        (
            4,
            2,
            {
                0: {"world", "deepspeed-data-parallel", "bridge", "link", "weights"},
                1: {"world", "deepspeed-data-parallel", "bridge"},
                2: {"world", "tensor-parallel", "bridge", "link", "weights"},
                3: {"world", "tensor-parallel", "bridge", "link", "weights"},
            },
        ),
    ],
)
def test_every_process_group_has_the_one_timeout(nproc, rollout_ranks, expected):
    env = {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port())}
    argv = [os.path.join(ROOT, "tests", "group_timeouts.py"), str(rollout_ranks), "2"]
    proc = run_python(argv, env, nproc=nproc, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {r: {} for r in range(nproc)}
    for line in proc.stdout.splitlines():
        if line.startswith("rank "):
            _, rank, _, name, seconds = line.split()
            seen[int(rank)][name] = float(seconds)
    for rank, names in expected.items():
        assert names | {f"store-of-{n}" for n in names if n not in ("bridge", "link", "weights")} == set(seen[rank])
        assert seen[rank] == dict.fromkeys(seen[rank], TIMEOUT.total_seconds()), (rank, seen[rank])
