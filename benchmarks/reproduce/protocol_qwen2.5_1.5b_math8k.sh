#!/usr/bin/env bash
# The entropy-collapse evaluation protocol, end to end: Qwen2.5-1.5B trained with GRPO and an entropy method on an
# 8k-problem MATH set (8 x 80 GB GPUs, a 24 h training budget), the checkpoint with the best dev accuracy (GSM8K and
# AMC23, evaluated during training) exported as an HF model, then MATH-500 evaluated with the protocol's two files:
#   <run>/best/eval/protocol/math_results.parquet     sample_id (int64, test-set order), output (ending Answer:\boxed{})
#   <run>/best/eval/protocol/math_results_logits.pt   one float16 [generated tokens, vocab] tensor per sample (~90 GB)
# Score: MATH-500 accuracy (must beat the GRPO baseline: the vanilla run) x entropy score (mean entropy in a range).
#
# Every setting below is an environment variable (the defaults: the GPU run above; paths relative to the repository
# root, where the script runs):
#   MODEL, TRAIN          the model to train (hub id or folder) and the training set (default: built, see below)
#   DEV                   the dev sets evaluated during training, space-separated (default: gsm8k's and amc23's files)
#   TEST                  the test set of the export: a vendored name or a path (default: math500)
#   NUM_GPUS, MASTER_PORT ranks per node (deepspeed --num_gpus; DS_ACCELERATOR=cpu: processes on the CPU) and the
#                         port they meet on (deepspeed's default, 29500; another one for runs side by side)
#   TOTAL_STEPS, EVAL_EVERY, KEEP, SEEDS, SELECT_METRIC, EXPORT_LOGITS, DECODING, OUT: below (set the steps and the
#                         evaluations here, not in TRAIN_FLAGS: --save-every and KEEP follow them)
#   METHODS               vanilla aent klcov clipcov, or any grpo_<name>.py: its flags from $METHOD_FLAGS_grpo_<name>
#                         (replacing the ones below; a script without either runs with its defaults); a name without
#                         a script stops the script before any training
#   TRAIN_FLAGS           extra flags of every training command, after all others (the last of a flag wins): e.g.
#                         smaller batches and lengths than the 8-GPU ones, split on whitespace
#   EVAL_FLAGS            the same for benchmarks/eval.py (e.g. --max-prompt-length, --no-use-vllm)
# `deepspeed` and `python` are the ones on PATH (an activated venv).
#
# Checked here: tests/test_protocol.py runs this script as it is on the CPU testbed (2 ranks through deepspeed's
# launcher, vanilla, 4 steps with dev evaluations at 0, 2 and 4, small sizes through TRAIN_FLAGS and EVAL_FLAGS): the
# checkpoint chosen is the one with the best SELECT_METRIC in metrics.jsonl, the exported weights are its fp32 master
# weights, and the protocol's two files are written as the protocol reads them; DRY_RUN's commands against the
# scripts' flag checks (tests/test_compare.py). NOT checked: build_math8k (it needs the Hugging Face hub, for MATH, as
# the default MODEL does), the GPU runs (this repository's machines have no GPU), the default sizes, and vLLM and
# wandb within this script (the test turns them off for time; tests/test_eval.py and tests/test_e2e.py run them).
#
#   bash benchmarks/reproduce/protocol_qwen2.5_1.5b_math8k.sh                  # all four methods, one after another
#   METHODS=aent bash benchmarks/reproduce/protocol_qwen2.5_1.5b_math8k.sh     # one method: vanilla aent klcov clipcov
#   METHODS="vanilla mine" METHOD_FLAGS_grpo_mine="--my-coef 0.1" bash ...     # any grpo_<name>.py, with its flags
#   SKIP_TRAINING=1 bash ...     # only pick, export and evaluate the runs already under OUT (e.g. after a kill at 24 h)
#   DRY_RUN=1 bash ...           # print the commands only (the python helper steps: named on stderr)
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/reproduce/aent_settings.bash  # AEnt's settings, its warm-up translated once

