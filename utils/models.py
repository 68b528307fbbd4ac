"""The policy being trained: the HF model as a DeepSpeed engine (its config, ZeRO-3 loading, AdamW and the LR
schedule), the frozen reference policy, its float32 output head (--head-dtype), the output head's call count under
ZeRO-3, and HF generate (--no-use-vllm)."""

import copy
import math

import deepspeed
import torch
from transformers import AutoModelForCausalLM


def lr_lambda(args, updates_per_step: int):
    """Learning-rate multiplier per optimizer update: linear warm-up, then constant / linear / cosine decay."""

    def factor(update: int) -> float:
        step = update / updates_per_step
        if step < args.warmup_steps:
            return (step + 1) / (args.warmup_steps + 1)
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps))
        if args.lr_schedule == "linear":
            return 1.0 - progress
        if args.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


BUCKET_ELEMENTS = 50_000_000
"""ZeRO's gradient-reduction and ZeRO-2's all-gather buckets, in elements (DeepSpeed's default is 5e8): with
overlap_comm DeepSpeed keeps several buckets in flight (its docs: ~4.5x the bucket sizes), at fp32 communication
that is ~0.9 GB here instead of ~9 GB."""


def train_dtype(args, on_gpu: bool) -> torch.dtype:
    """The weights' dtype, --dtype: "auto" is bf16 on GPUs and fp32 on a CPU (the CPU tests); "bfloat16" on a CPU
    rehearses a GPU run's numerics (DeepSpeed's CPU accelerator takes bf16)."""
    if args.dtype == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]


def deepspeed_config(args, on_gpu: bool, grad_accum: int) -> dict:
    """The DeepSpeed config of the policy. With bf16 weights (train_dtype) gradients are accumulated over the
    micro-batches and reduced over the ranks in fp32 (DeepSpeed's default for both is the weights' dtype: up to 8
    micro-batches x 8 ranks of bf16 roundings per update at the defaults); on GPUs each bucket's reduction overlaps the
    rest of the backward pass (DeepSpeed turns overlap_comm on for ZeRO-3 only by default)."""
    offload = {"device": "cpu"} if args.offload else {"device": "none"}
    zero = {"stage": args.zero_stage, "offload_optimizer": offload, "reduce_bucket_size": BUCKET_ELEMENTS}
    if args.zero_stage == 3:
        zero |= {
            "offload_param": offload,
            "stage3_gather_16bit_weights_on_model_save": True,
            # zero.Init would replace torch.nn.functional.linear for the whole process (DeepSpeed 0.19.8
            # partition_parameters.py l. 411-419, never restored), and vLLM looks that name up on every matmul
            "memory_efficient_linear": False,
        }
        if not on_gpu:
            # every parameter partitioned: the CPU tests' tiny models are made of tensors below DeepSpeed's default
            # threshold (1e5 elements), which stay whole on every rank, so ZeRO-3 would partition nothing there. On
            # GPUs the default keeps the small ones (biases, norms) resident instead of gathering them every forward
            zero["stage3_param_persistence_threshold"] = 0
    else:
        zero["allgather_bucket_size"] = BUCKET_ELEMENTS
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": args.max_grad_norm,
        "bf16": {"enabled": train_dtype(args, on_gpu) == torch.bfloat16},
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        "zero_optimization": zero | {"overlap_comm": on_gpu},  # on CPU (gloo) there is no stream to overlap on
        "zero_force_ds_cpu_optimizer": False,  # torch AdamW: no compiled optimizer ops needed
        "steps_per_print": 10**9,
    }


_zero3_loading = None  # transformers reads it through a weak reference: it must outlive the from_pretrained calls


def load_model(args, dtype, ds_config: dict):
    """The HF model. Under ZeRO-3 it is built and filled shard by shard (transformers' DeepSpeed integration: every
    parameter is partitioned as it is created under deepspeed.zero.Init, then each layer is gathered, filled from the
    memory-mapped checkpoint on rank 0 and re-partitioned), so no rank holds the whole model in its own memory."""
    global _zero3_loading
    if args.zero_stage == 3 and _zero3_loading is None:
        from transformers.integrations import HfDeepSpeedConfig

        _zero3_loading = HfDeepSpeedConfig(ds_config)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, dtype=dtype, attn_implementation=args.attn_implementation
    )
    if args.zero_stage == 3:
        restore_buffers(model, dtype)
    if args.head_dtype == "float32" and dtype != torch.float32:
        fp32_head(model)
    return model


class Fp32Head(torch.autograd.Function):
    """logits = hidden @ weight.T in float32 from weights in a 16-bit dtype, without a float32 copy of the weight on a
    GPU: torch.mm's out_dtype accumulates into float32 (CUDA only: aten::mm.dtype has no CPU kernel in torch 2.13), as
    vLLM's fp32 head does (0.32-0.33 model_executor/layers/logits_processor.py l. 158-173); elsewhere both operands are
    cast, as vLLM does there too (l. 174-178). The backward runs in the weights' dtype: the gradient a bf16 head gets
    from bf16 logits, so only the forward's rounding changes."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.device.type == "cuda":  # the device, not is_cuda: tests/device_rehearsal.py answers is_cuda as a GPU
            logits = torch.mm(flat, weight.t(), out_dtype=torch.float32)
        else:
            logits = torch.mm(flat.float(), weight.float().t())
        return logits.reshape(*hidden.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype).reshape(-1, weight.shape[0])
        grad_hidden = (grad @ weight).reshape(hidden.shape) if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden.reshape(-1, hidden.shape[-1]) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight


class Fp32Linear(torch.nn.Linear):
    """An output head (torch.nn.Linear, no bias) whose logits are float32 (Fp32Head); its weight stays as it is."""

    def forward(self, hidden):
        return Fp32Head.apply(hidden, self.weight)


def fp32_head(model) -> None:
    """--head-dtype float32: the model's output head returns float32 logits, for the log-prob kernel and HF generate
    alike (vLLM's head gets the same setting: utils/vllm_engine.py). The module keeps its weight and its hooks (ZeRO-3
    gathers the weight on each call as before): only its class changes, so `print(model)` shows it."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise SystemExit(
            f"error: --head-dtype float32 needs an output head that is a torch.nn.Linear without a bias; "
            f"{type(model).__name__}'s is {type(head).__name__}: pass --head-dtype model"
        )
    head.__class__ = Fp32Linear


