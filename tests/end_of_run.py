"""Run by tests/test_rollout_ranks.py on 2 trainers and 1 rollout rank (--rollout-ranks 1), without a model: the end of
a run as the scripts end it (process.shutdown on the trainers; rollout_rank.serve's end after trainer 0's stop),
then, at the interpreter's exit, each rank prints how many gloo worker threads it still has. The rollout rank's engine
is a stand-in: what is tested is the teardown of the groups between the worlds, not vLLM."""

import atexit
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from utils import distributed, process, rollout_rank, sampler  # noqa: E402
from utils.split_launch import SplitLaunch  # noqa: E402


def gloo_workers() -> int:
    """c10d ProcessGroupGloo's worker threads in this process."""
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return names.count("pt_gloo_runloop")


atexit.register(lambda: print(f"gloo workers at exit: {gloo_workers()}", flush=True))
launch = SplitLaunch(1)
distributed.init_distributed(launch)
args = SimpleNamespace(max_staleness=1, vllm_tensor_parallel_size=1, group_size=2)
llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None)))  # close_engine's
if launch.serving:  # until trainer 0's stop, then ends
    rollout_rank.make_sampler = lambda *a: sampler.Sampler(llm, args)
    raise SystemExit(rollout_rank.serve(launch, args, None, [], 1))
process.shutdown(sampler.RolloutRankSampler(launch.make_client(args.max_staleness), args), launch)  # the trainers
