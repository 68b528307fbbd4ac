"""testbed/build_fork.py: the shipped fork testbed (its files, its task, the base policy's fork) and the opening
metrics every script logs (utils/tracking.opening_metrics)."""

import dataclasses
import json
import os
import socket
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from testbed import build_arithmetic as tb
from testbed import build_fork as fork
from testbed import common
from utils import tracking
from utils.reward import grade


def test_shipped_fork_testbed_matches_its_recipe_and_hashes():
    """testbed/fork/ is the build its stats.json describes, and the first testbed's hashes leave it out."""
    with open(os.path.join(fork.SHIPPED_DIR, "stats.json")) as f:
        stats = json.load(f)
    assert stats["version"] == fork.VERSION and stats["recipe"] == dataclasses.asdict(fork.ForkRecipe())
    assert common.files_sha256(fork.SHIPPED_DIR) == stats["files_sha256"]
    assert not any(path.startswith("fork/") for path in common.files_sha256(tb.SHIPPED_DIR))
    assert fork.build_fork_testbed().stats == stats  # found, not rebuilt


def test_the_task_kinds_answers_and_branches():
    """The kind is a hash of the two numbers (about one in four), the answer the sum or the difference by kind; the
    shipped files are the recipe's splits; each branch's worked solution is graded right on its own kind only."""
    r = fork.ForkRecipe()
    splits = fork.split_problems(r)
    kinds = Counter(row["data_source"] for row in splits["train"])
    assert 0.22 < kinds["minority"] / len(splits["train"]) < 0.28
    assert Counter(row["data_source"] for row in splits["test"]) == {"majority": 200, "minority": 200}
    keys = [{row["ab"] for row in rows} for rows in splits.values()]
    assert sum(map(len, keys)) == len(set().union(*keys))  # disjoint splits
    shipped = [json.loads(line) for line in open(os.path.join(fork.SHIPPED_DIR, "test.jsonl"))]
    assert shipped == [{k: row[k] for k in ("problem", "answer", "data_source")} for row in splits["test"]]
    for row in splits["test"][::20]:
        a, b = row["ab"]
        assert row["answer"] == str(a + b if row["data_source"] == "majority" else abs(a - b))
        for branch in (0, 1):
            text = fork.solution(a, b, branch)
            assert fork.branch_of(text) == branch == fork.procedure_of(text)
            right = grade(text, row["answer"])[0]
            assert right == (1.0 if branch == (row["data_source"] == "minority") else 0.0), (text, row)
    assert fork.branch_of("the sum") is None and fork.branch_of("a::: 37 + 48") == 0
    # what a trained policy may write: the letter of one branch, the operation of the other
    assert fork.branch_of("sdbb 61 + 48 = 109.") == 1 and fork.procedure_of("sdbb 61 + 48 = 109.") == 0
    assert fork.procedure_of("sub: 48 - 37 = 11.") == 1 and fork.procedure_of("add: 48 37") is None


def test_base_policy_forks_the_same_way_on_both_kinds():
    """The base policy opens with the rare branch on about one sample in five, whatever the kind (the prompt says
    nothing about it), and executes either branch: its minority problems are solvable by sampling."""
    t = fork.build_fork_testbed()
    tok = AutoTokenizer.from_pretrained(t.model_dir)
    model = AutoModelForCausalLM.from_pretrained(t.model_dir, dtype=torch.float32)
    rows = fork.split_problems(fork.ForkRecipe())["test"]
    with common.quiet_and_isolated(1):
        by_kind = {
            k: fork.measure(model, tok, [row for row in rows if row["data_source"] == k][:24], 8, seed=3)
            for k in ("majority", "minority")
        }
    for k, m in by_kind.items():
        assert 0.12 < m["rare_share"] < 0.4 and m["other_share"] < 0.05, (k, m)
        assert m["execution_accuracy"] > 0.5 and 0.2 < m["fork_entropy"] < 0.8, (k, m)
    assert by_kind["majority"]["accuracy"] > 2 * by_kind["minority"]["accuracy"] > 0
    assert by_kind["minority"]["pass@k"]["8"] > 0.4


