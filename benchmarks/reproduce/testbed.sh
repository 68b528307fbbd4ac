#!/usr/bin/env bash
# The CPU testbed comparison: the methods (default: the first four) on the shipped testbed (testbed/,
# testbed/build_arithmetic.py) with the same seeds, then compare.py. Needs no GPU: run it from anywhere after `make venv`.
# Writes the runs to runs/testbed_compare/ (emptied first) and the table and plots to benchmarks/results/testbed/ (the README's results).
#
#   bash benchmarks/reproduce/testbed.sh                        # 4 methods x 3 seeds x 200 steps, 2 runs at a time
#   METHODS="grpo_vanilla grpo_vanilla_top20 grpo_vanilla_top50 grpo_aent_top20 grpo_entreg_target" \
#     OUT=runs/testbed_selection RESULTS=benchmarks/results/testbed/selection bash benchmarks/reproduce/testbed.sh
#                                                               # token selection and the target rule (below)
#   METHODS="grpo_vanilla grpo_vanilla_cliphigher grpo_aent_top20_all grpo_vanilla_filter grpo_klcov_filter \
#     grpo_clipcov_filter" OUT=runs/testbed_refs RESULTS=benchmarks/results/testbed/references \
#     bash benchmarks/reproduce/testbed.sh                      # the references' settings (below)
#   METHODS="grpo_vanilla grpo_aent grpo_vanilla_s1 grpo_aent_s1" OUT=runs/testbed_async \
#     RESULTS=benchmarks/results/testbed/async bash benchmarks/reproduce/testbed.sh   # one-step-off-policy (below)
#   METHODS="grpo_vanilla grpo_mine" METHOD_FLAGS_grpo_mine="--my-coef 0.1" bash benchmarks/reproduce/testbed.sh
#                                                               # any grpo_<name>.py: its flags (none if unset)
#   METHOD_FLAGS_grpo_mine_big="grpo_mine --my-coef 1" METHODS="... grpo_mine_big" ...  # a variant: script, flags
#   METHODS="grpo_vanilla grpo_cispo grpo_cegppo grpo_lpreg" OUT=runs/testbed_remedies \
#     RESULTS=benchmarks/results/testbed/remedies bash benchmarks/reproduce/testbed.sh  # CISPO, CE-GPPO, Lp-Reg
#   METHODS="grpo_vanilla_mb8 grpo_cispo_mb8 grpo_cegppo_mb8" OUT=runs/testbed_remedies_mb8 \
#     RESULTS=benchmarks/results/testbed/remedies_mb8 bash benchmarks/reproduce/testbed.sh  # 8 updates per step
#   PARALLEL=1 bash benchmarks/reproduce/testbed.sh             # one run at a time (1-core machines)
#   SEEDS="1" STEPS=50 bash benchmarks/reproduce/testbed.sh     # a quick look
#   DRY_RUN=1 bash benchmarks/reproduce/testbed.sh              # print the commands only
#   TESTBED=fork METHODS="grpo_vanilla grpo_aent grpo_klcov grpo_clipcov grpo_entadv grpo_cispo grpo_cegppo \
#     grpo_lpreg grpo_vanilla_top20" OUT=runs/testbed_fork RESULTS=benchmarks/results/testbed/fork \
#     bash benchmarks/reproduce/testbed.sh                      # every method on the fork testbed (below)
#   METHODS="grpo_vanilla grpo_sapo grpo_gspo grpo_wreinforce" OUT=runs/testbed_variants \
#     RESULTS=benchmarks/results/testbed/variants bash benchmarks/reproduce/testbed.sh   # SAPO, GSPO, W-REINFORCE
#   (and with TESTBED=fork, RESULTS=benchmarks/results/testbed/fork_variants: on the fork testbed)
#   METHODS="grpo_vanilla grpo_aent grpo_entreg_linear grpo_entreg_plain" OUT=runs/testbed_schedule \
#     RESULTS=benchmarks/results/testbed/schedule bash benchmarks/reproduce/testbed.sh   # the scheduled, plain bonus
#   TESTBED=fork METHODS="grpo_vanilla grpo_aent grpo_entreg_linear grpo_entreg_plain grpo_passk grpo_vanilla_kl" \
#     OUT=runs/testbed_fork_schedule RESULTS=benchmarks/results/testbed/fork_schedule \
#     bash benchmarks/reproduce/testbed.sh                      # the schedule and plain bonus, and the two controls
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS=${SEEDS:-"1 2 3"}
METHODS=${METHODS:-"grpo_vanilla grpo_aent grpo_klcov grpo_clipcov"}
STEPS=${STEPS:-200}
PARALLEL=${PARALLEL:-2}  # runs at a time; each is one process on one thread (OMP_NUM_THREADS=1)
PORT=${PORT:-29531}      # run i listens on PORT + i
OUT=${OUT:-runs/testbed_compare}
RESULTS=${RESULTS:-benchmarks/results/testbed}
if [ -z "${PY:-}" ]; then  # this checkout's .venv, else (a git worktree) the main checkout's
  PY=.venv/bin/python
  main=$(dirname "$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null || echo .)")
  [ -x "$PY" ] || [ ! -x "$main/.venv/bin/python" ] || PY=$main/.venv/bin/python
