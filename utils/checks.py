"""The shared flags' checks: an impossible setting stops the run at start with one line naming the flag."""

import torch


def check_args(args, world_size: int, method_checks=()) -> None:
    """Reject impossible settings of the shared flags, then the (ok, message) `method_checks`, with one line naming
    the flag: a SystemExit "error: ..." for the first that fails."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise SystemExit(f"error: {message}")

    def flag(name: str) -> str:
        return f"--{name.replace('_', '-')}"

    at_least = {
        "group_size": 2,
        "total_steps": 1,
        "num_prompts_per_step": 1,
        "max_prompt_length": 1,
        "max_response_length": 1,
        "warmup_steps": 0,
        "weight_decay": 0,
        "max_bad_steps": 1,
        "kl_coef": 0,
        "num_mini_batches": 1,
        "num_epochs": 1,
        "micro_batch_size": 1,
        "logprob_chunk_size": 1,
        "eval_every": 0,
        "eval_num_prompts": 1,
        "eval_samples": 0,
        "save_every": 0,
        "keep_checkpoints": 1,
        "grading_workers": 0,
    }
    for name, low in at_least.items():
        check(getattr(args, name) >= low, f"{flag(name)} must be >= {low} (got {getattr(args, name)})")
    for name in ("temperature", "learning_rate", "max_grad_norm", "clip_eps_low", "clip_eps_high"):
        check(getattr(args, name) > 0, f"{flag(name)} must be > 0 (got {getattr(args, name)})")
    check(
        args.vllm_is_cap == 0 or args.vllm_is_cap >= 1,
        f"--vllm-is-cap must be 0 (off) or >= 1 (got {args.vllm_is_cap}): below 1 it scales down matching tokens too",
    )
    check(
        0 <= args.vllm_is_min <= 1,
        f"--vllm-is-min must be in [0, 1] (got {args.vllm_is_min}): above 1 it moves or drops matching tokens too",
    )
    tp, engines = args.vllm_tensor_parallel_size, args.rollout_ranks or world_size  # the engines' ranks
    check(args.use_vllm or tp == 1, "--vllm-tensor-parallel-size > 1 needs vLLM (drop --no-use-vllm)")
    check(
        tp >= 1 and engines % tp == 0,
        f"--vllm-tensor-parallel-size ({tp}) must divide the "
        + (f"rollout ranks ({engines})" if args.rollout_ranks else f"world size ({world_size})"),
    )
    check(args.rollout_ranks >= 0, f"--rollout-ranks must be >= 0 (got {args.rollout_ranks})")
    check(args.use_vllm or not args.rollout_ranks, "--rollout-ranks runs vLLM engines: drop --no-use-vllm")
    check(args.max_staleness >= 0, f"--max-staleness must be >= 0 (got {args.max_staleness})")
    check(
        args.rollout_ranks or not args.max_staleness,
        "--max-staleness needs --rollout-ranks (colocated engines generate between the updates)",
    )
    check(
        args.top_p == 1,
        f"--top-p {args.top_p}: the loss's log-probs and entropy are of the full softmax, so the "
        "samples must be too; keep 1 (benchmarks/eval.py evaluates with nucleus sampling)",
    )
    check(args.zero_stage in (2, 3), f"--zero-stage must be 2 or 3 (got {args.zero_stage})")
    check(args.vllm_sleep_level in (0, 1, 2), f"--vllm-sleep-level must be 0, 1 or 2 (got {args.vllm_sleep_level})")
    check(0 < args.vllm_gpu_memory_utilization <= 1, "--vllm-gpu-memory-utilization must be in (0, 1]")
    check(args.vllm_kv_cache_memory >= 0, f"--vllm-kv-cache-memory must be >= 0 GiB (got {args.vllm_kv_cache_memory})")
    shards = args.num_mini_batches * world_size
    check(
        args.num_prompts_per_step % shards == 0,
        f"--num-prompts-per-step ({args.num_prompts_per_step}) must be "
        f"divisible by --num-mini-batches x world size ({args.num_mini_batches} x {world_size})",
    )
    local_sequences = args.num_prompts_per_step // shards * args.group_size
    check(
        local_sequences % args.micro_batch_size == 0,
        f"--micro-batch-size ({args.micro_batch_size}) must divide the "
        f"sequences per rank and mini-batch ({local_sequences} = prompts per step / (mini-batches x world size) x "
        "group size)",
    )
    longest = args.max_prompt_length + args.max_response_length
    check(
        args.max_tokens_per_micro_batch == 0 or args.max_tokens_per_micro_batch >= longest,
        f"--max-tokens-per-micro-batch ({args.max_tokens_per_micro_batch}) must be 0 or hold the longest sequence, "
        f"--max-prompt-length + --max-response-length = {longest}",
    )
    check(
        0 <= args.top_entropy_quantile <= 1,
        f"--top-entropy-quantile must be in [0, 1] (got {args.top_entropy_quantile}): the fraction of tokens trained",
    )
    check(args.max_gen_batches >= 0, f"--max-gen-batches must be >= 0 (0: no limit; got {args.max_gen_batches})")
    check(
        0 <= args.overlong_buffer_len < args.max_response_length,
        f"--overlong-buffer-len must be in [0, --max-response-length) (got {args.overlong_buffer_len})",
    )
    check(
        args.overlong_penalty_factor >= 0,
        f"--overlong-penalty-factor must be >= 0 (got {args.overlong_penalty_factor})",
    )
    gpu = torch.cuda.is_available()  # bf16, the GPUs' default (utils.models.train_dtype), native from Ampere on
    # (torch 2.13 cuda/__init__.py l. 191: is_bf16_supported, including_emulation=False: compute capability >= 8.0)
    check(
        not gpu or args.dtype == "float32" or torch.cuda.is_bf16_supported(including_emulation=False),
        f"--dtype {args.dtype}: this GPU has no bf16 (compute capability < 8.0, before Ampere); pass --dtype float32",
    )
    for ok, message in method_checks:
        check(ok, message)
