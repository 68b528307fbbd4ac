"""The policy being trained: the HF model as a DeepSpeed engine (its config, ZeRO-3 loading, AdamW and the LR
schedule), the frozen reference policy, the output head's call count under ZeRO-3, and HF generate (--no-use-vllm)."""

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


def deepspeed_config(args, on_gpu: bool, grad_accum: int) -> dict:
    """The DeepSpeed config of the policy. On GPUs the weights are bf16 but gradients are accumulated over the
    micro-batches and reduced over the ranks in fp32 (DeepSpeed's default for both is the weights' dtype: up to 8
    micro-batches x 8 ranks of bf16 roundings per update at the defaults), and each bucket's reduction overlaps the
    rest of the backward pass (DeepSpeed turns overlap_comm on for ZeRO-3 only by default)."""
    offload = {"device": "cpu"} if args.offload else {"device": "none"}
    zero = {"stage": args.zero_stage, "offload_optimizer": offload, "reduce_bucket_size": BUCKET_ELEMENTS}
    if args.zero_stage == 3:
        zero |= {
            "offload_param": offload,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
            # zero.Init would replace torch.nn.functional.linear for the whole process (DeepSpeed 0.19.8
            # partition_parameters.py l. 411-419, never restored), and vLLM looks that name up on every matmul
            "memory_efficient_linear": False,
        }
    else:
        zero["allgather_bucket_size"] = BUCKET_ELEMENTS
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": args.max_grad_norm,
        "bf16": {"enabled": on_gpu},
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
    return AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, dtype=dtype, attn_implementation=args.attn_implementation
    )


def make_policy(args, on_gpu: bool, grad_accum: int, updates_per_step: int):
    """The policy being trained as a DeepSpeed engine (AdamW, the LR schedule), and the frozen reference policy
    (only with --kl-coef > 0)."""
    dtype = torch.bfloat16 if on_gpu else torch.float32
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
        "bf16": {"enabled": on_gpu},
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


def hf_generate(policy, tokenizer, prompts: list, n: int, greedy: bool, seed: int, args) -> list:
    """[(response ids, truncated)], n per prompt, prompt-major: HF generate on the DeepSpeed policy's module, one seeded
    left-padded batch (the fallback of the scripts' generate without a vLLM sampler: --no-use-vllm)."""
    torch.manual_seed(seed)
    width, pad, eos = max(len(p) for p in prompts), tokenizer.pad_token_id, tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts for _ in range(n)])
    starts = torch.tensor([width - len(p) for p in prompts for _ in range(n)])
    attention_mask = (torch.arange(width)[None] >= starts[:, None]).long()
    policy.module.eval()
    with torch.no_grad():
        out = policy.module.generate(
            input_ids=input_ids.to(policy.device),
            attention_mask=attention_mask.to(policy.device),
            max_new_tokens=args.max_response_length,
            do_sample=not greedy,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=0,
            pad_token_id=pad,
            eos_token_id=eos,
            synced_gpus=args.zero_stage == 3,
            use_cache=True,
        )
    policy.module.train()
    rows = out[:, width:].tolist()
    return [
        (row[: row.index(eos) + 1], False) if eos in row else (row, len(row) == args.max_response_length)
        for row in rows
    ]
