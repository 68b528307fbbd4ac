#!/bin/bash
# The equal-budget study of PLAN.md (benchmarks/results/tune/), method after method (each one's journal resumes where
# it stopped: run it again after a kill, on another day), then its report (README.md, trials.jsonl, fronts.png there;
# tune_confirm.sh here). On 2 cores: ~20 minutes a method (10 trials of 60 steps, 2 at a time, ~4 minutes a pair).
#   bash benchmarks/reproduce/tune_study.sh
set -u
cd "$(dirname "$0")/../.."
export $(grep -v '^#' cpu.env | xargs)
PY=${PY:-.venv/bin/python}
for m in grpo_vanilla grpo_passk grpo_aent grpo_vanilla_top grpo_klcov grpo_clipcov grpo_entadv grpo_cispo grpo_cegppo \
         grpo_lpreg grpo_sapo grpo_gspo grpo_wreinforce; do
  "$PY" -m benchmarks.tune --method "$m" --trials 10 --steps 60 --journal "benchmarks/results/tune/$m.log" \
      --output-dir runs/tune || exit 1
done
"$PY" -m benchmarks.tune_report --journals benchmarks/results/tune --runs runs/tune --out benchmarks/results/tune
