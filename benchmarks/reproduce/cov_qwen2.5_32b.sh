#!/usr/bin/env bash
# The Cov methods' Qwen2.5-32B runs ("The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617), as the authors'
# scripts run them (PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/32b_{baseline,cliphigher,kl_cov,clip_cov}.sh): the 7B
# settings (cov_qwen2.5_7b.sh) with lr 1e-6 and KL-Cov's k 2e-4, on 4 nodes x 8 GPUs with vLLM tensor parallel 2.
# Every setting beside theirs: docs/fidelity.md; memory plan: benchmarks/results/gpu_memory_plan.md.
#
#   bash benchmarks/reproduce/cov_qwen2.5_32b.sh               # on the first node of the hostfile
#   DRY_RUN=1 bash benchmarks/reproduce/cov_qwen2.5_32b.sh     # print the commands only
#
# The hostfile names each node and its GPUs ("node1 slots=8", one line per node); the nodes need passwordless ssh,
# the same environment and repository path, and OUT on a shared filesystem.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/reproduce/aent_settings.bash  # AEnt's settings, its warm-up translated once

SEEDS=${SEEDS:-"1"}
METHODS=${METHODS:-"grpo_vanilla grpo_vanilla_cliphigher grpo_klcov grpo_clipcov"}
HOSTFILE=${HOSTFILE:-hostfile}
NUM_NODES=${NUM_NODES:-4}
NUM_GPUS=${NUM_GPUS:-8}  # per node
TOTAL_STEPS=${TOTAL_STEPS:-500}  # theirs: 1000 epochs, i.e. until stopped: set it to your budget
# DAPO-Math-17k's problems without DAPO's "Answer: $Answer" instruction (cov_qwen2.5_7b.sh)
DATASET=${DATASET:-runs/data/dapo_math_17k_boxed.jsonl}
OUT=${OUT:-runs/cov_qwen2.5_32b}

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

[ -e "$DATASET" ] || [ -n "${DRY_RUN:-}" ] || python -m benchmarks.reproduce.dapo_boxed --output "$DATASET"

# shared by every configuration: the 7B settings (cov_qwen2.5_7b.sh) plus what 32B needs to fit 80 GB GPUs: one vLLM
# engine per 2 GPUs (TP 2: 33 GB of bf16 weights per GPU), ZeRO-3 (16 bytes per parameter / 32 ranks = 16 GB per GPU),
# one sequence per micro-batch, the engine asleep (weights offloaded) while training
COMMON=(
  --model-name-or-path Qwen/Qwen2.5-32B --dataset "$DATASET"
  --eval-dataset benchmarks/data/math500.jsonl benchmarks/data/aime24.jsonl benchmarks/data/amc23.jsonl --eval-every 4
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy --wandb-tags cov_qwen2.5_32b
  --num-prompts-per-step 256 --group-size 8 --max-prompt-length 2048 --max-response-length 8192
  --temperature 1.0 --learning-rate 1e-6 --num-mini-batches 8 --num-epochs 1 --weight-decay 0
  --filter-groups --filter-groups-metric acc --max-gen-batches 10 --clip-ratio-c 0
  --kl-coef 0 --gradient-checkpointing --zero-stage 3 --micro-batch-size 1
  --vllm-tensor-parallel-size 2 --vllm-gpu-memory-utilization 0.6 --vllm-sleep-level 1
  --vllm-is-cap 0  # the reference (verl) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    grpo_vanilla) echo "--clip-eps-low 0.2 --clip-eps-high 0.2" ;;
    # DAPO's clip-higher (32b_cliphigher.sh): grpo_vanilla.py, named apart (--exp-name) in compare.py and wandb
    grpo_vanilla_cliphigher) echo "--clip-eps-low 0.2 --clip-eps-high 0.28" ;;
    # AEnt published no 32B setting: its MATH run's values (the entropy box is model-specific: tune it)
    grpo_aent) echo "--clip-eps-low 0.2 --clip-eps-high 0.2 $AENT_MATH" ;;
    # top 2e-4 of the tokens by covariance (their k_percent 0.02, in percent; 7B: 2e-3) get beta |logp - old_logp|,
    # beta 1; no PPO clipping; over the mini-batch of all ranks (theirs: per micro-batch and GPU)
    grpo_klcov) echo "--kl-cov-ratio 2e-4 --ppo-kl-coef 1" ;;
    # 2e-4 of the tokens (a fraction, as theirs) with covariance in (1, 5) lose their gradient; their PPO clip 1 / 1
    grpo_clipcov) echo "--clip-cov-ratio 2e-4 --clip-cov-lb 1 --clip-cov-ub 5 --clip-eps-low 1 --clip-eps-high 1" ;;
    *) echo "unknown method $1" >&2; exit 1 ;;
  esac
}

for method in $METHODS; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    script=${method%_cliphigher}  # a configuration is a script or, clip-higher, vanilla's with its flags
    run deepspeed --hostfile "$HOSTFILE" --num_nodes "$NUM_NODES" --num_gpus "$NUM_GPUS" "$script.py" "${COMMON[@]}" \
      $(method_flags "$method") --exp-name "$method" --seed "$seed"
  done
done

# evaluation of every final model on one node (an engine per 2 GPUs, 4 engines), then the comparison
finals=("$OUT"/*/final)
[ -e "${finals[0]}" ] || finals=("$OUT/<run_name>/final")  # (dry run before training)
for final in "${finals[@]}"; do
  run python -m benchmarks.eval --model-name-or-path "$final" --output-dir "${final%/final}/eval" \
    --datasets math500 aime24 amc23 minerva_math olympiadbench gsm8k --tensor-parallel-size 2 \
    --n 4 --temperature 0.6 --top-p 0.95 --top-k 20 --max-prompt-length 2048 --max-response-length 8192
done
run python -m benchmarks.compare --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
