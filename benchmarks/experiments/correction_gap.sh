#!/usr/bin/env bash
# The rollout correction's modes (--rollout-correction) on the gap between the sampler and the trainer in bf16 on a
# CPU (--dtype bfloat16: vLLM-CPU and the DeepSpeed policy both in bf16, the rehearsal of a GPU run's numerics):
# 4 seeded steps of the testbed per mode; prints each step's mean |log-prob gap|, mean weight, shares truncated and
# masked. Result: benchmarks/results/rollout_correction_bf16.txt.
#   bash benchmarks/experiments/correction_gap.sh
set -u
cd "$(dirname "$0")/../.."
set -a; . ./cpu.env; set +a
mkdir -p "${OUT:-runs/correction_gap}"
TB=testbed
for mode in "token-truncate 0 2" "sequence-mask 0 3" "token-mask 0.5 2" "geo-mask 0.5 2" "sequence-truncate 0 2"; do
  read -r m low cap <<< "$mode"
  out=${OUT:-runs/correction_gap}/$m
  rm -rf $out
  .venv/bin/python -m torch.distributed.run --nproc_per_node 1 --master_port 29877 grpo_vanilla.py \
    --model-name-or-path $TB/model --dataset $TB/train.jsonl --total-steps 4 --num-prompts-per-step 16 --group-size 8 \
    --max-prompt-length 128 --max-response-length 48 --num-mini-batches 2 --micro-batch-size 32 --learning-rate 2e-4 \
    --warmup-steps 5 --no-gradient-checkpointing --eval-every 0 --save-every 0 --dtype bfloat16 \
    --rollout-correction $m --vllm-is-min $low --vllm-is-cap $cap --output-dir $out > $out.log 2>&1 || { echo "$m failed"; tail -5 $out.log; }
  .venv/bin/python - "$out" "$m $low $cap" <<'PYEOF'
import json, glob, sys
rows = [json.loads(l) for l in open(glob.glob(sys.argv[1] + "/*/metrics.jsonl")[0])]
keys = ["rollout/vllm_logprob_gap", "rollout/is_weight_mean", "rollout/is_clipped_frac", "rollout/is_masked_frac", "rollout/reward"]
for r in rows:
    print(f"{sys.argv[2]:24s} step {r['step']}: " + ", ".join(f"{k.split('/')[1]} {r[k]:.4g}" for k in keys))
PYEOF
done
