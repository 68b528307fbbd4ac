#!/usr/bin/env bash
# verl's CISPO example (MiniMax-M1, arXiv 2506.13585; verl v0.9.0 examples/cispo_trainer/run_qwen3_8b_fsdp.sh, the loss
# verl 0.9.1's compute_policy_loss_cispo): Qwen3-8B, 1024 prompts x 5 samples per step, 4 updates, 2K response
# tokens, lr 1e-6, the weight clipped to [1 - 10, 1 + 0.2] (no lower bound), a k3 KL of 0.001 to the initial policy;
# plain GRPO beside it, and TRL's convention (the weight capped at 5, its ScaleRL recipe). Every setting beside
# theirs: docs/fidelity.md.
#
#   bash benchmarks/reproduce/cispo_qwen3_8b.sh               # one run after another
#   DRY_RUN=1 bash benchmarks/reproduce/cispo_qwen3_8b.sh     # print the commands only
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS=${SEEDS:-"1"}
METHODS=${METHODS:-"grpo_vanilla grpo_cispo grpo_cispo_trl"}
NUM_GPUS=${NUM_GPUS:-8}  # theirs: 1 node x 8 GPUs
TOTAL_STEPS=${TOTAL_STEPS:-105}  # theirs: 15 epochs of GSM8K + MATH in batches of 1024 (~210); here MATH's 7 a epoch
DATASET=${DATASET:-DigitalLearningGmbH/MATH-lighteval}  # theirs: GSM8K's and MATH's train splits together
OUT=${OUT:-runs/cispo_qwen3_8b}

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# shared, as their script and verl's defaults: mini-batches of 256 prompts (4 updates, 1 epoch), token-mean (verl
# 0.9.1: over the mini-batch of all ranks, as ours; TRL 1.16 divides each update by the generation batch's token count
# / 4, so each of its 4 updates is ours x 4 N_update / N_generation: 0.48-1.45 measured, 1 on average), lr 1e-6
# constant, AdamW weight decay 0.01, grad clip 1, T 1, k3 KL 0.001 (their low_var_kl: k3 clamped to +-10), no entropy
# bonus, no dynamic sampling; greedy evaluation on MATH-500 and GSM8K (theirs: their test splits) every 5 steps
COMMON=(
  --model-name-or-path Qwen/Qwen3-8B --dataset "$DATASET"
  --eval-dataset benchmarks/data/math500.jsonl benchmarks/data/gsm8k.jsonl --eval-every 5
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy --wandb-tags cispo_qwen3_8b
  --num-prompts-per-step 1024 --group-size 5 --max-prompt-length 1024 --max-response-length 2048
  --temperature 1.0 --learning-rate 1e-6 --weight-decay 0.01 --max-grad-norm 1
  --num-mini-batches 4 --num-epochs 1 --loss-agg token-mean --kl-coef 0.001
  --gradient-checkpointing --micro-batch-size 4
  --vllm-is-cap 0  # the reference (verl) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    grpo_vanilla) echo "--clip-eps-low 0.2 --clip-eps-high 0.2" ;;  # verl's default PPO clip
    grpo_cispo) echo "--clip-eps-low 10 --clip-eps-high 0.2" ;;  # their clip_ratio_low 10, clip_ratio_high 0.2
    grpo_cispo_trl) echo "--cispo-max-weight 5" ;;  # TRL 1.16: epsilon_high 5 as an absolute cap, no lower bound
    *) echo "unknown method $1" >&2; exit 1 ;;
  esac
}

for method in $METHODS; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    script=${method%_trl}  # a configuration is a script or, TRL's convention, CISPO's with its flag
    run deepspeed --num_gpus "$NUM_GPUS" "$script.py" "${COMMON[@]}" $(method_flags "$method") --exp-name "$method" \
      --seed "$seed"
  done
done
run python -m benchmarks.compare --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
