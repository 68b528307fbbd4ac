#!/usr/bin/env bash
# The authors' W-REINFORCE run (Zhu et al. 2025, arXiv 2506.01347; github.com/TianHongZXY/RLVR-Decomposed a5d4e7c,
# run_qwen2.5-math-7b_psr_nsr.sh with advantage "weighted"): Qwen2.5-Math-7B on MATH's 7,500 training problems, 1024
# prompts x 8 samples per step, 4 updates (mini-batches of 256 prompts), 3K response tokens, lr 1e-6, PPO's clip 0.2,
# lambda 0.1, their config's entropy bonus 0.001, no KL, 20 epochs (140 steps); their GRPO baseline beside it (a k3
# KL of 0.001 to the initial policy, as their GRPO script). Never run on GPUs here. Then pass@k up to 256 at T 0.6,
# top-p 0.95, as their eval.sh.
#
#   bash benchmarks/reproduce/wreinforce_qwen2.5_math_7b.sh               # one run after another
#   DRY_RUN=1 bash benchmarks/reproduce/wreinforce_qwen2.5_math_7b.sh     # print the commands only
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS=${SEEDS:-"1"}
METHODS=${METHODS:-"grpo_vanilla grpo_wreinforce"}
NUM_GPUS=${NUM_GPUS:-8}  # theirs: 1 node x 8 GPUs (vLLM tensor-parallel 2)
TOTAL_STEPS=${TOTAL_STEPS:-140}  # theirs: 20 epochs of 7 steps (7,500 problems, 1,024 a step, the rest dropped)
DATASET=${DATASET:-DigitalLearningGmbH/MATH-lighteval}  # theirs: MATH's train split in verl's format
OUT=${OUT:-runs/wreinforce_qwen2.5_math_7b}

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# shared, as their scripts and their config's defaults: lr 1e-6 constant, no warm-up, AdamW weight decay 0.01, grad
# clip 1, T 1 and top-p 1, PPO clip 0.2, token-mean, no dynamic sampling; evaluation on MATH-500, AMC23 and AIME24
# (theirs: MATH's test split, AMC23 and AIME25) every 7 steps (their test_freq)
COMMON=(
  --model-name-or-path Qwen/Qwen2.5-Math-7B --dataset "$DATASET"
  --eval-dataset benchmarks/data/math500.jsonl benchmarks/data/amc23.jsonl benchmarks/data/aime24.jsonl
  --eval-every 7 --eval-samples 4
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy
  --wandb-tags wreinforce_qwen2.5_math_7b
  --num-prompts-per-step 1024 --group-size 8 --max-prompt-length 1024 --max-response-length 3072
  --temperature 1.0 --learning-rate 1e-6 --weight-decay 0.01 --max-grad-norm 1
  --num-mini-batches 4 --num-epochs 1 --loss-agg token-mean --clip-eps-low 0.2 --clip-eps-high 0.2
  --gradient-checkpointing --micro-batch-size 4
  --vllm-is-cap 0  # the reference (their verl fork) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    # their GRPO script: a k3 KL loss of 0.001 (low_var_kl); their entropy bonus 0.001 is not in vanilla (no flag)
    grpo_vanilla) echo "--kl-coef 0.001" ;;
    # positive_advantage_weight 0.1; entropy_coeff 0.001 (their ppo_trainer.yaml's default, which the scripts keep)
    grpo_wreinforce) echo "--wr-lambda 0.1 --wr-entropy-coef 0.001 --kl-coef 0" ;;
    *) echo "unknown method $1" >&2; exit 1 ;;
  esac
}

for method in $METHODS; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    run deepspeed --num_gpus "$NUM_GPUS" "$method.py" "${COMMON[@]}" $(method_flags "$method") --exp-name "$method" \
      --seed "$seed"
  done
done

finals=("$OUT"/*/final)
[ -e "${finals[0]}" ] || finals=("$OUT/<run_name>/final")  # (dry run before training)
for final in "${finals[@]}"; do
  run python -m benchmarks.eval --model-name-or-path "$final" --output-dir "${final%/final}/eval" \
    --datasets math500 amc23 aime24 --n 256 --temperature 0.6 --top-p 0.95 --max-prompt-length 1024 \
    --max-response-length 4096
done
run python -m benchmarks.compare --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
