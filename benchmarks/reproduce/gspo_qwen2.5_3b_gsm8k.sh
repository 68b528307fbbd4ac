#!/usr/bin/env bash
# verl's GSPO example (Zheng et al. 2025, arXiv 2507.18071; verl examples/gspo_trainer/test_gspo_3b_math.sh at
# b178a3cd, the loss verl 0.9.1's loss_mode "gspo"): Qwen2.5-3B-Instruct on GSM8K, 512 prompts x 16 samples per step,
# 4 updates (the paper's 4 mini-batches), the clip 3e-4 / 4e-4, every sequence weighted the same
# (seq-mean-token-mean), lr 1e-6 with 5% warm-up, weight decay 0.1, no KL, 500 steps; plain GRPO beside it with the
# same settings and PPO's clip 0.2. Never run on GPUs here. METHODS="... grpo_gspo_trl": TRL's sequence form
# (--gspo-level sequence), equal in value and gradient where a sequence's tokens share one weight.
#
#   bash benchmarks/reproduce/gspo_qwen2.5_3b_gsm8k.sh               # one run after another
#   DRY_RUN=1 bash benchmarks/reproduce/gspo_qwen2.5_3b_gsm8k.sh     # print the commands only
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS=${SEEDS:-"1"}
METHODS=${METHODS:-"grpo_vanilla grpo_gspo"}
NUM_GPUS=${NUM_GPUS:-8}
TOTAL_STEPS=${TOTAL_STEPS:-500}  # theirs: 500 steps (total_training_steps; 10 epochs at most)
DATASET=${DATASET:-openai/gsm8k:main}  # theirs: verl's gsm8k.py preprocessing of the same train split
OUT=${OUT:-runs/gspo_qwen2.5_3b_gsm8k}

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# shared, as their script: response 8K (no overlong shaping), T 1 and top-p 1, lr 1e-6 with warm-up 0.05 x 500 = 25
# steps, weight decay 0.1, grad clip 1, no KL, no entropy bonus, seq-mean-token-mean for both; evaluation on GSM8K's
# test split (theirs; its val top-p 0.7: here the training T) every 10 steps
COMMON=(
  --model-name-or-path Qwen/Qwen2.5-3B-Instruct --dataset "$DATASET"
  --eval-dataset benchmarks/data/gsm8k.jsonl --eval-every 10 --eval-samples 4
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy
  --wandb-tags gspo_qwen2.5_3b_gsm8k
  --num-prompts-per-step 512 --group-size 16 --max-prompt-length 2048 --max-response-length 8192
  --temperature 1.0 --learning-rate 1e-6 --warmup-steps 25 --weight-decay 0.1 --max-grad-norm 1
  --num-mini-batches 4 --num-epochs 1 --loss-agg seq-mean-token-mean --kl-coef 0
  --gradient-checkpointing --micro-batch-size 4
  --vllm-is-cap 0  # the reference (verl) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    grpo_vanilla) echo "--clip-eps-low 0.2 --clip-eps-high 0.2" ;;  # verl's default PPO clip
    grpo_gspo) echo "--clip-eps-low 3e-4 --clip-eps-high 4e-4 --gspo-level token" ;;  # their clip_ratio_low, _high
    grpo_gspo_trl) echo "--clip-eps-low 3e-4 --clip-eps-high 4e-4 --gspo-level sequence" ;;  # TRL's form
    *) echo "unknown method $1" >&2; exit 1 ;;
  esac
}

for method in $METHODS; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    script=${method%_trl}  # a configuration is a script or, TRL's form, GSPO's with its flag
    run deepspeed --num_gpus "$NUM_GPUS" "$script.py" "${COMMON[@]}" $(method_flags "$method") --exp-name "$method" \
      --seed "$seed"
  done
done
run python -m benchmarks.compare --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
