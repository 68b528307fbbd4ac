#!/usr/bin/env bash
# Seeded short testbed runs of two checkouts of this repository, side by side: do they log the same metrics?
# The check behind a change that must not change behaviour (e.g. the December 2026 redesign of the four scripts).
#   git worktree add /tmp/before <commit>
#   bash benchmarks/checks/same_metrics.sh /tmp/before . runs/same_metrics
# What it showed at each restructuring: benchmarks/results/redesign.md (the four scripts),
# results/same_metrics_utils_split.md (utils/ by concern), results/same_metrics_house.md (one sampler, utils/ and
# benchmarks/ by what they hold), results/same_metrics_corrections.md (the rollout-correction modes, KL estimators,
# --mask-truncated), results/same_metrics_aent_split.md (AEnt alone in grpo_aent.py, the other rules in grpo_entreg.py).
# ALLOW_NEW=1: metrics only the after side logs (a change that adds metrics) are listed, not a failure.
# ONLY="aent_mb2 aent_z3_2p": run only these configurations.
# A script spelled OLD.py:NEW.py runs NEW.py, or OLD.py with the same flags on a before side without NEW.py (a method
# moved to a file of its own: issue 71's coefficient rules, grpo_aent.py -> grpo_entreg.py).
# 27 configurations: each method, the single-update path (no log-prob pass), a reference-KL run, the reference's
# micro-batch Cov scope, ZeRO-3 on 2 ranks, token selection (global, micro-batch scope, current source, AEnt's synced bonus), a rollout rank (s = 0; AEnt: s = 1 under ZeRO-3), Lp-Reg's
# global selection on 1 and 2 ranks, the entropy bonus's rules (target: cadences, signals; linear; constant); 6 steps each, evaluation (greedy + 4 samples) at steps 0, 3, 6.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash benchmarks/checks/same_metrics.sh BEFORE_CHECKOUT AFTER_CHECKOUT [OUT]" >&2; exit 2
fi
BEFORE=$(realpath "$1"); AFTER=$(realpath "$2"); OUT=$(realpath -m "${3:-runs/same_metrics}")
ROOT=$(cd "$(dirname "$0")/../.." && pwd); PY=${PY:-$ROOT/.venv/bin/python}
set -a; . "$ROOT/cpu.env"; set +a  # the CPU environment (cpu.env)
TB=$ROOT/testbed
BASE="--model-name-or-path $TB/model --dataset $TB/train.jsonl --eval-dataset $TB/test.jsonl --total-steps 6
  --num-prompts-per-step 16 --group-size 8 --max-prompt-length 128 --max-response-length 48 --micro-batch-size 32
  --learning-rate 2e-4 --warmup-steps 2 --no-gradient-checkpointing --eval-every 3 --eval-num-prompts 32
  --eval-samples 4 --save-every 0"
AENT="--clamp-p 0.33 --entropy-coef 0.05 --entropy-low 0.08 --entropy-high 0.10 --entropy-coef-lr 0.5
  --entropy-coef-warmup 1 --entropy-coef-min 0 --entropy-coef-max 0.5"
