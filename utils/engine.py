"""The engine's flags of every method script: how and where a run runs, not what its method computes. Each script's
`Args` holds them as one field, `engine` (tyro prints them under their own --help heading and keeps every flag's name:
--zero-stage, --track, ...), and reads them as its own (`args.zero_stage`: Args.__getattr__), so that utils/, which
takes `args` as one namespace, and every command line are the same as when they were Args' own. flat_args: the flags as
one flat dict (args.json, the checkpoints' copy, wandb's config, resume's comparison)."""

from dataclasses import asdict, dataclass
from typing import Literal


@dataclass
class EngineArgs:
    """hardware, numerics, checkpoints and tracking: none changes what the method computes from its samples"""

    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    full_determinism: bool = False
    """bitwise-repeatable GPU runs, at a cost no GPU has measured yet (utils/distributed.py; CPU runs repeat anyway)"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "grpo-entropy"
    """the wandb's project name"""
    wandb_entity: str | None = None
    """the entity (team) of wandb's project"""
    wandb_group: str | None = None
    """the wandb run group (default: exp_name, i.e. the method)"""
    wandb_tags: tuple[str, ...] = ()
    """extra wandb tags, next to the method, the git commit and the comma-separated $WANDB_TAGS"""
    output_dir: str = "runs"
    """runs/<run_name>/ receives metrics.jsonl, args.json, checkpoints/ and final/"""
    local_rank: int = -1
    """set by the deepspeed launcher; the rank is read from the environment"""
    attn_implementation: str = "sdpa"
    """the policy's attention in transformers: sdpa, eager, or flash_attention_2 (GPUs, with flash-attn installed)"""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """the weights' and the sampler's dtype; auto: bfloat16 on GPUs, float32 on a CPU (bf16 there: `make test-bf16`)"""
    head_dtype: Literal["float32", "model"] = "float32"
    """the output head's logits in the trainer and in vLLM alike: float32 from bf16 weights, or the weights' dtype
    (model: the sampler's log-probs further from the trainer's, benchmarks/results/head_dtype.md)"""
    grading_workers: int = 0
    """reward-grading processes (0: this rank's share of the node's cores; 1: serial, in the training process)"""
    use_vllm: bool = True
    """generate with a colocated vLLM engine in every rank; `--no-use-vllm` uses HF generate"""
    vllm_gpu_memory_utilization: float = 0.5
    """fraction of GPU memory vLLM may take (weights + KV cache); it must be free when the engine starts"""
    vllm_kv_cache_memory: float = 0.0
    """GiB of KV cache per rank, instead of what the fraction above leaves (vLLM's kv_cache_memory_bytes; on a GPU the
    fraction must still be free at start); 0: vLLM's sizing. On a CPU it replaces VLLM_CPU_KVCACHE_SPACE (whole GiB)"""
    vllm_sleep_level: int = 2
    """GPU only: put the engine to sleep during training (0: never, 1: offload weights to host memory and back every
    step, 2: discard them: every parameter is pushed anew, and vLLM 0.33 saves and restores the model's buffers)"""
    vllm_tensor_parallel_size: int = 1
    """ranks per vLLM engine: each group of this many consecutive ranks shares one tensor-parallel engine"""
    rollout_ranks: int = 0
    """the last this many processes only generate, the others train (utils/split_launch.py); 0: colocated engines"""
    max_bad_steps: int = 3
    """abort after this many consecutive steps with a non-finite gradient (DeepSpeed skips them on every rank)"""
    micro_batch_size: int = 4
    """sequences per forward/backward on each rank (gradient accumulation fills the mini-batch)"""
    max_tokens_per_micro_batch: int = 0
    """instead of --micro-batch-size: micro-batches of at most this many tokens (prompt + response), as few as each
    rank's share of a mini-batch needs and as many on every rank; 0: --micro-batch-size sequences each"""
    padding_free: bool = False
    """each micro-batch's sequences in one row without padding, positions restarting per sequence (attention stays
    within each: flash-attention-2's varlen kernel, or a block-causal mask with sdpa/eager)"""
    logprob_chunk_size: int = 1024
    """tokens per chunk of the vocabulary projection; bounds the [tokens, vocab] temporaries"""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (2 or 3)"""
    offload: bool = False
    """offload optimizer state (and ZeRO-3 parameters) to CPU memory"""
    gradient_checkpointing: bool = True
    """recompute activations in the backward pass"""
    save_every: int = 50
    """save a resumable checkpoint every this many steps; 0 disables"""
    keep_checkpoints: int = 2
    """keep only the newest this many checkpoints"""
    resume: str | None = None
    """resume from a run directory (its newest complete checkpoint) or a checkpoint directory"""
    resume_allow_changes: bool = False
    """resume even if training settings differ from the checkpoint's (refused by default, naming them)"""


def flat_args(args) -> dict:
    """A script's Args as one flat dict of flags: the engine's beside the others, by their command-line names."""
    values = asdict(args)
    return {**{k: v for k, v in values.items() if k != "engine"}, **values.get("engine", {})}


def make_args(args_class, **flags):
    """A script's Args from flat flag values (tests, probes): the engine's go into its nested EngineArgs."""
    engine = {k: flags.pop(k) for k in list(flags) if k in EngineArgs.__dataclass_fields__}
    return args_class(**flags, engine=EngineArgs(**engine))