SEEDS=${SEEDS:-"1"}
METHODS=${METHODS:-"vanilla aent klcov clipcov"}  # short names or the scripts' (grpo_aent)
NUM_GPUS=${NUM_GPUS:-8}
MASTER_PORT=${MASTER_PORT:-29500}
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B}
read -ra DEV_SETS <<<"${DEV:-benchmarks/data/gsm8k.jsonl benchmarks/data/amc23.jsonl}"  # evaluated during training
TEST=${TEST:-math500}  # the protocol's test set: a vendored name (benchmarks/data/<name>.jsonl) or a path
read -ra TRAIN_EXTRA <<<"${TRAIN_FLAGS:-}"  # after every other flag of a training command: the last one wins
read -ra EVAL_EXTRA <<<"${EVAL_FLAGS:-}"    # the same for eval.py
# not fixed by the protocol: training must end within 24 h. A step's time (512 x 16 rollouts of up to 3,072 tokens on
# 8 GPUs) is not measured here: read time/step from the first steps' metrics.jsonl and set TOTAL_STEPS to fit, with
# the evaluations. (A kill at 24 h loses only the steps since the last checkpoint: then SKIP_TRAINING=1.)
TOTAL_STEPS=${TOTAL_STEPS:-200}
EVAL_EVERY=${EVAL_EVERY:-10}  # dev evaluation and a checkpoint every this many steps
# every evaluated step keeps its DeepSpeed checkpoint (bf16 weights, fp32 master weights and Adam's moments: ~21 GB at
# 1.5B), so that the best can be exported: ~420 GB per run at the defaults. A smaller KEEP picks among the newest KEEP
KEEP=${KEEP:-$((TOTAL_STEPS / EVAL_EVERY + 1))}
SELECT_METRIC=${SELECT_METRIC:-eval/acc}  # greedy accuracy, the unweighted mean over the DEV sets
EXPORT_LOGITS=${EXPORT_LOGITS:-1}  # 0: math_results.parquet only (the logits need ~2 x 90 GB of disk while written)
read -ra DECODING <<<"${DECODING:---greedy}"  # the protocol fixes no decoding: greedy is deterministic
OUT=${OUT:-runs/protocol_qwen2.5_1.5b_math8k}
TRAIN=${TRAIN:-$OUT/math8k.jsonl}  # built below unless it exists

