#!/usr/bin/env bash
# Lp-Reg's Qwen3-14B-Base run ("Low-probability Tokens Sustain Exploration in Reinforcement Learning with Verifiable
# Reward", arXiv 2510.03222), as the authors' script runs it (CarlanLark/Lp-Reg-dev at 33b27e2,
# recipe/lp_reg/Qwen3_14b_lp_reg_onpolicy_64gpu.sh; OFF_POLICY=1: ..._offpolicy_64gpu.sh): kappa 0.02, rho 0.01,
# beta 1 on DAPO-Math-17k, 256 prompts x 8 samples per step, 8K response tokens, lr 1e-6, PPO clip 1 / 9, on-policy (one
# update per step); plain GRPO beside it in the same settings. Every setting beside theirs: docs/fidelity.md.
#
#   bash benchmarks/reproduce/lpreg_qwen3_14b.sh               # on the first node of the hostfile
#   OFF_POLICY=1 bash benchmarks/reproduce/lpreg_qwen3_14b.sh  # their off-policy script: 8 updates per step
#   DRY_RUN=1 bash benchmarks/reproduce/lpreg_qwen3_14b.sh     # print the commands only
#
# The hostfile names each node and its GPUs ("node1 slots=8", one line per node); the nodes need passwordless ssh,
# the same environment and repository path, and OUT on a shared filesystem.
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS=${SEEDS:-"1"}
METHODS=${METHODS:-"grpo_vanilla grpo_lpreg"}
HOSTFILE=${HOSTFILE:-hostfile}
NUM_NODES=${NUM_NODES:-8}  # theirs: 8 nodes x 8 GPUs
NUM_GPUS=${NUM_GPUS:-8}  # per node
TOTAL_STEPS=${TOTAL_STEPS:-1035}  # theirs: 15 epochs of DAPO-Math-17k in batches of 256 (~69 x 15)
MINI_BATCHES=$([ -n "${OFF_POLICY:-}" ] && echo 8 || echo 1)  # theirs: mini-batch 256 (on-policy) or 32 of 256
# DAPO-Math-17k's problems without DAPO's "Answer: $Answer" instruction (cov_qwen2.5_7b.sh); theirs: the DAPO file
DATASET=${DATASET:-runs/data/dapo_math_17k_boxed.jsonl}
OUT=${OUT:-runs/lpreg_qwen3_14b}

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

[ -e "$DATASET" ] || [ -n "${DRY_RUN:-}" ] || python -m benchmarks.reproduce.dapo_boxed --output "$DATASET"

# shared, as their script: no dynamic sampling, no overlong shaping, no KL, no entropy bonus, token-mean (theirs: per
# micro-batch of a 30,720-token budget, times its share: neither a token nor a sequence mean; no flag of ours), lr 1e-6
# constant, weight decay 0, grad clip 1, T 1; PPO clip 1 / 9 (ratio in [0, 10]), no dual clip (their clip_ratio_c 10
# is never passed to the loss); greedy evaluation every 8 steps (theirs: AMC/AIME sampled at T 0.6, the rest greedy);
# ZeRO-3 and one sequence per micro-batch are for memory only
COMMON=(
  --model-name-or-path Qwen/Qwen3-14B-Base --dataset "$DATASET"
  --eval-dataset benchmarks/data/math500.jsonl benchmarks/data/aime24.jsonl benchmarks/data/amc23.jsonl --eval-every 8
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy --wandb-tags lpreg_qwen3_14b
  --num-prompts-per-step 256 --group-size 8 --max-prompt-length 2048 --max-response-length 8192
  --temperature 1.0 --learning-rate 1e-6 --weight-decay 0 --max-grad-norm 1
  --num-mini-batches "$MINI_BATCHES" --num-epochs 1 --loss-agg token-mean --kl-coef 0
  --clip-eps-low 1 --clip-eps-high 9 --clip-ratio-c 0
  --gradient-checkpointing --zero-stage 3 --micro-batch-size 1
  --vllm-is-cap 0  # the reference (verl) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    grpo_vanilla) echo "" ;;
    # the min-p proxy (kappa 0.02) from the sampling policy; of the A < 0 tokens the 1% of lowest probability, those
    # below the proxy: -A r + 1 x k3; selected over the mini-batch of all ranks (theirs: per micro-batch and GPU, with
    # its k >= 2 guard: --lpreg-scope microbatch)
    grpo_lpreg) echo "--lpreg-kappa 0.02 --lpreg-rho 0.01 --lpreg-beta 1" ;;
    *) echo "unknown method $1" >&2; exit 1 ;;
  esac
}

for method in $METHODS; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    run deepspeed --hostfile "$HOSTFILE" --num_nodes "$NUM_NODES" --num_gpus "$NUM_GPUS" "$method.py" "${COMMON[@]}" \
      $(method_flags "$method") --exp-name "$method" --seed "$seed"
  done
done

finals=("$OUT"/*/final)
[ -e "${finals[0]}" ] || finals=("$OUT/<run_name>/final")  # (dry run before training)
for final in "${finals[@]}"; do  # their validation sampling for AMC/AIME (T 0.6), on every vendored set
  run python -m benchmarks.eval --model-name-or-path "$final" --output-dir "${final%/final}/eval" \
    --datasets math500 aime24 amc23 minerva_math olympiadbench gsm8k \
    --n 4 --temperature 0.6 --top-p 1.0 --max-prompt-length 2048 --max-response-length 8192
done
run python -m benchmarks.compare --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