fi
set -a; . ./cpu.env; set +a  # the CPU environment (cpu.env)

# TESTBED=fork: the fork testbed (testbed/fork/, testbed/build_fork.py): the same GRPO settings but for responses of
# at most 32 tokens and its two test sets (majority and minority kind) of which 100 each are evaluated
TESTBED=${TESTBED:-arithmetic}
case "$TESTBED" in
  arithmetic) DIR=testbed BUILD=testbed.build_arithmetic MAX_RESPONSE=48 EVAL_PROMPTS=200
              AENT_BOX="--entropy-low 0.08 --entropy-high 0.10" ;;
  fork) DIR=testbed/fork BUILD=testbed.build_fork MAX_RESPONSE=32 EVAL_PROMPTS=100
        AENT_BOX="--entropy-low 0.044 --entropy-high 0.055" ;;
  *) echo "error: unknown TESTBED=$TESTBED (arithmetic or fork)" >&2; exit 1 ;;
esac
MODEL=$DIR/model TRAIN=$DIR/train.jsonl TEST=$DIR/test.jsonl
if [ -z "${DRY_RUN:-}" ]; then
  [ -x "$PY" ] || { echo "error: no python at $PY: run \`make venv\` or set PY" >&2; exit 1; }
  "$PY" -m "$BUILD"  # checks the shipped files against stats.json (rebuilds only if they are missing)
  rm -rf "$OUT"  # compare.py reads every run under $OUT: only this invocation's
  mkdir -p "$OUT/logs"
fi