run() {  # run a command, or only print it with DRY_RUN=1
  if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# The 8k MATH training set, built as SimpleRL-Zoo's "8K MATH" (hkust-nlp/simpleRL-reason's math_level3to5 data) is
# described: the Level 3-5 problems of all 12,500 MATH problems (train 7,500 + test 5,000, from the hub's
# DigitalLearningGmbH/MATH-lighteval, the training scripts' default dataset) less the 500 of MATH-500, the test set:
# ~8.5k rows of {problem, solution, level, type} (the count it prints is not checked here: no network); the reference
# answer is the last \boxed{} of the solution (utils.data.load_problems). Or set TRAIN to a file of your own.
build_math8k() {
  mkdir -p "$(dirname "$1")"
  python - "$1" <<'EOF'
import json, sys
import datasets

same = lambda text: "".join(text.split())  # whitespace-insensitive match
math500 = {same(json.loads(line)["problem"]) for line in open("benchmarks/data/math500.jsonl")}
rows, held_out = [], 0
for split in ("train", "test"):
    for r in datasets.load_dataset("DigitalLearningGmbH/MATH-lighteval", split=split):
        if same(r["problem"]) in math500:
            held_out += 1
        elif r["level"] in ("Level 3", "Level 4", "Level 5"):
            rows.append({k: r[k] for k in ("problem", "solution", "level", "type")})
if held_out != 500:
    print(f"warning: {held_out} of MATH-500's 500 problems found in MATH (the rest may be in the training set)")
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
print(f"wrote {len(rows)} problems to {sys.argv[1]} ({held_out} MATH-500 problems left out)")
EOF
}

# The run's checkpoint with the highest SELECT_METRIC among its evaluated steps still on disk (ties: the earlier step)
best_checkpoint() {
  python - "$1" "$SELECT_METRIC" <<'EOF'
import json, os, sys

run, metric = sys.argv[1:]
scores = {}
for line in open(os.path.join(run, "metrics.jsonl")):
    row = json.loads(line)
    if metric in row:
        scores[row["step"]] = row[metric]
path = lambda s: os.path.realpath(os.path.join(run, "checkpoints", f"step_{s:07d}"))
kept = {s: v for s, v in sorted(scores.items()) if os.path.isdir(path(s))}
if not kept:
    sys.exit(f"error: {run}: no step with {metric} has a checkpoint (train with --save-every = --eval-every)")
best = max(kept, key=kept.get)
print(f"{run}: best {metric} {kept[best]:.4f} at step {best} of {sorted(kept)}", file=sys.stderr)
if scores.get(0, float("-inf")) > kept[best]:
    print(f"warning: the initial model ({metric} {scores[0]:.4f}) beats every checkpoint", file=sys.stderr)
print(path(best))
EOF
}

# A checkpoint (DeepSpeed state) as an HF model folder, loadable by transformers and vLLM: DeepSpeed's own converter
# (zero_to_fp32, any ZeRO stage) gathers the fp32 master weights, saved in the model's dtype (bf16 for Qwen2.5: the
# weights training ran and evaluated, as in final/) with the config, generation config and tokenizer of the model the
# run started from (the state dict goes through the model: safetensors refuses the tied embedding twice)
export_hf() {
  python - "$1" "$2" <<'EOF'
import json, os, sys

from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

checkpoint, out = sys.argv[1:]
with open(os.path.join(checkpoint, "trainer_state.json")) as f:
    base = json.load(f)["args"]["model_name_or_path"]
config = AutoConfig.from_pretrained(base)
model = AutoModelForCausalLM.from_config(config)
model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag="state"))
model.to(config.dtype or model.dtype).save_pretrained(out)
AutoTokenizer.from_pretrained(base).save_pretrained(out)
try:
    GenerationConfig.from_pretrained(base).save_pretrained(out)
except OSError:  # the model has none
    pass
with open(os.path.join(out, "source.json"), "w") as f:
    json.dump({"checkpoint": os.path.realpath(checkpoint), "base": base}, f)
print(f"exported {checkpoint} to {out}")
EOF
}

# shared by every method: AEnt's MATH run (the closest published setting: a 1.5B Qwen on MATH; 512 prompts x 16,
# 1024 / 3072 tokens, lr 2e-6, 4 mini-batches, no KL, verl's dual clip 3), the dev sets evaluated and checkpointed
COMMON=(
  --model-name-or-path "$MODEL" --dataset "$TRAIN"
  --eval-dataset "${DEV_SETS[@]}" --eval-every "$EVAL_EVERY"
  --eval-num-prompts 1319 --save-every "$EVAL_EVERY" --keep-checkpoints "$KEEP"
  --output-dir "$OUT" --total-steps "$TOTAL_STEPS" --track --wandb-project-name grpo-entropy
  --wandb-tags protocol_qwen2.5_1.5b_math8k
  --num-prompts-per-step 512 --group-size 16 --max-prompt-length 1024 --max-response-length 3072
  --temperature 1.0 --learning-rate 2e-6 --num-mini-batches 4 --num-epochs 1
  --kl-coef 0 --clip-ratio-c 3 --gradient-checkpointing --vllm-gpu-memory-utilization 0.55
)
method_flags() {  # $METHOD_FLAGS_<script>, when set, replaces the flags below
  local own="METHOD_FLAGS_$1"
  if [ -n "${!own+set}" ]; then echo "${!own}"; return; fi
  case "$1" in
    grpo_vanilla) echo "--clip-eps-low 0.2 --clip-eps-high 0.2" ;;
    # AEnt's MATH run (Qwen2.5-Math-1.5B); its entropy box is model-specific: check entropy/clamped of the first steps
    grpo_aent) echo "--clip-eps-low 0.2 --clip-eps-high 0.2 $AENT_MATH" ;;
    # the Cov paper's 7B values (it has no 1.5B setting); KL-Cov uses no PPO clipping
    grpo_klcov) echo "--kl-cov-ratio 2e-3 --ppo-kl-coef 1" ;;
    grpo_clipcov) echo "--clip-cov-ratio 2e-4 --clip-cov-lb 1 --clip-cov-ub 5 --clip-eps-low 1 --clip-eps-high 1" ;;
    # the entropy-based advantage with the paper's GRPO values (METHODS="vanilla entadv")
    grpo_entadv) echo "--clip-eps-low 0.2 --clip-eps-high 0.2 --entadv-alpha 0.4 --entadv-kappa 2" ;;
    # the new remedies with their published values (METHODS="vanilla cispo cegppo lpreg"): CISPO as verl's example
    # (no dual clip); CE-GPPO's 1.5B script without its SFT term (the clipping alone); Lp-Reg's 14B script, clip 1 / 9
    grpo_cispo) echo "--clip-eps-low 10 --clip-eps-high 0.2 --clip-ratio-c 0" ;;
    grpo_cegppo) echo "--clip-eps-low 0.2 --clip-eps-high 0.2 --cegppo-beta1 0.5 --cegppo-beta2 1" ;;
    grpo_lpreg) echo "--clip-eps-low 1 --clip-eps-high 9 --clip-ratio-c 0 --lpreg-kappa 0.02 --lpreg-rho 0.01" ;;
    *) [ -f "$1.py" ] || { echo "unknown method $1: no $1.py (vanilla, aent, klcov, clipcov or a grpo_<name>.py)" >&2
                           exit 1; } ;;
  esac
}

