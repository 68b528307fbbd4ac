#!/usr/bin/env bash
# verl's SAPO example (Gao et al. 2025, arXiv 2511.20347; verl examples/sapo_trainer/run_qwen30b_sapo.sh at b178a3cd,
# the loss verl 0.9.1's compute_policy_loss_sapo): Qwen3-30B-A3B-Base on DAPO-Math-17k, 256 prompts x 16 samples per
# step, 8 updates (mini-batches of 32 prompts), 8K response tokens with DAPO's overlong shaping (4K buffer), lr 1e-6,
# no KL, the gate's temperatures 1.0 / 1.05; plain GRPO beside it with the same settings. Never run on GPUs here.
# Theirs runs on a SLURM allocation of several nodes with a critic-free GRPO; a 30B model with colocated engines on
# one 8-GPU node needs ZeRO-3 with offload (below). MODEL=Qwen/Qwen3-4B-Base: the model of verl PR #4345's test.
#
#   bash benchmarks/reproduce/sapo_qwen3_30b.sh               # one run after another
#   DRY_RUN=1 bash benchmarks/reproduce/sapo_qwen3_30b.sh     # print the commands only
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS=${SEEDS:-"1"}
METHODS=${METHODS:-"grpo_vanilla grpo_sapo"}
NUM_GPUS=${NUM_GPUS:-8}
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B-Base}
TOTAL_STEPS=${TOTAL_STEPS:-2000}  # theirs: 2000 steps (10 epochs at most)
DATASET=${DATASET:-runs/data/dapo_math_17k_boxed.jsonl}  # theirs: DAPO-Math-17k in verl's tool-call format
OUT=${OUT:-runs/sapo_qwen3_30b}

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

[ -e "$DATASET" ] || [ -n "${DRY_RUN:-}" ] || python -m benchmarks.reproduce.dapo_boxed --output "$DATASET"

# shared, as their script and verl's defaults: lr 1e-6 constant, AdamW weight decay 0.01, grad clip 1, T 1, no KL
# (use_kl_loss and use_kl_in_reward off), no entropy bonus, no dynamic sampling, verl's default token-mean for GRPO
# (SAPO: seq-mean-token-mean, which verl's SAPO loss uses whatever loss_agg_mode); evaluation on AIME24 (theirs, at
# T 1.0 and top-p 0.7: here the training T) and MATH-500 every 10 steps
COMMON=(
  --model-name-or-path "$MODEL" --dataset "$DATASET"
  --eval-dataset benchmarks/data/aime24.jsonl benchmarks/data/math500.jsonl --eval-every 10 --eval-samples 4
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy --wandb-tags sapo_qwen3_30b
  --num-prompts-per-step 256 --group-size 16 --max-prompt-length 2048 --max-response-length 8192
  --overlong-buffer-len 4096 --overlong-penalty-factor 1.0
  --temperature 1.0 --learning-rate 1e-6 --weight-decay 0.01 --max-grad-norm 1
  --num-mini-batches 8 --num-epochs 1 --kl-coef 0
  --gradient-checkpointing --zero-stage 3 --offload --micro-batch-size 1 --vllm-tensor-parallel-size 4
  --vllm-is-cap 0  # the reference (verl) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    grpo_vanilla) echo "--clip-eps-low 0.2 --clip-eps-high 0.2 --loss-agg token-mean" ;;  # verl's defaults
    grpo_sapo) echo "--sapo-tau-pos 1.0 --sapo-tau-neg 1.05 --loss-agg seq-mean-token-mean" ;;  # their tau_pos, tau_neg
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
run python -m benchmarks.compare --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
