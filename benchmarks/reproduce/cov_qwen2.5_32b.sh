#!/usr/bin/env bash
# The Cov methods' Qwen2.5-32B run ("The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617): Qwen2.5-32B on
# DAPO-Math-17k, 256 prompts x 8 samples per step, 8192 response tokens, lr 1e-6, no KL, no entropy bonus, on 4 nodes
# x 8 GPUs with vLLM tensor parallel 2. All four methods x seeds, then evaluation and comparison. Settings: the
# paper's, each written out below; memory plan: benchmarks/results/gpu_memory_plan.md.
#
#   bash benchmarks/reproduce/cov_qwen2.5_32b.sh               # on the first node of the hostfile
#   DRY_RUN=1 bash benchmarks/reproduce/cov_qwen2.5_32b.sh     # print the commands only
#
# The hostfile names each node and its GPUs ("node1 slots=8", one line per node); the nodes need passwordless ssh,
# the same environment and repository path, and OUT on a shared filesystem.
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS=${SEEDS:-"1"}
METHODS=${METHODS:-"grpo_vanilla grpo_aent grpo_klcov grpo_clipcov"}
HOSTFILE=${HOSTFILE:-hostfile}
NUM_NODES=${NUM_NODES:-4}
NUM_GPUS=${NUM_GPUS:-8}  # per node
TOTAL_STEPS=${TOTAL_STEPS:-500}  # not given in methods.md: set it to your budget
DATASET=${DATASET:-open-r1/DAPO-Math-17k-Processed:en}
OUT=${OUT:-runs/cov_qwen2.5_32b}

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# shared by every method: the 7B settings (cov_qwen2.5_7b.sh) plus what 32B needs to fit 80 GB GPUs: one vLLM engine
# per 2 GPUs (TP 2: 33 GB of bf16 weights per GPU), ZeRO-3 (16 bytes per parameter / 32 ranks = 16 GB per GPU),
# one sequence per micro-batch, the engine asleep (weights offloaded) while training
COMMON=(
  --model-name-or-path Qwen/Qwen2.5-32B --dataset "$DATASET" --question-field prompt --answer-field solution
  --eval-dataset benchmarks/data/math500.jsonl --eval-every 10
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy --wandb-tags cov_qwen2.5_32b
  --num-prompts-per-step 256 --group-size 8 --max-prompt-length 2048 --max-response-length 8192
  --temperature 1.0 --learning-rate 1e-6 --num-mini-batches 8 --num-epochs 1
  --kl-coef 0 --gradient-checkpointing --zero-stage 3 --micro-batch-size 1
  --vllm-tensor-parallel-size 2 --vllm-gpu-memory-utilization 0.6 --vllm-sleep-level 1
  --vllm-is-cap 0  # the reference (verl) does not correct for the sampler's mismatch
)
method_flags() {
  case "$1" in
    grpo_vanilla) echo "--clip-eps-low 0.2 --clip-eps-high 0.2" ;;
    # AEnt published no 32B setting: its MATH run's values (the entropy box is model-specific: tune it)
    grpo_aent) echo "--clip-eps-low 0.2 --clip-eps-high 0.2 --clamp-p 0.33 --entropy-coef 0.002
                     --entropy-low 0.15 --entropy-high 0.24 --entropy-coef-lr 0.002 --entropy-coef-warmup 30
                     --entropy-coef-min 6e-4 --entropy-coef-max 9e-3" ;;
    # top 2e-4 of the tokens by covariance (32B; 7B: 2e-3) get beta |logp - old_logp|, beta 1; no PPO clipping
    grpo_klcov) echo "--kl-cov-ratio 2e-4 --ppo-kl-coef 1" ;;
    # 2e-4 of the tokens with covariance in (1, 5) lose their gradient; the recipe's PPO clip 1 / 1
    grpo_clipcov) echo "--clip-cov-ratio 2e-4 --clip-cov-lb 1 --clip-cov-ub 5 --clip-eps-low 1 --clip-eps-high 1" ;;
    *) echo "unknown method $1" >&2; exit 1 ;;
  esac
}

for method in $METHODS; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    run deepspeed --hostfile "$HOSTFILE" --num_nodes "$NUM_NODES" --num_gpus "$NUM_GPUS" "$method.py" "${COMMON[@]}" \
      $(method_flags "$method") --seed "$seed"
  done
done

# evaluation of every final model on one node (an engine per 2 GPUs, 4 engines), then the comparison
finals=("$OUT"/*/final)
[ -e "${finals[0]}" ] || finals=("$OUT/<run_name>/final")  # (dry run before training)
for final in "${finals[@]}"; do
  run python benchmarks/eval.py --model-name-or-path "$final" --output-dir "${final%/final}/eval" \
    --datasets math500 aime24 amc23 minerva_math olympiadbench gsm8k --tensor-parallel-size 2 \
    --n 4 --temperature 0.6 --top-p 0.95 --top-k 20 --max-prompt-length 2048 --max-response-length 8192
done
run python benchmarks/compare.py --runs "$OUT/*" --output-dir "$OUT/compare" --baseline grpo_vanilla
