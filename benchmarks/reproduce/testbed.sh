#!/usr/bin/env bash
# The CPU testbed comparison: all four methods on the tiny arithmetic testbed (utils/testbed.py) with the same seeds,
# then compare.py. Needs no GPU: run it from anywhere after `make venv`. Writes the runs to runs/testbed_compare/
# (emptied first) and the table and plots to benchmarks/results/testbed/ (the README's comparison).
#
#   bash benchmarks/reproduce/testbed.sh                        # 4 methods x 2 seeds x 100 steps, 2 runs at a time
#   PARALLEL=1 bash benchmarks/reproduce/testbed.sh             # one run at a time (1-core machines)
#   SEEDS="1" STEPS=20 bash benchmarks/reproduce/testbed.sh     # a quick look
#   DRY_RUN=1 bash benchmarks/reproduce/testbed.sh              # print the commands only
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS=${SEEDS:-"1 2"}
METHODS=${METHODS:-"grpo_vanilla grpo_aent grpo_klcov grpo_clipcov"}
STEPS=${STEPS:-100}
PARALLEL=${PARALLEL:-2}  # runs at a time; each is one process on one thread (OMP_NUM_THREADS=1)
PORT=${PORT:-29531}      # run i listens on PORT + i
OUT=${OUT:-runs/testbed_compare}
RESULTS=${RESULTS:-benchmarks/results/testbed}
if [ -z "${PY:-}" ]; then  # this checkout's .venv, else (a git worktree) the main checkout's
  PY=.venv/bin/python
  main=$(dirname "$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null || echo .)")
  [ -x "$PY" ] || [ ! -x "$main/.venv/bin/python" ] || PY=$main/.venv/bin/python
fi
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ -n "${DRY_RUN:-}" ]; then
  MODEL="<testbed>/model" TRAIN="<testbed>/train.jsonl" TEST="<testbed>/test.jsonl"
else  # built once and cached (utils/testbed.py)
  [ -x "$PY" ] || { echo "error: no python at $PY: run \`make venv\` or set PY" >&2; exit 1; }
  read -r MODEL TRAIN TEST < <("$PY" -c "from utils.testbed import build_testbed
tb = build_testbed(log=lambda *a: None)
print(tb.model_dir, tb.train_file, tb.test_file)")
  rm -rf "$OUT"  # compare.py reads every run under $OUT: only this invocation's
  mkdir -p "$OUT/logs"
fi

# the Makefile's testbed settings (16 prompts x 8 samples per step, lr 2e-4, greedy evaluation every 10 steps) except:
# all 500 held-out problems (not 200: less noise), and 4 optimizer mini-batches for every method: KL-Cov needs >= 2
# (its penalty is zero on the first, on-policy one), and the comparison is fair only if all four make the same updates
COMMON=(
  --model-name-or-path "$MODEL" --dataset "$TRAIN" --eval-dataset "$TEST" --eval-every 10 --eval-num-prompts 500
  --output-dir "$OUT" --total-steps "$STEPS" --save-every 0
  --num-prompts-per-step 16 --group-size 8 --max-prompt-length 128 --max-response-length 16
  --num-mini-batches 4 --micro-batch-size 32 --learning-rate 2e-4 --warmup-steps 5 --no-gradient-checkpointing
)
# Each method's own flags; everything else is COMMON. The published values are for 1.5B-7B models, thousands of tokens
# per response and hundreds of steps; here a response is ~6 tokens at ~0.3 nats, a mini-batch ~200 tokens, 100 steps:
method_flags() {
  case "$1" in
    grpo_vanilla) echo "" ;;
    # the box (paper's MATH run: 0.15-0.24) sits just below the testbed's starting clamped entropy (~0.30); coef_0,
    # its step size and range (paper: 2e-3, lr 2e-3, [6e-4, 9e-3], warm-up 30) are scaled up so that the coefficient
    # can cross its range within a few of the 100 steps
    grpo_aent) echo "--clamp-p 0.33 --entropy-coef 0.02 --entropy-low 0.27 --entropy-high 0.32 --entropy-coef-lr 0.2
                     --entropy-coef-warmup 10 --entropy-coef-min 0 --entropy-coef-max 0.2" ;;
    # the paper's ratio (2e-3) selects one token (the max(1, .) floor) per ~200-token mini-batch here: 0.2 selects ~40
    grpo_klcov) echo "--kl-cov-ratio 0.2 --ppo-kl-coef 1" ;;
    # the paper's ratio (2e-4) and lb 1 select one token per mini-batch here: 0.05 and lb 0.5 (under 5% of the
    # tokens are eligible: ~all of them, 3.8%); the recipe's PPO clip 1 / 1 diverged at lr 2e-4: 0.2 / 0.2 as the others
    grpo_clipcov) echo "--clip-cov-ratio 0.05 --clip-cov-lb 0.5 --clip-cov-ub 5
                        --clip-eps-low 0.2 --clip-eps-high 0.2" ;;
    *) echo "unknown method $1" >&2; exit 1 ;;
  esac
}

i=0
for seed in $SEEDS; do  # seed-major, so a partial result has every method
  for method in $METHODS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    cmd=("$PY" -m torch.distributed.run --nproc_per_node 1 --master_port $((PORT + i)) "$method.py" "${COMMON[@]}"
         $(method_flags "$method") --seed "$seed")
    i=$((i + 1))
    if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "${cmd[@]}"; echo; continue; fi
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n || true; done
    log="$OUT/logs/${method}__$seed.log"
    echo "[$(date +%T)] start $method seed $seed (log: $log)"
    ( start=$SECONDS; rc=0; "${cmd[@]}" >"$log" 2>&1 || rc=$?
      echo "$rc" >"$log.rc"; echo "[$(date +%T)] done  $method seed $seed: exit $rc, $((SECONDS - start)) s" ) &
  done
done
wait
if [ -z "${DRY_RUN:-}" ]; then
  failed=$(grep -Lx 0 "$OUT"/logs/*.rc || true)
  if [ -n "$failed" ]; then
    for f in $failed; do echo "error: ${f%.rc} failed; its end:" >&2; tail -n 20 "${f%.rc}" >&2; done
    exit 1
  fi
fi

cmd=("$PY" benchmarks/compare.py --runs "$OUT/*" --output-dir "$RESULTS" --baseline grpo_vanilla --smooth 10)
if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "${cmd[@]}"; echo; else "${cmd[@]}"; echo "total: $SECONDS s"; fi