def restore_buffers(model, dtype) -> None:
    """Give every buffer of a model loaded under ZeRO-3 the dtype and value it has in a plain load. zero.Init casts
    every floating tensor made while the model is built to the training dtype (its wrappers of torch.arange, tensor,
    zeros, ones, full, empty, eye, randn and Tensor.__new__: DeepSpeed 0.19.8 runtime/zero/partition_parameters.py l.
    263-292, 637-672), so the rotary inv_freq that transformers computes in fp32 (torch.arange(...,
    dtype=torch.float): 5.19 models/qwen2/modeling_qwen2.py l. 83) is computed and kept in bf16, and the trainer
    rotates positions other than vLLM's. deepspeed.initialize leaves buffers as they are (0.19.8 runtime/engine.py l.
    2084-2088, 1870-1875: cast only with a buffer_dtype set): they are mended here, before it.

    The reference is the model built again outside zero.Init in the plain load's default dtype (transformers sets it
    to `dtype` while it builds: 5.19 modeling_utils.py l. 3738), parameters on the meta device (accelerate's
    init_empty_weights: no memory), buffers real. A non-persistent buffer (inv_freq, original_inv_freq, Gemma's
    embed_scale) takes the rebuilt tensor where its dtype or value differs. A persistent one holds the checkpoint's
    value, copied into the buffer as zero.Init made it (transformers 5.19 integrations/deepspeed.py l. 513-520; a plain
    load casts it to the buffer's dtype too: core_model_loading.py l. 1702); if zero.Init changed that dtype, the
    value was rounded on the way in and cannot be restored from it: an error names the buffer (Qwen2, Qwen3 and Llama
    have none)."""
    from accelerate import init_empty_weights

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with init_empty_weights(include_buffers=False):
            plain = type(model)(copy.deepcopy(model.config))
    finally:
        torch.set_default_dtype(default)
    plain_buffers = dict(plain.named_buffers(remove_duplicate=False))
    for name, buffer in model.named_buffers(remove_duplicate=False):  # a buffer shared by modules: under each name
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        reference = plain_buffers[name].to(buffer.device)
        if leaf not in module._non_persistent_buffers_set:
            if buffer.dtype != reference.dtype:
                raise ValueError(
                    f"ZeRO-3 loading made the persistent buffer {name} {buffer.dtype} (a plain load: "
                    f"{reference.dtype}); its checkpoint value was rounded to it and cannot be restored"
                )
        elif buffer.dtype != reference.dtype or not torch.equal(buffer, reference):
            module._buffers[leaf] = reference


def make_policy(args, on_gpu: bool, grad_accum: int, updates_per_step: int):
    """The policy being trained as a DeepSpeed engine (AdamW, the LR schedule), and the frozen reference policy
    (only with --kl-coef > 0)."""
    dtype = train_dtype(args, on_gpu)
    ds_config = deepspeed_config(args, on_gpu, grad_accum)
    model = load_model(args, dtype, ds_config)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, updates_per_step))
    policy, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    if args.kl_coef == 0:
        return policy, scheduler, None
    ref_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_optimization": {"stage": args.zero_stage if args.zero_stage == 3 else 0},
    }
    ref_policy = deepspeed.initialize(model=load_model(args, dtype, ds_config), config=ref_config)[0]
    ref_policy.eval()
    return policy, scheduler, ref_policy


def head_calls(args) -> int | None:
    """ZeRO-3 gathers the weights on every call, so every rank must call the output head equally often in each forward:
    the number of chunks of --logprob-chunk-size tokens of the longest batch (a token-budget training micro-batch, or
    --micro-batch-size sequences as evaluation forms them); None under ZeRO-2 (as many as a batch needs)."""
    micro_tokens = max(args.max_tokens_per_micro_batch, args.micro_batch_size * args.max_response_length)
    return math.ceil(micro_tokens / args.logprob_chunk_size) if args.zero_stage == 3 else None


def later_training_bytes(n_params: int, largest: int, world_size: int, offload: bool) -> int:
    """An estimate of the GPU memory per rank that DeepSpeed (0.19) allocates only at the first optimizer step, after
    vLLM's start-up check: torch's Adam creates its two fp32 moments lazily (8 bytes per parameter / ranks) and ZeRO
    its fp32 gradient partition at the accumulation boundary (4 / ranks), both on the CPU with --offload; two fp32
    reduce buckets (overlap_comm); the largest parameter's fp32 gradient in passing (the embedding). Activations are
    not counted (the engine sleeps while the policy trains)."""
    partitioned = 0 if offload else 12 * n_params / world_size
    return int(partitioned + 2 * 4 * BUCKET_ELEMENTS + 4 * largest)
