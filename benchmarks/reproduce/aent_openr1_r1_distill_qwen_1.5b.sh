#!/usr/bin/env bash
# AEnt's OpenR1 run ("On Entropy Control in LLM-RL Algorithms", arXiv 2509.03493): DeepSeek-R1-Distill-Qwen-1.5B on
# OpenR1-Math, 256 prompts x 8 samples per step, 1024 / 7168 prompt / response tokens, on 8 GPUs. Settings: the
# authors' script's (run_aent_openr1.sh, antgroup/AEnt, with the verl defaults it relies on), each written out below;
# every setting beside theirs: docs/fidelity.md. Their training file (40k OpenR1-Math-220k problems) is not published:
# DATASET defaults to OpenR1-Math-220k's default split.
#
#   bash benchmarks/reproduce/aent_openr1_r1_distill_qwen_1.5b.sh               # everything, one run after another
#   DRY_RUN=1 bash benchmarks/reproduce/aent_openr1_r1_distill_qwen_1.5b.sh     # print the commands only
#   SEEDS="1" METHODS="grpo_vanilla grpo_aent" bash ...                        # a subset
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/reproduce/aent_settings.bash  # AEnt's settings, its warm-up translated once

SEEDS=${SEEDS:-"1 2 3"}
METHODS=${METHODS:-"grpo_vanilla grpo_aent grpo_klcov grpo_clipcov"}
NUM_GPUS=${NUM_GPUS:-8}
TOTAL_STEPS=${TOTAL_STEPS:-936}  # theirs: 6 epochs of 40000 // 256 = 156 steps
DATASET=${DATASET:-open-r1/OpenR1-Math-220k}  # problem / answer columns
OUT=${OUT:-runs/aent_openr1_r1_distill_qwen_1.5b}

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# shared by every method: the authors' OpenR1 run (no KL to a reference, PPO clip 0.2 with verl's dual clip c = 3 and
# AdamW weight decay 0.01, verl's defaults there; gradient checkpointing); evaluated every 15 steps on their sets that
# are vendored here, greedy (theirs: n = 4 at T 0.6, top-p 0.95: the final evaluation below)
COMMON=(
  --model-name-or-path deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --dataset "$DATASET"
  --eval-dataset benchmarks/data/{math500,aime24,amc23,minerva_math,olympiadbench}.jsonl --eval-every 25
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy
  --wandb-tags aent_openr1_r1_distill_qwen_1.5b
  --num-prompts-per-step 256 --group-size 8 --max-prompt-length 1024 --max-response-length 7168
  --temperature 1.0 --learning-rate 1e-6 --num-mini-batches 4 --num-epochs 1 --weight-decay 0.01
  --kl-coef 0 --clip-ratio-c 3 --gradient-checkpointing --vllm-gpu-memory-utilization 0.7
  --vllm-is-cap 0  # the reference (verl) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    grpo_vanilla) echo "--clip-eps-low 0.2 --clip-eps-high 0.2" ;;
    # coef_0, clamp_p, target box of the clamped entropy, coefficient step size and warm-up (theirs 156), its clip
    grpo_aent) echo "--clip-eps-low 0.2 --clip-eps-high 0.2 $AENT_OPENR1" ;;
    # the Cov paper's 7B defaults (it has no 1.5B setting); KL-Cov uses no PPO clipping
    grpo_klcov) echo "--kl-cov-ratio 2e-3 --ppo-kl-coef 1" ;;
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

# evaluation of every final model: their settings (temperature 0.6, top-p 0.95, n = 4), their sets that are
# vendored here (MATH-Hard is not), plus GSM8K
finals=("$OUT"/*/final)
[ -e "${finals[0]}" ] || finals=("$OUT/<run_name>/final")  # (dry run before training)
for final in "${finals[@]}"; do
  run python -m benchmarks.eval --model-name-or-path "$final" --output-dir "${final%/final}/eval" \
    --datasets math500 aime24 amc23 minerva_math olympiadbench gsm8k \
    --n 4 --temperature 0.6 --top-p 0.95 --max-prompt-length 1024 --max-response-length 7168
done
run python -m benchmarks.compare --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
