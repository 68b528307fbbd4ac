#!/bin/bash
# The equal-budget study's confirmation (PLAN.md): each method's picked point beside vanilla's, 200 steps on
# the fork testbed, seeds 11-13. Written by benchmarks/tune_report.py from the journals. Run from the root:
#   bash benchmarks/reproduce/tune_confirm.sh 11   # a seed's runs (its folder emptied first), the comparison
#   bash benchmarks/reproduce/tune_confirm.sh      # the comparison of every seed run so far (confirmation/)
set -euo pipefail
[ -f benchmarks/reproduce/testbed.sh ] || { echo "error: run from the repository's root" >&2; exit 1; }
export METHOD_FLAGS_grpo_vanilla="--kl-coef 0.001 --learning-rate 0.00011389755079412424 --num-mini-batches 2"
export METHOD_FLAGS_grpo_aent_tuned="grpo_aent --clamp-p 0.32811072392366103 --entropy-coef 0.013757369811750924 --entropy-coef-lr 0.6420196075368606 --entropy-coef-warmup 13 --entropy-high 0.044294528065247925 --entropy-low 0.035869476646595407 --learning-rate 8.059373170366217e-05 --num-mini-batches 1"
export METHOD_FLAGS_grpo_cegppo_tuned="grpo_cegppo --cegppo-beta1 0.7070294135216584 --cegppo-beta2 0.3734591646606521 --learning-rate 5.740045363204813e-05 --num-mini-batches 4"
export METHOD_FLAGS_grpo_cispo_tuned="grpo_cispo --clip-eps-high 0.23284282276398696 --clip-eps-low 0.2 --learning-rate 0.00019532453766334866 --num-mini-batches 1"
export METHOD_FLAGS_grpo_clipcov_tuned="grpo_clipcov --clip-cov-lb 0.7408418932933205 --clip-cov-ratio 0.03723919110756685 --clip-cov-ub 2.026907019932791 --learning-rate 6.265897678884651e-05 --num-mini-batches 4"
export METHOD_FLAGS_grpo_entadv_tuned="grpo_entadv --entadv-alpha 0.13056966834153594 --entadv-kappa 1.5769820619346986 --learning-rate 0.000130493784439773 --num-mini-batches 1"
export METHOD_FLAGS_grpo_gspo_tuned="grpo_gspo --clip-eps-high 0.0880404732433154 --clip-eps-low 0.0015781850936367162 --learning-rate 0.0001464684470438828 --num-mini-batches 2"
export METHOD_FLAGS_grpo_klcov_tuned="grpo_klcov --kl-cov-ratio 0.4633574091068603 --learning-rate 7.577038845351083e-05 --num-mini-batches 4 --ppo-kl-coef 0.22114349504725941"
export METHOD_FLAGS_grpo_lpreg_tuned="grpo_lpreg --learning-rate 5.4858904612033965e-05 --lpreg-beta 0.6723925204942278 --lpreg-kappa 0.08797338693053819 --lpreg-rho 0.024508833386449554 --num-mini-batches 4"
export METHOD_FLAGS_grpo_sapo_tuned="grpo_sapo --learning-rate 0.00011074277346998505 --num-mini-batches 1 --sapo-tau-neg 3.200489281915923 --sapo-tau-pos 0.4417947068326637"
export METHOD_FLAGS_grpo_vanilla_top_tuned="grpo_vanilla --learning-rate 0.00038297543562055723 --num-mini-batches 1 --top-entropy-quantile 0.8006326915208224"
export METHOD_FLAGS_grpo_wreinforce_tuned="grpo_wreinforce --learning-rate 0.00041303846734497263 --num-mini-batches 1 --wr-lambda 0.8665231104131983"
for seed in "$@"; do
  TESTBED=fork SEEDS=$seed OUT=runs/testbed_tuned/seed$seed \
    RESULTS=benchmarks/results/tune/confirmation/seed$seed \
    METHODS="grpo_vanilla grpo_aent_tuned grpo_cegppo_tuned grpo_cispo_tuned grpo_clipcov_tuned grpo_entadv_tuned grpo_gspo_tuned grpo_klcov_tuned grpo_lpreg_tuned grpo_sapo_tuned grpo_vanilla_top_tuned grpo_wreinforce_tuned" bash benchmarks/reproduce/testbed.sh
done
cmd=("${PY:-.venv/bin/python}" -m benchmarks.compare --runs "runs/testbed_tuned/seed*/*"
     --output-dir benchmarks/results/tune/confirmation --baseline grpo_vanilla --smooth 10)
if [ -n "${DRY_RUN:-}" ]; then echo "${cmd[*]}"; else "${cmd[@]}"; fi
