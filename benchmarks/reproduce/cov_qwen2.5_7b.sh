#!/usr/bin/env bash
# The Cov methods' Qwen2.5-7B run ("The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617): Qwen2.5-7B on
# DAPO-Math-17k, 256 prompts x 8 samples per step, 8192 response tokens, lr 1e-6, no KL, no entropy bonus.
# All four methods x seeds, then evaluation of every final model and the comparison (plots, table, the law
# R = -a exp(H) + b that this paper proposed). Settings: the paper's, each written out below.
#
#   bash benchmarks/reproduce/cov_qwen2.5_7b.sh               # everything, one run after another
#   DRY_RUN=1 bash benchmarks/reproduce/cov_qwen2.5_7b.sh     # print the commands only
#   SEEDS="1" METHODS="grpo_vanilla grpo_klcov" bash ...      # a subset
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS=${SEEDS:-"1 2 3"}
METHODS=${METHODS:-"grpo_vanilla grpo_aent grpo_klcov grpo_clipcov"}
NUM_GPUS=${NUM_GPUS:-8}
TOTAL_STEPS=${TOTAL_STEPS:-500}  # not given in methods.md: set it to your budget
# DAPO-Math-17k with the problem as a string column (the original stores chat messages); its prompts carry DAPO's own
# "Answer: $Answer" instruction, before ours asking for \boxed{}
DATASET=${DATASET:-open-r1/DAPO-Math-17k-Processed:en}
OUT=${OUT:-runs/cov_qwen2.5_7b}

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# shared by every method. 8 optimizer mini-batches per rollout batch, as the published runs (KL-Cov acts from the
# second on). The prompt length (DAPO's 2048) is not in methods.md; ZeRO-3 and micro-batch 2 are for memory only.
COMMON=(
  --model-name-or-path Qwen/Qwen2.5-7B --dataset "$DATASET" --question-field prompt --answer-field solution
  --eval-dataset benchmarks/data/math500.jsonl --eval-every 10
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy --wandb-tags cov_qwen2.5_7b
  --num-prompts-per-step 256 --group-size 8 --max-prompt-length 2048 --max-response-length 8192
  --temperature 1.0 --learning-rate 1e-6 --num-mini-batches 8 --num-epochs 1
  --kl-coef 0 --gradient-checkpointing --zero-stage 3 --micro-batch-size 2
  --vllm-is-cap 0  # the reference (verl) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    grpo_vanilla) echo "--clip-eps-low 0.2 --clip-eps-high 0.2" ;;
    # AEnt published no 7B setting: its MATH run's values (the entropy box is model-specific: tune it)
    grpo_aent) echo "--clip-eps-low 0.2 --clip-eps-high 0.2 --clamp-p 0.33 --entropy-coef 0.002
                     --entropy-low 0.15 --entropy-high 0.24 --entropy-coef-lr 0.002 --entropy-coef-warmup 30
                     --entropy-coef-min 6e-4 --entropy-coef-max 9e-3" ;;
    # top 2e-3 of the tokens by covariance get beta |logp - old_logp|, beta 1 (7B); no PPO clipping
    grpo_klcov) echo "--kl-cov-ratio 2e-3 --ppo-kl-coef 1" ;;
    # 2e-4 of the tokens with covariance in (1, 5) lose their gradient; the recipe's PPO clip 1 / 1
    grpo_clipcov) echo "--clip-cov-ratio 2e-4 --clip-cov-lb 1 --clip-cov-ub 5 --clip-eps-low 1 --clip-eps-high 1" ;;
    *) echo "unknown method $1" >&2; exit 1 ;;
  esac
}

for method in $METHODS; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    run deepspeed --num_gpus "$NUM_GPUS" "$method.py" "${COMMON[@]}" $(method_flags "$method") --seed "$seed"
  done
done

# evaluation of every final model on the vendored sets the paper reports (AIME25 is not vendored), at the
# training response length; the sampling settings are this repository's defaults (AEnt's), not stated by the paper
finals=("$OUT"/*/final)
[ -e "${finals[0]}" ] || finals=("$OUT/<run_name>/final")  # (dry run before training)
for final in "${finals[@]}"; do
  run python benchmarks/eval.py --model-name-or-path "$final" --output-dir "${final%/final}/eval" \
    --datasets math500 aime24 amc23 minerva_math olympiadbench gsm8k \
    --n 4 --temperature 0.6 --top-p 0.95 --top-k 20 --max-prompt-length 2048 --max-response-length 8192
done
run python benchmarks/compare.py --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
