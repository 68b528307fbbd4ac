"""utils/fork_testbed.py: the shipped fork testbed (its files, its task, the base policy's fork) and the opening
metrics every script logs (utils/tracking.opening_metrics) on two gloo ranks."""

import dataclasses
import json
import os
import socket
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from utils import fork_testbed as fork
from utils import testbed as tb
from utils import tracking
from utils.reward import math_reward


def test_shipped_fork_testbed_matches_its_recipe_and_hashes():
    """testbed/fork/ is the build its stats.json describes, and the first testbed's hashes leave it out."""
    with open(os.path.join(fork.SHIPPED_DIR, "stats.json")) as f:
        stats = json.load(f)
    assert stats["version"] == fork.VERSION and stats["recipe"] == dataclasses.asdict(fork.Recipe())
    assert tb.files_sha256(fork.SHIPPED_DIR) == stats["files_sha256"]
    assert not any(path.startswith("fork/") for path in tb.files_sha256(tb.SHIPPED_DIR))
    assert fork.build_fork_testbed().stats == stats  # found, not rebuilt


def test_the_task_kinds_answers_and_branches():
    """The kind is a hash of the two numbers (about one in four), the answer the sum or the difference by kind; the
    shipped files are the recipe's splits; each branch's worked solution is graded right on its own kind only."""
    r = fork.Recipe()
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
            assert fork.branch_of(text) == branch
            right = math_reward(text, row["answer"])
            assert right == (1.0 if branch == (row["data_source"] == "minority") else 0.0), (text, row)
    assert fork.kind(37, 48) == fork.kind(37, 48) and fork.branch_of("the sum") is None


def test_base_policy_forks_the_same_way_on_both_kinds():
    """The base policy opens with the rare branch on about one sample in five, whatever the kind (the prompt says
    nothing about it), and executes either branch: its minority problems are solvable by sampling."""
    t = fork.build_fork_testbed()
    tok = AutoTokenizer.from_pretrained(t.model_dir)
    model = AutoModelForCausalLM.from_pretrained(t.model_dir, dtype=torch.float32)
    rows = fork.split_problems(fork.Recipe())["test"]
    with tb._quiet_and_isolated(1):
        by_kind = {
            k: fork.measure(model, tok, [row for row in rows if row["data_source"] == k][:24], 8, seed=3)
            for k in ("majority", "minority")
        }
    for k, m in by_kind.items():
        assert 0.12 < m["rare_share"] < 0.4 and m["other_share"] < 0.05, (k, m)
        assert m["execution_accuracy"] > 0.5 and 0.2 < m["fork_entropy"] < 0.8, (k, m)
    assert by_kind["majority"]["accuracy"] > 2 * by_kind["minority"]["accuracy"] > 0
    assert by_kind["minority"]["pass@k"]["8"] > 0.4


def _opening_worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # rank 0: two micro-batches (3 and 1 responses), rank 1: one (2 responses); first tokens 5 5 7 | 5 | 9 5
        lengths = [[2, 3, 1], [4]] if rank == 0 else [[1, 2]]
        first_ids = [5, 5, 7, 5] if rank == 0 else [9, 5]
        entropies, k = [], 0
        for mb in lengths:
            flat = torch.cat([torch.full((n,), 0.01) for n in mb])
            starts = torch.tensor([0, *mb]).cumsum(0)[:-1]
            for s in starts:
                flat[s] = 0.1 * (k + 1) + rank  # each response's first-token entropy
                k += 1
            entropies.append(flat)
        batches = [{"lengths": torch.tensor(mb)} for mb in lengths]
        samples = [SimpleNamespace(ids=[i, 1, 2]) for i in first_ids]
        results[rank] = tracking.opening_metrics(entropies, batches, samples)
    finally:
        dist.destroy_process_group()


def test_opening_metrics_over_two_ranks():
    """entropy/first_token is the mean over all ranks' responses of their first token's entropy, whatever the
    micro-batches; rollout/first_token_minority the share not opening with the most frequent first token."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_opening_worker, args=(port, results), nprocs=2, join=True)
    assert results[0] == results[1]
    first = [0.1, 0.2, 0.3, 0.4, 1.1, 1.2]
    assert results[0]["entropy/first_token"] == pytest.approx(sum(first) / 6)
    assert results[0]["rollout/first_token_minority"] == pytest.approx(2 / 6)  # 5 opens 4 of the 6
