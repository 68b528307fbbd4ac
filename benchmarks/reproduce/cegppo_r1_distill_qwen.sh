#!/usr/bin/env bash
# CE-GPPO's runs ("CE-GPPO: Coordinating Entropy via Gradient-Preserving Clipping Policy Optimization", arXiv
# 2509.20712), as the authors' scripts run them (Kwai-Klear/CE-GPPO at 10558fe,
# recipe/dapo/{1_5B,7B}_perf_run_gppo_v1_beta1_{05,075}_beta2_1_ours_math.sh): DeepSeek-R1-Distill-Qwen-1.5B (beta1 0.5)
# or -7B (beta1 0.75), beta2 1, KlearReasoner-MathSub-30K, 128 prompts x 8 samples per step with dynamic sampling,
# 16K response tokens, lr 1e-6, weight decay 0.1, their SFT term on correct responses (0.1); plain GRPO beside it, and
# CE-GPPO without the SFT term (the clipping alone). Every setting beside theirs: docs/fidelity.md.
#
#   bash benchmarks/reproduce/cegppo_r1_distill_qwen.sh              # 1.5B, one run after another
#   SIZE=7b bash benchmarks/reproduce/cegppo_r1_distill_qwen.sh      # 7B
#   DRY_RUN=1 bash benchmarks/reproduce/cegppo_r1_distill_qwen.sh    # print the commands only
set -euo pipefail
cd "$(dirname "$0")/../.."

SIZE=${SIZE:-1.5b}
SEEDS=${SEEDS:-"1"}
METHODS=${METHODS:-"grpo_vanilla grpo_cegppo grpo_cegppo_nosft"}
NUM_GPUS=${NUM_GPUS:-8}  # theirs: 16 nodes x 8 GPUs (the batch is the same on any number)
TOTAL_STEPS=${TOTAL_STEPS:-1200}  # theirs: 10 epochs of 256-prompt generation batches (~1.2K steps; not stated)
DATASET=${DATASET:-Kwai-Klear/KlearReasoner-MathSub-30K}
OUT=${OUT:-runs/cegppo_r1_distill_qwen_$SIZE}
case "$SIZE" in
  1.5b) MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B BETA1=0.5 ;;
  7b) MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B BETA1=0.75 ;;
  *) echo "error: SIZE must be 1.5b or 7b (got $SIZE)" >&2; exit 1 ;;
esac

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# shared, as their scripts: 128 prompts x 8 per step, mini-batches of 16 prompts (8 updates, 1 epoch), dynamic sampling
# on accuracy (theirs: one round of 256 prompts, the survivors trained, at most 128, fewer some steps; ours: a round of
# 128, then one more sized by the keep rate, 2 rounds at most, the closest budget; with 1 round the dropped groups would
# fill the step and dilute the token mean: on the fork testbed 64% of plain GRPO's groups are all-equal), clip 0.2 /
# 0.2, dual clip 10, lr 1e-6 after 10 warm-up steps, AdamW weight decay 0.1, grad clip 1, no KL, no entropy bonus;
# the loss a mean over sequences of their token means: their actor's "token-mean" is per micro-batch, times its share,
# and their token budget (20,480 a GPU, 16K responses) leaves one response a micro-batch, so in effect a sequence mean
# (benchmarks/results/reference_losses.txt: the shortest response's tokens 42-52x the longest's weight, as ours here;
# our default token-mean weighs all alike); ZeRO-3, one sequence per micro-batch and the engine's sleep: memory only
COMMON=(
  --model-name-or-path "$MODEL" --dataset "$DATASET"
  --eval-dataset benchmarks/data/aime24.jsonl --eval-every 5 --eval-samples 32
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy
  --wandb-tags "cegppo_r1_distill_qwen_$SIZE"
  --num-prompts-per-step 128 --group-size 8 --max-prompt-length 4096 --max-response-length 16384
  --temperature 1.0 --learning-rate 1e-6 --warmup-steps 10 --weight-decay 0.1 --max-grad-norm 1
  --num-mini-batches 8 --num-epochs 1 --loss-agg seq-mean-token-mean --kl-coef 0
  --filter-groups --filter-groups-metric acc --max-gen-batches 2
  --clip-eps-low 0.2 --clip-eps-high 0.2 --clip-ratio-c 10
  --gradient-checkpointing --zero-stage 3 --micro-batch-size 1
  --vllm-is-cap 0  # the reference (verl) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    grpo_vanilla) echo "" ;;  # plain GRPO (PPO clip, dual clip 10) in the same settings
    # beta1 scales the bounded gradient of the A < 0 tokens below the clip range, beta2 the A > 0 ones above it; their
    # actor's positive_loss_coeff 0.1: + 0.1 x the NLL of every token of the correct responses
    grpo_cegppo) echo "--cegppo-beta1 $BETA1 --cegppo-beta2 1 --cegppo-sft-coef 0.1" ;;
    grpo_cegppo_nosft) echo "--cegppo-beta1 $BETA1 --cegppo-beta2 1 --cegppo-sft-coef 0" ;;
    *) echo "unknown method $1" >&2; exit 1 ;;
  esac
}

for method in $METHODS; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    script=${method%_nosft}  # a configuration is a script or, without the SFT term, CE-GPPO's with its flags
    run deepspeed --num_gpus "$NUM_GPUS" "$script.py" "${COMMON[@]}" $(method_flags "$method") --exp-name "$method" \
      --seed "$seed"
  done
done

# their validation: AIME 2024 and 2025 (aime960_math_verify*.json: each problem 32 times), T 0.6, top-p 0.95, at the
# validation length (16K for 1.5B, 32K for 7B); AIME 2025 is not vendored here
finals=("$OUT"/*/final)
[ -e "${finals[0]}" ] || finals=("$OUT/<run_name>/final")  # (dry run before training)
length=$([ "$SIZE" = 7b ] && echo 32768 || echo 16384)
for final in "${finals[@]}"; do
  run python -m benchmarks.eval --model-name-or-path "$final" --output-dir "${final%/final}/eval" --datasets aime24 \
    --n 32 --temperature 0.6 --top-p 0.95 --max-prompt-length 4096 --max-response-length "$length"
done
run python -m benchmarks.compare --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