KL="--kl-cov-ratio 0.1 --ppo-kl-coef 1"
TARGET="--coef-rule target --clamp-p 0 --entropy-coef 0 --entropy-coef-delta 0.005 --entropy-coef-min 0 --entropy-coef-max 0.5"
CC="--clip-cov-ratio 0.02 --clip-cov-lb 0.5 --clip-cov-ub 5 --clip-eps-low 0.2 --clip-eps-high 0.2"
CONFIGS=(
  "vanilla_mb2 1 grpo_vanilla.py --num-mini-batches 2"
  "vanilla_mb1_kl 1 grpo_vanilla.py --num-mini-batches 1 --kl-coef 0.05"
  "vanilla_mb1 1 grpo_vanilla.py --num-mini-batches 1"
  "aent_mb2 1 grpo_aent.py --num-mini-batches 2 $AENT"
  "aent_mb1 1 grpo_aent.py --num-mini-batches 1 $AENT"
  "klcov_mb2 1 grpo_klcov.py --num-mini-batches 2 $KL"
  "klcov_micro 1 grpo_klcov.py --num-mini-batches 2 --num-epochs 2 --cov-scope microbatch --micro-batch-size 16 $KL"
  "clipcov_mb2 1 grpo_clipcov.py --num-mini-batches 2 $CC"
  "clipcov_micro 1 grpo_clipcov.py --num-mini-batches 1 --cov-scope microbatch --micro-batch-size 16 $CC"
  "vanilla_z3_2p 2 grpo_vanilla.py --num-mini-batches 2 --zero-stage 3 --no-use-vllm --micro-batch-size 16"
  "aent_z3_2p 2 grpo_aent.py --num-mini-batches 2 --zero-stage 3 --no-use-vllm --micro-batch-size 16 $AENT"
  "vanilla_top20 1 grpo_vanilla.py --num-mini-batches 2 --top-entropy-quantile 0.2"
  "entadv_mb2 1 grpo_entadv.py --num-mini-batches 2 --top-entropy-quantile 0.5"
  "vanilla_rr 2 grpo_vanilla.py --num-mini-batches 2 --rollout-ranks 1"
  "aent_rr_s1 2 grpo_aent.py --num-mini-batches 2 --rollout-ranks 1 --max-staleness 1 --zero-stage 3 $AENT"
  "vanilla_top20_micro 1 grpo_vanilla.py --num-mini-batches 2 --top-entropy-quantile 0.2 --entropy-mask-scope microbatch"
  "vanilla_top20_current 1 grpo_vanilla.py --num-mini-batches 2 --top-entropy-quantile 0.2 --entropy-mask-source current"
  "aent_top20_kept 1 grpo_aent.py --num-mini-batches 2 --top-entropy-quantile 0.2 --entropy-mask-norm kept $AENT"
  "lpreg_mb2 1 grpo_lpreg.py --num-mini-batches 2 --lpreg-rho 0.3"
  "lpreg_2p 2 grpo_lpreg.py --num-mini-batches 2 --lpreg-rho 0.3 --no-use-vllm --micro-batch-size 16"
  "cegppo_mb4 1 grpo_cegppo.py --num-mini-batches 4 --micro-batch-size 32"
  "cispo_mb4 1 grpo_cispo.py --num-mini-batches 4 --micro-batch-size 32"
  "entreg_target_step 1 grpo_aent.py:grpo_entreg.py --num-mini-batches 2 $TARGET --entropy-target 10"
  "entreg_target_update 1 grpo_aent.py:grpo_entreg.py --num-mini-batches 2 $TARGET --entropy-target 10 --coef-cadence update --top-entropy-quantile 0.2"
  "entreg_target_nll 1 grpo_aent.py:grpo_entreg.py --num-mini-batches 1 $TARGET --entropy-target 0.14 --coef-signal nll"
  "entreg_linear 1 grpo_aent.py:grpo_entreg.py --num-mini-batches 2 --coef-rule linear --clamp-p 0.33 --entropy-coef 0.05 --entropy-coef-end 0"
  "entreg_plain 1 grpo_aent.py:grpo_entreg.py --num-mini-batches 2 --coef-rule constant --clamp-p 0 --entropy-coef 0.05"
)
failed=0
for config in "${CONFIGS[@]}"; do
  read -r name nproc script flags <<< "$config"
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
  for side in before after; do
    code=$BEFORE; [ $side = after ] && code=$AFTER
    run=${script#*:}; [ -f "$code/$run" ] || run=${script%%:*}
    rm -rf "$OUT/$side/$name"; mkdir -p "$OUT/$side"
    (cd "$code" && $PY -m torch.distributed.run --nproc_per_node "$nproc" --master_port $((29600 + RANDOM % 300)) \
        "$run" $BASE --output-dir "$OUT/$side/$name" $flags > "$OUT/$side/$name.log" 2>&1) \
      || { echo "$name ($side): failed, see $OUT/$side/$name.log"; failed=1; continue 2; }
  done
  printf '%-15s ' "$name"
  (cd "$ROOT" && $PY -m benchmarks.checks.compare_metrics "$OUT"/before/"$name"/*/metrics.jsonl \
    "$OUT"/after/"$name"/*/metrics.jsonl ${ALLOW_NEW:+--allow-new}) || failed=1
done
exit $failed
