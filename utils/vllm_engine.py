"""The colocated vLLM engine of a rank (behind utils/sampler.py's Sampler): its start (import, GPU memory check, the CPU
shims), the weight push from the DeepSpeed policy, and its shutdown."""

import atexit
import gc
import os
import time
import weakref

import deepspeed
import torch
import torch.distributed as dist

from .distributed import TIMEOUT
from .models import later_training_bytes, train_dtype


def import_vllm():
    """vLLM's LLM class, its engine in this process (no engine-core subprocess), or a one-line error without vLLM.
    The objects alive now (modules, the policy) are frozen out of the cyclic garbage collector's reach: vLLM's start-up
    collects the whole heap six times (model loading, the cache profiling, its own gc.freeze), ~2 s of a CPU start.
    The heap is collected first: gc.freeze moves every object the collector tracks to the permanent generation,
    unreachable cycles too, which no later collection frees (not vLLM's before its memory snapshot either: GPU memory
    such a cycle holds would stay taken for the whole run). They are unfrozen at exit (the engine's shutdown does it
    too): an error exit then ends with its one line, not with nanobind's report of the objects a frozen heap leaves
    behind."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM
    except ImportError:
        raise SystemExit("error: vLLM is not installed; install it (requirements.txt) or pass --no-use-vllm")
    gc.collect()  # garbage frozen with the rest would live to the end: cycles holding tensors (GPU memory) included
    gc.freeze()
    atexit.register(gc.unfreeze)
    return LLM


VLLM_TP_COMMUNICATORS = 2**30
"""Bytes vLLM 0.33 allocates for a tensor-parallel group (--vllm-tensor-parallel-size > 1) before its own memory
check, which therefore needs them free on top of its budget (vllm/v1/worker/gpu_worker.py l. 504-510, then 532-544):
the group's NCCL communicator (vllm/distributed/device_communicators/cuda_communicator.py l. 108; NCCL's buffers,
0.5-0.7 GB on 2-4 NVLink GPUs, NVIDIA/nccl#964), custom all-reduce's IPC buffers (custom_all_reduce.py l. 296-317: up to
2 x 64 MiB + 8 MiB at TP 2 on an H100, all_reduce_utils.py l. 31) and torch symmetric memory (symm_mem.py l. 92,
64 MiB at TP 2 on an H100, all_reduce_utils.py l. 58). None at TP 1: vLLM's groups of one rank get no device
communicator (vllm/distributed/parallel_state.py l. 550)."""


def create_cublas_handles(dtype=torch.bfloat16) -> None:
    """cuBLAS and cuBLASLt handles of this GPU, created as vLLM 0.33 creates them before its memory snapshot
    (vllm/v1/worker/gpu_worker.py l. 526-529: mm uses cuBLAS, linear with a bias cuBLASLt), so that the memory they take
    outside PyTorch's allocator is gone before check_vllm_memory measures, as it is when vLLM does."""
    x = torch.ones(16, 16, dtype=dtype, device=torch.cuda.current_device())
    torch.mm(x, x)
    torch.nn.functional.linear(x, x, x[0])