def test_opening_metrics():
    """entropy/first_token is the mean of the responses' first-token entropies, whatever the micro-batches;
    rollout/first_token_minority the share not opening with the most frequent first token (on one gloo rank: the
    gather over ranks is gather_ranks, tested on two in test_selection's entropy/top20)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        lengths, first_ids = [[2, 3, 1], [4], [1, 2]], [5, 5, 7, 5, 9, 5]  # three micro-batches, six responses
        entropies, k = [], 0
        for mb in lengths:
            flat = torch.full((sum(mb),), 0.01)
            for start in torch.tensor([0, *mb]).cumsum(0)[:-1]:
                k += 1
                flat[start] = 0.1 * k  # each response's first-token entropy
            entropies.append(flat)
        batches = [{"lengths": torch.tensor(mb)} for mb in lengths]
        samples = [SimpleNamespace(ids=[i, 1, 2]) for i in first_ids]
        metrics = tracking.opening_metrics(entropies, batches, samples)
    finally:
        dist.destroy_process_group()
    assert metrics["entropy/first_token"] == pytest.approx(0.1 * sum(range(1, 7)) / 6)
    assert metrics["rollout/first_token_minority"] == pytest.approx(2 / 6)  # 5 opens 4 of the 6
    assert metrics["entropy/top20"] == pytest.approx(torch.cat(entropies).topk(3).values.mean().item())


def test_make_testbed_fork_runs_the_fork_testbed_with_the_first_ones_settings():
    """`make testbed TESTBED=fork` passes the script the fork testbed's files and the first testbed's GRPO settings
    but for the response length and the prompts per eval set; without TESTBED the first testbed, unchanged."""
    import shlex
    import subprocess

    import tyro

    from grpo_vanilla import Args

    def flags(*make_args):
        out = subprocess.run(["make", "-n", "testbed", *make_args], capture_output=True, text=True, check=True)
        line = next(x for x in out.stdout.replace("\\\n", " ").splitlines() if "grpo_vanilla.py" in x)
        return shlex.split(line.split("grpo_vanilla.py", 1)[1])

    first, forked = tyro.cli(Args, args=flags()), tyro.cli(Args, args=flags("TESTBED=fork"))
    assert (first.model_name_or_path, first.max_response_length, first.eval_num_prompts) == ("testbed/model", 48, 200)
    assert (forked.model_name_or_path, forked.dataset, forked.eval_dataset) == (
        "testbed/fork/model",
        "testbed/fork/train.jsonl",
        ("testbed/fork/test.jsonl",),
    )
    assert (forked.max_response_length, forked.eval_num_prompts) == (32, 100)
    changed = {k for k, v in vars(first).items() if vars(forked)[k] != v}
    assert changed == {"model_name_or_path", "dataset", "eval_dataset", "max_response_length", "eval_num_prompts"}


@pytest.mark.launches
def test_fork_branches_measures_every_runs_final_model(tmp_path):
    """benchmarks/experiments/fork_branches.py on two runs (the base model as their final/): a row per configuration
    with the opening letter, the procedure and the minority pass@k, the initial policy's row, and a difference row; the
    procedure share of the base policy is about its rare branch's (0.3), the letter's too."""
    from launch import CPU_ENV, run_python

    for name, seed in (("grpo_vanilla", 1), ("grpo_vanilla", 2), ("grpo_mine", 1)):
        run = tmp_path / "runs" / f"{name}__{seed}"
        run.mkdir(parents=True)
        (run / "final").symlink_to(os.path.join(fork.SHIPPED_DIR, "model"))
        (run / "args.json").write_text(json.dumps({"exp_name": name, "seed": seed}))
    out = tmp_path / "branches.md"
    argv = ["-m", "benchmarks.experiments.fork_branches", "--runs", str(tmp_path / "runs" / "*"), "--output", str(out)]
    proc = run_python([*argv, "--problems", "8", "--samples", "4"], {**os.environ, **CPU_ENV})
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = out.read_text()
    assert "| initial policy | 1 |" in table and "| grpo_vanilla | 2 |" in table and "grpo_mine - grpo_vanilla" in table
    figures = json.loads((tmp_path / "branches.json").read_text())
    base = figures["initial policy"][0]["minority"]
    assert 0.1 < base["rare_procedure_share"] < 0.6 and 0.1 < base["rare_share"] < 0.6
    assert figures["grpo_vanilla"][0] == figures["grpo_vanilla"][1] == figures["initial policy"][0]  # seeded