# the Makefile's testbed settings (TESTBED_ARGS: 16 prompts x 8 samples per step, 2 optimizer mini-batches, lr 2e-4,
# 200 steps, evaluation on 200 held-out problems every 25 steps, greedy and 16 samples each), the same for every
# method: KL-Cov needs >= 2 mini-batches (its penalty is zero on the first, on-policy one), and the comparison is fair
# only if all make the same updates; no rollout correction (--vllm-is-cap 0: the CPU engine's log-probs equal the
# trainer's to ~4e-7, nothing to correct, and the published runs predate the flag)
COMMON=(
  --model-name-or-path "$MODEL" --dataset "$TRAIN" --eval-dataset "$TEST" --eval-every 25 --eval-num-prompts "$EVAL_PROMPTS"
  --eval-samples 16 --output-dir "$OUT" --total-steps "$STEPS" --save-every 0
  --num-prompts-per-step 16 --group-size 8 --max-prompt-length 128 --max-response-length "$MAX_RESPONSE"
  --num-mini-batches 2 --micro-batch-size 32 --learning-rate 2e-4 --warmup-steps 5 --no-gradient-checkpointing
  --vllm-is-cap 0
)
# Each configuration's own flags (a name that is not a script is a variant: the script it runs, then its flags;
# compare.py groups runs by the name, passed as --exp-name); everything else is COMMON. $METHOD_FLAGS_<name>, when
# set, replaces the flags below; a grpo_<name>.py without either runs with its defaults. The published values are for
# 1.5B-7B models, thousands of tokens per response and hundreds of steps; here a response is ~31 tokens, most of them
# near-deterministic copies (entropy ~0.13 nats per token at the start), an optimizer mini-batch ~2,000 tokens, 200
# steps. Scale a published value by what it acts on: a per-token coefficient times an entropy in nats keeps its
# meaning where the tokens it acts on have the paper's entropies (the testbed's top 20% hold ~0.65 nats, as a 1.5B
# model's average); a fraction of a mini-batch's tokens does not (2e-3 of 2,000 tokens is 4); a coefficient of a mean
# over all tokens shrinks with the mean entropy (0.13 here):
method_flags() {
  local own="METHOD_FLAGS_$1"
  if [ -n "${!own+set}" ]; then echo "${!own}"; return; fi
  case "$1" in
    grpo_vanilla) echo "" ;;
    # the box (paper's MATH run: 0.15-0.24 nats) is set at 60-75% of the testbed's starting entropy (0.13), where
    # vanilla falls to ~0.045; the bonus must be far larger than the paper's coefficient (2e-3, range [6e-4, 9e-3]) to
    # move a policy whose tokens are mostly near-deterministic (the entropy gradient of a token scales with its
    # entropy), so coef_0, its step size and range are scaled up (paper: lr 2e-3, warm-up 30)
    # (step sizes of 5 and 2 overshot: the entropy swung 0.08 -> 0.12 -> 0.09 within 50 steps, and to 0.21 and back)
    # (the fork testbed starts at 0.074 nats, steps 1-10 of vanilla's seed 1: the box at the same 60-75%, the rest
    # as here)
    grpo_aent) echo "--clamp-p 0.33 --entropy-coef 0.05 $AENT_BOX --entropy-coef-lr 0.5
                     --entropy-coef-warmup 10 --entropy-coef-min 0 --entropy-coef-max 0.5" ;;
    # the paper's ratio (2e-3) selects 4 of a ~2,000-token mini-batch here: 0.1 selects ~200
    grpo_klcov) echo "--kl-cov-ratio 0.1 --ppo-kl-coef 1" ;;
    # the paper's ratio (2e-4) selects one token (the max(1, .) floor) per mini-batch here: 0.02 selects ~40; lb 0.5
    # (paper: 1) because covariances are smaller on this short-response task; the recipe's PPO clip 1 / 1 is not used
    # (0.2 / 0.2 as the other methods), so that the only difference from vanilla is the dropped gradient
    grpo_clipcov) echo "--clip-cov-ratio 0.02 --clip-cov-lb 0.5 --clip-cov-ub 5 --clip-eps-low 0.2 --clip-eps-high 0.2" ;;
    # the 80/20 rule (arXiv 2506.01939): the paper's rho = 0.2 as published; here a response has ~31 tokens, ~20 of
    # them near-deterministic copies, so the top 20% (~6 a response) hold ~95% of the entropy (the kept tokens' mean
    # entropy ~0.65 nats against ~0.13 for all); global scope, the loss normalised over every token (the defaults)
    grpo_vanilla_top20) echo "grpo_vanilla --top-entropy-quantile 0.2" ;;
    # one more rho: half the tokens (the paper's ablation also tried 0.5 and 0.1)
    grpo_vanilla_top50) echo "grpo_vanilla --top-entropy-quantile 0.5" ;;
    # AEnt synced with the selection (TRL's sync: the bonus is a mean over the kept tokens and the coefficient sees
    # their clamped entropy, ~0.62-0.70 nats at the start, ~4.7x the all-token 0.133): the box is grpo_aent's
    # [0.08, 0.10] (60-75% of the start) at the same 60-75% of the kept tokens' start; as a mean over 20% of the
    # tokens that hold ~95% of the entropy the bonus pushes ~1/rho = 5x harder at the same coefficient, so coef_0 and
    # its range are grpo_aent's / 5, and its step size / 5 / 4.7 (deviations from the box are ~4.7x larger in nats)
    grpo_aent_top20) echo "grpo_aent --top-entropy-quantile 0.2 --clamp-p 0.33 --entropy-coef 0.01 --entropy-low 0.38
                           --entropy-high 0.47 --entropy-coef-lr 0.02 --entropy-coef-warmup 10 --entropy-coef-min 0
                           --entropy-coef-max 0.1" ;;
    # the target rule with --clamp-p 0: TRL 1.16's / Skywork-OR1's plain entropy bonus, every token. TRL's delta
    # (0.005 a step) and initial coefficient 0; the target (TRL, Skywork: 0.2 nats, ~30% of a 1.5B model's 0.65-0.72
    # at the start) is put mid-way in grpo_aent's box, 0.09 (~70% of the testbed's 0.133), so both controllers aim at
    # the same entropy; the range [0, 0.5] is grpo_aent's (TRL: [0, 1])
    # (grpo_aent_target until grpo_entreg.py took the rule from grpo_aent.py: the same flags there)
    grpo_entreg_target) echo "grpo_entreg --coef-rule target --clamp-p 0 --entropy-target 0.09 --entropy-coef 0
                              --entropy-coef-delta 0.005 --entropy-coef-min 0 --entropy-coef-max 0.5" ;;
    # the entropy bonus on a schedule (issue 59; chosen before its runs; grpo_aent_linear before): grpo_aent's coef_0
    # (0.05) annealed linearly to 0 over the run, no controller (Entrocraft's best schedule: linear annealing), the
    # clamped entropy as grpo_aent
    grpo_entreg_linear) echo "grpo_entreg --coef-rule linear --clamp-p 0.33 --entropy-coef 0.05 --entropy-coef-end 0" ;;
    # the plain entropy bonus (verl's entropy_coeff, the baseline AEnt's paper argues against; grpo_aent_plain
    # before): the full entropy at grpo_aent's coef_0, constant
    grpo_entreg_plain) echo "grpo_entreg --coef-rule constant --clamp-p 0 --entropy-coef 0.05" ;;
    # issue 60's two controls on the fork testbed (chosen before their runs): Pass@k Training at k 4 of the group of 8
    # (the method's default), and GRPO with the k3 KL to the initial policy at the GRPO paper's 0.04 (a per-token
    # coefficient of a per-token KL in nats: unscaled)
    grpo_passk) echo "--passk-k 4" ;;
    grpo_vanilla_kl) echo "grpo_vanilla --kl-coef 0.04" ;;
    # DAPO's clip-higher, the Cov authors' second baseline (their 7b_cliphigher.sh): the upper clip 0.28
    grpo_vanilla_cliphigher) echo "grpo_vanilla --clip-eps-high 0.28" ;;
    # the control of grpo_aent_top20 (one seed of three exploded): the same flags, the bonus and the coefficient's
    # entropy over every token instead of the kept ones
    grpo_aent_top20_all) echo "grpo_aent --top-entropy-quantile 0.2 --entropy-bonus-tokens all --clamp-p 0.33
                               --entropy-coef 0.01 --entropy-low 0.38 --entropy-high 0.47 --entropy-coef-lr 0.02
                               --entropy-coef-warmup 10 --entropy-coef-min 0 --entropy-coef-max 0.1" ;;
    # DAPO's dynamic sampling (as every Cov run of the authors): groups whose accuracy is all-equal are dropped and
    # more prompts generated, at most 10 rounds; each method's flags otherwise as above
    grpo_vanilla_filter) echo "grpo_vanilla --filter-groups" ;;
    grpo_klcov_filter) echo "grpo_klcov --kl-cov-ratio 0.1 --ppo-kl-coef 1 --filter-groups" ;;
    grpo_clipcov_filter) echo "grpo_clipcov --clip-cov-ratio 0.02 --clip-cov-lb 0.5 --clip-cov-ub 5 --clip-eps-low 0.2
                               --clip-eps-high 0.2 --filter-groups" ;;
    # the entropy-based advantage (arXiv 2506.14758) with the paper's GRPO values, unscaled: the bonus alpha H_t is
    # per token, and its high-entropy tokens (where it is larger than a few % of |A|) have entropies near a 1.5B
    # model's (0.3-1 nats); the cap |A| / kappa is relative to the advantage, which is normalised the same way here
    grpo_entadv) echo "--entadv-alpha 0.4 --entadv-kappa 2" ;;
    # the loss variants at their published values, unscaled: SAPO's temperatures (1.0 / 1.05) and GSPO's clip (3e-4 /
    # 4e-4) act on ratios, W-REINFORCE's lambda (0.1) on a 0/1 reward; SAPO and GSPO weigh every sequence the same
    # (their --loss-agg seq-mean-token-mean, vanilla's token-mean), as their references do
    grpo_sapo|grpo_gspo|grpo_wreinforce) echo "" ;;
    # one-step-off-policy (--rollout-ranks 1: one trainer, one rollout rank, so 2 processes a run): step t trains on
    # samples of the policy after step t - 1, weighted by min(pi_old / pi_sampler, 2) (the decoupled loss's behaviour
    # correction: at s = 0 the weights are 1 to ~4e-7 here, so the synchronous runs' --vllm-is-cap 0 changes nothing)
    grpo_vanilla_s1) echo "grpo_vanilla --rollout-ranks 1 --max-staleness 1 --vllm-is-cap 2" ;;
    grpo_aent_s1) echo "grpo_aent --clamp-p 0.33 --entropy-coef 0.05 --entropy-low 0.08 --entropy-high 0.10
                        --entropy-coef-lr 0.5 --entropy-coef-warmup 10 --entropy-coef-min 0 --entropy-coef-max 0.5
                        --rollout-ranks 1 --max-staleness 1 --vllm-is-cap 2" ;;
    # CISPO (arXiv 2506.13585) as verl's example: the weight clipped to [1 - 10, 1 + 0.2], i.e. no lower bound (bounds
    # on the ratio: independent of the model and the response length)
    grpo_cispo) echo "--clip-eps-low 10 --clip-eps-high 0.2" ;;
    # CE-GPPO (arXiv 2509.20712) as the authors' 1.5B script: beta1 0.5, beta2 1, clip 0.2 / 0.2, dual clip c = 10;
    # without its SFT term (--cegppo-sft-coef 0, the default): the only difference from vanilla is the clipping
    grpo_cegppo) echo "--cegppo-beta1 0.5 --cegppo-beta2 1 --clip-ratio-c 10" ;;
    # Lp-Reg (arXiv 2510.03222) as the authors' 14B script: kappa 0.02, rho 0.01 (a share of the A < 0 tokens: ~10 of
    # a mini-batch's ~1,000 here), beta 1; PPO clip 0.2 / 0.2 as the other methods (the script's 1 / 9: ratio in
    # [0, 10]), so that the only difference from vanilla is the penalty
    grpo_lpreg) echo "--lpreg-kappa 0.02 --lpreg-rho 0.01 --lpreg-beta 1 --clip-eps-low 0.2 --clip-eps-high 0.2" ;;
    # 8 updates per step (CE-GPPO's scripts: mini-batches of 16 of 128 prompts; CISPO's example: 4 of 1,024): the
    # policy moves away from the sampler within a step and the clip acts (2 mini-batches leave ~0.1% of the tokens
    # outside the clip range); micro-batches of 16, the mini-batch's size (the loss does not depend on it)
    grpo_vanilla_mb8) echo "grpo_vanilla --num-mini-batches 8 --micro-batch-size 16" ;;
    grpo_cispo_mb8) echo "grpo_cispo --clip-eps-low 10 --clip-eps-high 0.2 --num-mini-batches 8 --micro-batch-size 16" ;;
    grpo_cegppo_mb8) echo "grpo_cegppo --cegppo-beta1 0.5 --cegppo-beta2 1 --clip-ratio-c 10 --num-mini-batches 8
                           --micro-batch-size 16" ;;
    *) [ -f "$1.py" ] || { echo "unknown method $1: no $1.py (a variant: METHOD_FLAGS_$1=\"<script> <flags>\")" >&2
                           exit 1; } ;;
  esac
}

i=0
for seed in $SEEDS; do  # seed-major, so a partial result has every method
  for method in $METHODS; do
    # shellcheck disable=SC2046  # the method's flags are split on purpose
    flags=$(method_flags "$method" | tr '\n' ' ') || exit 1
    script=$method  # a variant's flags start with the script it runs
    [ -f "$script.py" ] || read -r script flags <<< "$flags"
    nproc=1  # and one process per rollout rank
    if [[ $flags =~ --rollout-ranks\ ([0-9]+) ]]; then nproc=$((1 + BASH_REMATCH[1])); fi
    cmd=("$PY" -m torch.distributed.run --nproc_per_node $nproc --master_port $((PORT + i)) "$script.py" "${COMMON[@]}"
         $flags --exp-name "$method" --seed "$seed")
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

cmd=("$PY" -m benchmarks.compare --runs "$OUT/*" --output-dir "$RESULTS" --baseline grpo_vanilla --smooth 10)
if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "${cmd[@]}"; echo; else "${cmd[@]}"; echo "total: $SECONDS s"; fi