def check_vllm_memory(args, on_gpu: bool, policy=None) -> None:
    """A one-line error, before vLLM starts, when its memory budget is not free. vLLM's start-up check (0.32-0.33,
    vllm/v1/worker/utils.py request_memory) asks that --vllm-gpu-memory-utilization x the GPU's total memory be free
    at that moment, memory this process already holds included: the engine starts after the DeepSpeed engine, whose
    weights (and ZeRO-2's fp32 master partition) are resident by then, while its optimizer states and gradient buffers
    are allocated at the first step, when a sleeping engine has released its memory; it maps its whole budget back on
    every wake (vllm/device_allocator/cumem.py), so the budget must leave room for them too (later_training_bytes of
    `policy`, the DeepSpeed engine: the hint, and a warning when the budget leaves too little). vLLM measures after
    allocating its cuBLAS handles (created here first, create_cublas_handles) and its tensor-parallel communicators
    (VLLM_TP_COMMUNICATORS, counted as already taken): without them a budget within ~1 GB of the free memory passed
    here and failed in vLLM's traceback."""
    if not on_gpu:
        return
    create_cublas_handles()
    torch.cuda.empty_cache()  # as vLLM does before its snapshot: cached but unused blocks count as free
    free, total = torch.cuda.mem_get_info()
    fraction, gib = args.vllm_gpu_memory_utilization, 2**30
    ahead = VLLM_TP_COMMUNICATORS if args.vllm_tensor_parallel_size > 1 else 0  # vLLM's, before its own check
    later, assumed = 0, "nothing for the training state DeepSpeed allocates at the first step (no policy given)"
    if policy is not None:
        sizes = [getattr(p, "ds_numel", p.numel()) for p in policy.module.parameters()]  # ZeRO-3: the full size
        later = later_training_bytes(sum(sizes), max(sizes), dist.get_world_size(), args.offload)
        assumed = (
            f"{later / gib:.1f} GiB left for what DeepSpeed allocates at the first step: Adam's fp32 moments and the "
            f"fp32 gradient partition (12 bytes x {sum(sizes) / 1e9:.2f}B parameters / {dist.get_world_size()} ranks"
            f"{', on the CPU with --offload' if args.offload else ''}), 2 fp32 reduce buckets, the largest "
            f"parameter's fp32 gradient; activations not counted"
        )
    if ahead:
        assumed += f"; {ahead / gib:.1f} GiB for vLLM's tensor-parallel communicators"
    hint = f"lower it to at most {(free - ahead - later) / total - 0.02:.2f} ({assumed})"
    if free - ahead < fraction * total:
        raise SystemExit(
            f"error: --vllm-gpu-memory-utilization {fraction} asks for {fraction * total / gib:.1f} GiB of the GPU's "
            f"{total / gib:.1f} GiB, but {free / gib:.1f} GiB are free after the DeepSpeed engine"
            f"{f' and {ahead / gib:.1f} GiB go to the communicators vLLM creates first' if ahead else ''}: {hint}, or "
            f"make the policy smaller per GPU (--zero-stage 3, --offload)"
        )
    if free - ahead - later < fraction * total and dist.get_rank() == 0:
        print(
            f"warning: --vllm-gpu-memory-utilization {fraction} ({fraction * total / gib:.1f} GiB) is free now, but "
            f"the first wake after training may run out of memory: {hint}"
        )


