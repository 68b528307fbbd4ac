#!/usr/bin/env bash
# The weight push, per parameter against grouped (python -m benchmarks.experiments.bench_push_weights), on 2 ranks with
# the CPU environment: the testbed model and a 24-layer model built locally, ZeRO-2 and ZeRO-3. One JSON line per case
# in $OUT (default benchmarks/results/push_weights.jsonl).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/push_weights.jsonl}
REPEATS=${REPEATS:-5}
export $(grep -v '^#' cpu.env | xargs)
for stage in 2 3; do
    for model in "--model testbed/model" "--layers 24 --hidden 512"; do
        MASTER_PORT=$((29000 + RANDOM % 900)) timeout 900 .venv/bin/torchrun --nproc_per_node 2 \
            -m benchmarks.experiments.bench_push_weights $model --zero-stage "$stage" --repeats "$REPEATS" \
            --json "$OUT" \
            > /dev/null 2>&1 || { echo "failed: $model --zero-stage $stage"; exit 1; }
        tail -1 "$OUT"
    done
done