if [ -z "${SKIP_TRAINING:-}" ]; then
  declare -A flags_of  # every method's flags before any training: a wrong name stops the script at once
  for method in $METHODS; do
    method=grpo_${method#grpo_}
    flags_of[$method]=$(method_flags "$method" | tr '\n' ' ') || exit 1
  done
  if [ ! -e "$TRAIN" ]; then
    if [ -n "${DRY_RUN:-}" ]; then echo "# build_math8k $TRAIN" >&2; else build_math8k "$TRAIN"; fi
  fi
  for method in $METHODS; do
    method=grpo_${method#grpo_}
    for seed in $SEEDS; do
      # shellcheck disable=SC2086  # the method's flags are split on purpose
      run deepspeed --num_gpus "$NUM_GPUS" --master_port "$MASTER_PORT" "$method.py" "${COMMON[@]}" \
        ${flags_of[$method]} --seed "$seed" "${TRAIN_EXTRA[@]}"
    done
  done
fi

# every run under OUT: its best checkpoint as best/ (HF; kept while it is still the best), then TEST (MATH-500) with
# the protocol's files (an engine per GPU)
runs=("$OUT"/grpo_*__*/)
if [ ! -e "${runs[0]}" ]; then
  [ -n "${DRY_RUN:-}" ] || { echo "error: no runs under $OUT" >&2; exit 1; }
  runs=("$OUT/<run_name>/")  # (dry run before training)
fi
logits=()
[ "$EXPORT_LOGITS" = 0 ] || logits=(--export-logits)
for dir in "${runs[@]}"; do
  dir=${dir%/}
  if [ -n "${DRY_RUN:-}" ]; then
    echo "# best_checkpoint $dir, then export_hf <it> $dir/best" >&2
  else
    checkpoint=$(best_checkpoint "$dir") || { echo "warning: $dir skipped" >&2; continue; }
    if ! grep -qsF "\"$checkpoint\"" "$dir/best/source.json"; then
      rm -rf "$dir/best"
      export_hf "$checkpoint" "$dir/best"
    fi
  fi
  run python -m benchmarks.eval --model-name-or-path "$dir/best" --output-dir "$dir/best/eval" \
    --datasets "$TEST" --protocol-dataset "$TEST" --export-protocol "${logits[@]}" "${DECODING[@]}" \
    --max-prompt-length 1024 --max-response-length 3072 "${EVAL_EXTRA[@]}"
done