def prepare_vllm_cpu(kv_cache_gib: float = 0.0) -> None:
    """Before a vLLM-CPU engine starts (CPU-only shims; GPU engines need none): keep plain linear layers
    (keep_vllm_cpu_weights); name tensor-parallel shared memory after this job (name_vllm_cpu_shm); with a KV cache
    size given (kv_cache_memory_bytes), drop VLLM_CPU_KVCACHE_SPACE, which vLLM-CPU 0.32-0.33 would take over it
    (vllm/platforms/cpu.py l. 323-327) and which counts whole GiB only."""
    keep_vllm_cpu_weights()
    name_vllm_cpu_shm()
    if kv_cache_gib:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def keep_vllm_cpu_weights() -> None:
    """vLLM-CPU repacks linear weights and frees the originals, so load_weights cannot update them later: keep plain
    linear layers (a CPU-only shim; GPU engines take new weights as they are)."""
    import vllm.model_executor.layers.utils as vllm_layer_utils

    repack = vllm_layer_utils.dispatch_cpu_unquantized_gemm

    def keep_weights(layer, remove_weight):
        if layer.weight.ndim != 2:
            return repack(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    vllm_layer_utils.dispatch_cpu_unquantized_gemm = keep_weights


def name_vllm_cpu_shm() -> None:
    """vLLM-CPU names a tensor-parallel engine's shared-memory segments after its init method, "env://" under the
    external launcher (vllm/v1/worker/cpu_worker.py l. 148, cpu_communicator.py make_group_name): every job on the
    machine would create /dev/shm/-tp:0-[0-1]-cpushm_0, so a second job at the same time, or the segments of a killed
    job, stop the engine with "create shm in SHMManager failed. errno: 17". Name them after this job instead (rank 0's
    pid and start time, the same on every rank). A CPU-only shim: GPU engines communicate through NCCL."""
    from vllm.distributed.device_communicators import cpu_communicator

    job = [f"grpo-{os.getpid()}-{time.time_ns()}"]
    dist.broadcast_object_list(job)
    vllm_name = cpu_communicator._CPUSHMDistributed.make_group_name
    cpu_communicator._CPUSHMDistributed.make_group_name = staticmethod(
        lambda communicator: job[0] + vllm_name(communicator).replace("/", "")  # one name, no inner slash
    )


def start_engine(args, rank: int, on_gpu: bool, policy, serving: bool = False):
    """This process's part of a vLLM engine in the torch.distributed world (external launcher): its own engine with
    --vllm-tensor-parallel-size 1, else one shard of its group's engine (vLLM forms groups of consecutive ranks);
    `serving`: a rollout rank's (utils/split_launch.py)."""
    LLM = import_vllm()
    check_vllm_memory(args, on_gpu, policy)  # its budget is free now, with room for the training state: or why not
    if not on_gpu:
        prepare_vllm_cpu(args.vllm_kv_cache_memory)  # plain weights, which push_weights can update; cache size
    return LLM(
        model=args.model_name_or_path,
        dtype=str(train_dtype(args, on_gpu)).removeprefix("torch."),  # the policy's: bf16 on GPUs
        # the output head's logits in the trainer's dtype (--head-dtype; vLLM's default is the weights' dtype for a
        # generation model: 0.32 config/model.py l. 2503-2522)
        hf_overrides={"head_dtype": args.head_dtype},
        max_model_len=args.max_prompt_length + args.max_response_length,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        kv_cache_memory_bytes=int(args.vllm_kv_cache_memory * 2**30) or None,
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        seed=args.seed + rank // args.vllm_tensor_parallel_size,  # the ranks of an engine must agree
        enable_prefix_caching=True,
        enforce_eager=not on_gpu,  # on CPU, graph compilation costs more start-up than it saves
        enable_chunked_prefill=on_gpu,  # vLLM-CPU fails to rewind a seeded sampler after a partial prefill
        # a rollout rank's engine never sleeps (utils/rollout_rank.py): sleep mode would only route its weights and
        # KV cache through vLLM's CuMem allocator (0.33 config/model.py l. 666-673, v1/worker/gpu_worker.py l. 396-417)
        enable_sleep_mode=on_gpu and args.vllm_sleep_level > 0 and not serving,
        logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes them
        # vLLM's own groups, else torch's defaults (NCCL 10 min) whatever the world's (0.32-0.33 config/parallel.py
        # l. 360-368, distributed/parallel_state.py l. 497-510): a trainer may wait in them through a long generation
        distributed_timeout_seconds=int(TIMEOUT.total_seconds()),
        cpu_distributed_timeout_seconds=int(TIMEOUT.total_seconds()),
    )


def push_groups(params: list) -> list:
    """Consecutive (name, parameter) pairs of `params` in groups of at most the largest parameter's bytes (ZeRO-3:
    full sizes): push_weights gathers and loads a group at once, so its peak is what one parameter at a time reached,
    with a gather and a load per group instead of per tensor. Made from names and shapes alone: every rank forms the
    same groups, in the same order (a ZeRO-3 gather is collective)."""
    sizes = [getattr(p, "ds_numel", p.numel()) * p.element_size() for _, p in params]
    budget, groups, group_bytes = max(sizes, default=0), [], 0
    for pair, size in zip(params, sizes):
        if not groups or group_bytes + size > budget:
            groups.append([])
            group_bytes = 0
        groups[-1].append(pair)
        group_bytes += size
    return groups


def push_weights(policy, sampler, zero_stage: int, wake: bool = False) -> None:
    """Copy the policy's current weights into the local vLLM sampler, a group of parameters at a time (push_groups;
    ZeRO-3: each group gathered at once), then check that every parameter of the engine was written (check_written);
    `wake`: the sampler sleeps, so first wake its weights, and afterwards its KV cache."""
    if wake:
        torch.cuda.empty_cache()  # the engine re-maps its memory outside PyTorch's cache: hand the cached blocks back
        sampler.wake_up(tags=["weights"])
    written = []
    for group in push_groups(list(policy.module.named_parameters())):
        with deepspeed.zero.GatheredParameters([param for _, param in group], enabled=zero_stage == 3):
            load_group(sampler, group, written)
    check_written(sampler, written)
    sampler.reset_prefix_cache()
    if wake:
        sampler.wake_up(tags=["kv_cache"])


def load_group(llm, group: list, written: list) -> None:
    """One load_weights call per worker of `llm` (LLM.apply_model: a list, one entry per worker) for the (name, tensor)
    pairs of `group`; adds the names of the engine parameters it wrote to `written` (a set per worker). vLLM 0.32's
    load_weights returns the engine's own names of what it loaded (vllm/model_executor/models/utils.py l. 345, 397-400,
    476-478: after its mapper renamed q/k/v into qkv_proj and gate/up into gate_up_proj, l. 473; a tied lm_head under
    the embedding's name, l. 202-212), as named_parameters() names them. A name it does not know raises its ValueError
    (l. 442-448, 318-322), turned into one line naming the pushed name (unknown_name)."""
    try:
        # the list made inside the call: no reference to a ZeRO-3 gathered tensor outlives the gather
        loaded = llm.apply_model(lambda model: model.load_weights([(n, p.data) for n, p in group]))
    except (ValueError, KeyError) as e:
        raise SystemExit(unknown_name(llm, group, e))
    for worker, names in enumerate(loaded):
        if worker == len(written):
            written.append(set())
        written[worker] |= names


def unknown_name(llm, group: list, error: Exception) -> str:
    """The one line of a push that named a parameter the engine does not have: found by loading the group's names one
    at a time (the run stops here, so the cost does not matter), with the first sentence of vLLM's reason."""
    unknown = []
    for name, param in group:
        try:
            llm.apply_model(lambda model: model.load_weights([(name, param.data)]))  # noqa: B023 (called at once)
        except (ValueError, KeyError):
            unknown.append(name)
    reason = str(error).split(". ")[0].strip("'\"")  # vLLM's next sentence lists every parameter of the module
    return (
        f"error: the weight push sends {', '.join(unknown) or 'a group of parameters'}, which the vLLM engine cannot "
        f"load ({reason}): the policy's parameter names are not the ones vLLM's loader knows (renamed between the "
        f"transformers and vLLM versions?)"
    )


_ENGINE_NAMES = weakref.WeakKeyDictionary()
"""An engine's parameter names per worker, computed at its first push (the names do not change between pushes)."""


def check_written(llm, written: list) -> None:
    """A one-line error unless a push wrote every parameter of the engine's model (`written`, from load_group): one
    left out keeps its old value, so the engine would sample from an older policy than the loss assumes. A parameter
    vLLM fuses from parts (qkv_proj from q/k/v) counts as written when one of its parts was: vLLM returns one name for
    all of them. Nothing to check with no worker here (a trainer's RolloutClient: each rollout rank checks its own)."""
    if not written:
        return
    if llm not in _ENGINE_NAMES:
        _ENGINE_NAMES[llm] = llm.apply_model(lambda model: frozenset(n for n, _ in model.named_parameters()))
    for names, have in zip(_ENGINE_NAMES[llm], written):
        if missing := sorted(names - have):
            raise SystemExit(
                f"error: the weight push left {len(missing)} of the vLLM engine's {len(names)} parameters with their "
                f"old weights ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): it would sample from a "
                f"stale policy; no pushed tensor reaches them (left out of the push, or named so that vLLM's loader "
                f"skips them: renamed between the transformers and vLLM versions?)"
            )


def close_engine(llm) -> None:
    """Shut a vLLM engine down now, not when the last reference to it goes: vLLM 0.32-0.33's LLM has no shutdown(); its
    in-process engine core's (v1/engine/core_client.py InprocClient.shutdown, a finalizer: a second call, or the one at
    garbage collection, does nothing) frees its memory and its process groups, the default one included
    (distributed/parallel_state.py cleanup_dist_env_and_memory)."""
    llm.llm_engine.engine_core.shutdown()
