#!/usr/bin/env bash
# The Cov methods' Qwen2.5-7B runs ("The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617), as the authors'
# scripts run them (PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/7b_{baseline,cliphigher,kl_cov,clip_cov}.sh): their
# four configurations (GRPO, clip-higher, KL-Cov, Clip-Cov) on DAPO-Math-17k, 256 prompts x 8 samples per step with
# DAPO's dynamic sampling, 8192 response tokens, lr 5e-7, no KL, no entropy bonus; then evaluation of every final model
# and the comparison (plots, table, the law R = -a exp(H) + b). Every setting beside theirs: docs/fidelity.md.
#
#   bash benchmarks/reproduce/cov_qwen2.5_7b.sh               # everything, one run after another
#   DRY_RUN=1 bash benchmarks/reproduce/cov_qwen2.5_7b.sh     # print the commands only
#   SEEDS="1" METHODS="grpo_vanilla grpo_klcov" bash ...      # a subset (grpo_aent: AEnt's MATH values, not theirs)
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/reproduce/aent_settings.bash  # AEnt's settings, its warm-up translated once

SEEDS=${SEEDS:-"1 2 3"}
METHODS=${METHODS:-"grpo_vanilla grpo_vanilla_cliphigher grpo_klcov grpo_clipcov"}
NUM_GPUS=${NUM_GPUS:-8}
TOTAL_STEPS=${TOTAL_STEPS:-500}  # theirs: 1000 epochs (15 for KL-Cov), i.e. until stopped: set it to your budget
# DAPO-Math-17k's problems without DAPO's "Answer: $Answer" instruction (theirs: rewritten to ask for \boxed{}, the
# file unpublished), made once by dapo_boxed.py from open-r1/DAPO-Math-17k-Processed
DATASET=${DATASET:-runs/data/dapo_math_17k_boxed.jsonl}
OUT=${OUT:-runs/cov_qwen2.5_7b}

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

[ -e "$DATASET" ] || [ -n "${DRY_RUN:-}" ] || python -m benchmarks.reproduce.dapo_boxed --output "$DATASET"

# shared by every configuration, as their scripts: 8 optimizer mini-batches per rollout batch (ppo_mini_batch_size 32
# of 256; KL-Cov acts from the second on: on the first its penalty is exactly 0, measured on the CPU testbed; theirs
# recomputes the old log-probs in other micro-batches, not measured), dynamic sampling on accuracy, at most 10
# generation rounds, overlong shaping off, greedy evaluation every 4 steps (theirs: no step-0 evaluation; AIME/AMC rows sampled at T 0.6 when mixed with
# others). No dual clip: their clip_ratio_c 10 is set but its code is commented out (core_algos.py). ZeRO-3 and
# micro-batch 2 are for memory only.
COMMON=(
  --model-name-or-path Qwen/Qwen2.5-7B --dataset "$DATASET"
  --eval-dataset benchmarks/data/math500.jsonl benchmarks/data/aime24.jsonl benchmarks/data/amc23.jsonl --eval-every 4
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy --wandb-tags cov_qwen2.5_7b
  --num-prompts-per-step 256 --group-size 8 --max-prompt-length 2048 --max-response-length 8192
  --temperature 1.0 --learning-rate 5e-7 --num-mini-batches 8 --num-epochs 1 --weight-decay 0
  --filter-groups --filter-groups-metric acc --max-gen-batches 10 --clip-ratio-c 0
  --kl-coef 0 --gradient-checkpointing --zero-stage 3 --micro-batch-size 2
  --vllm-is-cap 0  # the reference (verl) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    grpo_vanilla) echo "--clip-eps-low 0.2 --clip-eps-high 0.2" ;;
    # DAPO's clip-higher (7b_cliphigher.sh): grpo_vanilla.py, named apart (--exp-name) in compare.py and wandb
    grpo_vanilla_cliphigher) echo "--clip-eps-low 0.2 --clip-eps-high 0.28" ;;
    # AEnt published no 7B setting: its MATH run's values (the entropy box is model-specific: tune it)
    grpo_aent) echo "--clip-eps-low 0.2 --clip-eps-high 0.2 $AENT_MATH" ;;
    # top 2e-3 of the tokens by covariance (their k_percent 0.2, in percent) get beta |logp - old_logp|, beta 1; no PPO
    # clipping; selected over the mini-batch of all ranks (theirs: per micro-batch and GPU: --cov-scope microbatch)
    grpo_klcov) echo "--kl-cov-ratio 2e-3 --ppo-kl-coef 1" ;;
    # 2e-4 of the tokens (a fraction, as theirs) with covariance in (1, 5) lose their gradient; their PPO clip 1 / 1
    grpo_clipcov) echo "--clip-cov-ratio 2e-4 --clip-cov-lb 1 --clip-cov-ub 5 --clip-eps-low 1 --clip-eps-high 1" ;;
    *) echo "unknown method $1" >&2; exit 1 ;;
  esac
}

for method in $METHODS; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    script=${method%_cliphigher}  # a configuration is a script or, clip-higher, vanilla's with its flags
    run deepspeed --num_gpus "$NUM_GPUS" "$script.py" "${COMMON[@]}" $(method_flags "$method") --exp-name "$method" \
      --seed "$seed"
  done
done

# evaluation of every final model on the vendored sets the paper reports (AIME25 is not vendored), at the
# training response length; the sampling settings are this repository's defaults (AEnt's), not stated by the paper
finals=("$OUT"/*/final)
[ -e "${finals[0]}" ] || finals=("$OUT/<run_name>/final")  # (dry run before training)
for final in "${finals[@]}"; do
  run python -m benchmarks.eval --model-name-or-path "$final" --output-dir "${final%/final}/eval" \
    --datasets math500 aime24 amc23 minerva_math olympiadbench gsm8k \
    --n 4 --temperature 0.6 --top-p 0.95 --top-k 20 --max-prompt-length 2048 --max-response-length 8192
done
run python -m benchmarks.compare --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
