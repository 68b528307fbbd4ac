"""The fork testbed: a task where GRPO's collapse costs something, because a rare opening is the only way to solve some
problems and the model cannot tell which from the prompt.

Shipped in `testbed/fork/` (model, tokenizer, data, stats.json with the sha256 of every file) beside the arithmetic
testbed (testbed/build_arithmetic.py): its policy, which already adds and subtracts two-digit numbers, is taught the new
task by a short SFT (the same loop, testbed/common.py); `python -m testbed.build_fork --force` rebuilds it (~2 min on
one core).

Task: "What is 37 # 48?" for two two-digit numbers. `#` means the sum on three problems in four and the difference
(larger minus smaller) on the fourth, chosen by a hash of the two numbers: nothing the model can read or learn from
the prompt (a stand-in for the features a small model cannot see that decide which strategy a problem needs).
The response opens with the fork, its first token, naming the procedure, then carries it out:
    add: 37 + 48 = 85. \\boxed{85}          (right on the majority kind)
    sub: 48 - 37 = 11. \\boxed{11}          (right on the minority kind)
The SFT data takes the difference with probability `rare_rate` whatever the problem, and writes the result wrong with
probability `slip_rate` (a digit off by one, a dropped carry or borrow). So the base policy opens with "sub" on
about one sample in five on every problem: on the minority kind a rare branch that 16 samples reach almost always.

Why GRPO sharpens it away: the prompt carries no information about the kind, so the fork's choice is one
probability p for every prompt. Its expected reward is (1 - p) x 3/4 + p x 1/4 (times the execution's accuracy),
highest at p = 0; a group's reward std is the same on both kinds (Bernoulli of p or 1 - p), so the group scaling
does not change the sign of the push: the policy gradient moves p towards 0. Pass@1 rises (to ~3/4 of execution
accuracy), and pass@k on the minority kind falls from near 1 towards 0: the narrowing of Yue et al. (2025,
arXiv 2504.13837) in miniature. A remedy that keeps the fork's entropy keeps the minority solvable at pass@k.

Splits (disjoint problems): SFT, dev, train.jsonl (4,000, the natural mix), test.jsonl (200 of each kind, their
`data_source` "majority" / "minority": the scripts evaluate them as two sets, eval/majority/... and eval/minority/...).
"""

import argparse
import dataclasses
import hashlib
import json
import os
import random
import re
import time

from testbed import build_arithmetic, common
from testbed.common import (
    Recipe,
    cached_build,
    files_sha256,
    load_build,
    load_model,
    quiet_and_isolated,
    weights_sha256,
)

VERSION = "fork-v1"
SHIPPED_DIR = os.path.join(build_arithmetic.SHIPPED_DIR, "fork")
BASE_WEIGHTS_SHA256 = "4f707c83c22da27140d066d529d6ba54fececece201b11a1df5dcd610db6ecd0"
FIELDS = ("problem", "answer", "data_source")  # of train.jsonl and test.jsonl
BRANCHES = ("add", "sub")
"""The fork: the first word of a response; the sum is right on the majority kind, the difference on the minority."""


@dataclasses.dataclass(kw_only=True)
class ForkRecipe(Recipe):
    """The fork testbed's build (with Recipe's fields). Changing a default here means bumping VERSION."""

    n_test_per_kind: int = 200
    """test problems of each kind; the pairs left after test, train and dev (3,354 of the 8,010) are the SFT problems"""
    sft_repeats: int = 6
    """each SFT problem appears this many times, each with its own sampled response"""
    minority_every: int = 4
    """one problem in this many (by the hash of its numbers) is of the minority kind, `#` the difference"""
    rare_rate: float = 0.3
    """chance that an SFT solution opens with the difference, whatever the kind (the base policy's rare branch)"""
    slip_rate: float = 0.2
    """chance that an SFT solution writes its result wrong"""
    base: str = build_arithmetic.VERSION
    """the policy it starts from: the arithmetic testbed's (testbed/model; its weights' sha256 is checked)"""
    lr: float = 5e-4
    sft_steps: int = 500
    eval_every: int = 100


def kind(a: int, b: int, every: int = 4) -> str:
    """'minority' for one pair in `every` by a hash of the two numbers, else 'majority': no function of the digits a
    small model could learn from 4,000 examples."""
    h = int(hashlib.sha256(f"{a} {b}".encode()).hexdigest()[:8], 16)
    return "minority" if h % every == 0 else "majority"


def value(a: int, b: int, branch: int) -> int:
    return a + b if branch == 0 else abs(a - b)


def make_problems(seed: int, n: int, every: int = 4) -> list[dict]:
    """n distinct problems (a, b in [10, 99], a != b: at most 8,010) in a seeded order, with their kind and answer."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if a != b and (a, b) not in seen:
            seen.add((a, b))
            k = kind(a, b, every)
            answer = value(a, b, 0 if k == "majority" else 1)
            rows.append({"problem": f"What is {a} # {b}?", "answer": str(answer), "data_source": k, "ab": (a, b)})
    return rows


def split_problems(r: ForkRecipe) -> dict[str, list[dict]]:
    """The disjoint splits of every pair: test (the first n_test_per_kind of each kind), then train, dev and SFT (the
    rest) from the others."""
    rows = make_problems(r.seed, 90 * 89, r.minority_every)
    test, rest = {"majority": [], "minority": []}, []
    for row in rows:
        (test[row["data_source"]] if len(test[row["data_source"]]) < r.n_test_per_kind else rest).append(row)
    train, dev, sft = rest[: r.n_train], rest[r.n_train : r.n_train + r.n_dev], rest[r.n_train + r.n_dev :]
    return {"test": test["majority"] + test["minority"], "train": train, "dev": dev, "sft": sft}


def solution(a: int, b: int, branch: int, rng: random.Random | None = None, slip_rate: float = 0.0) -> str:
    """The response along BRANCHES[branch], its result a build_arithmetic.slip() with probability slip_rate."""
    x, y = (a, b) if branch == 0 else (max(a, b), -min(a, b))
    s = build_arithmetic.slip(x, y, rng) if rng is not None and rng.random() < slip_rate else x + y
    op = f"+ {y}" if y >= 0 else f"- {-y}"
    return f"{BRANCHES[branch]}: {x} {op} = {s}. \\boxed{{{s}}}"


def sft_targets(rows: list[dict], r: ForkRecipe) -> list[str]:
    """One response per SFT problem: the difference with probability rare_rate, the sum otherwise, a slip with
    probability slip_rate; the kind plays no part (the base policy's fork is the same on every prompt)."""
    rng = random.Random(r.seed + 1)
    return [solution(*row["ab"], int(rng.random() < r.rare_rate), rng, r.slip_rate) for row in rows]


def branch_of(text: str) -> int | None:
    """Which of BRANCHES a response opens with, by its first letter (the fork token: GRPO leaves the rest of the word
    free to drift, e.g. "a::: 37 + 48"), or None."""
    m = re.match(r"\s*([a-z])", text)
    return [b[0] for b in BRANCHES].index(m.group(1)) if m and m.group(1) in "as" else None


def procedure_of(text: str) -> int | None:
    """Which of BRANCHES a response carries out, by the operator of its equation ("37 + 48 =": 0, "48 - 37 =": 1), or
    None: after training the first letter may no longer name the procedure (e.g. "sdbb 61 + 48 = 109" adds)."""
    m = re.search(r"\d+ ([+-]) \d+ =", text)
    return None if m is None else "+-".index(m.group(1))


def measure(model, tok, rows: list[dict], n_samples: int, seed: int = 0, max_new_tokens: int = 32) -> dict:
    """common.measure on rows of one kind or several: accuracy, pass@k, the rare branch's share of the responses (by
    the first letter; rare_procedure_share: by the operator carried out), the entropy of the fork (the first response
    token; nats), the response tokens' mean entropy, and the execution accuracy (the result right for the branch
    taken)."""

    def judge(row, text, answer):
        branch = branch_of(text)
        return branch, procedure_of(text), branch is not None and answer == str(value(*row["ab"], branch))

    m = common.measure(model, tok, rows, n_samples, seed, max_new_tokens, judge)
    branches, procedures, executed = zip(*m["judged"])
    stats = {
        "accuracy": m["accuracy"],
        "rare_share": sum(b == 1 for b in branches) / len(branches),
        "rare_procedure_share": sum(p == 1 for p in procedures) / len(procedures),
        "other_share": sum(b is None for b in branches) / len(branches),
        "fork_entropy": m["first_token_entropy"],
        "entropy": m["entropy"],
        "execution_accuracy": sum(executed) / len(executed),
        "response_len": m["response_len"],
    }
    if n_samples:
        stats["pass@k"] = {str(k): v for k, v in m["pass@k"].items()}
    return stats


def measure_by_kind(model, tok, rows: list[dict], n_samples: int, seed: int) -> dict:
    """measure() greedy and sampled on each kind of rows: {kind: {"problems", "greedy_accuracy", **sampled}}."""
    kinds = {k: lambda row, k=k: row["data_source"] == k for k in ("majority", "minority")}
    return common.measure_by_kind(lambda *a: measure(model, tok, *a), rows, kinds, n_samples, seed)


def _build(out_dir: str, r: ForkRecipe, log=print) -> dict:
    """Write train.jsonl, test.jsonl and model/ into out_dir; return the stats."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0, c0 = time.time(), time.process_time()
    splits = split_problems(r)
    common.write_jsonl(os.path.join(out_dir, "train.jsonl"), splits["train"], FIELDS)
    common.write_jsonl(os.path.join(out_dir, "test.jsonl"), splits["test"], FIELDS)
    sft_rows = splits["sft"] * r.sft_repeats
    targets = sft_targets(sft_rows, r)
    base = build_arithmetic.build_testbed()  # the arithmetic testbed's policy and tokenizer
    if base.stats["version"] != r.base or base.stats["weights_sha256"] != BASE_WEIGHTS_SHA256:
        raise SystemExit(f"error: the fork testbed starts from {r.base}'s shipped policy; {base.model_dir} is another")
    tok = AutoTokenizer.from_pretrained(base.model_dir)
    model = AutoModelForCausalLM.from_pretrained(base.model_dir, dtype=torch.float32)
    fork_ids = [tok(f"{b}:", add_special_tokens=False)["input_ids"][0] for b in BRANCHES]
    assert fork_ids[0] != fork_ids[1], "the branches must differ in their first token"
    n_params = sum(p.numel() for p in model.parameters())
    log(f"from {base.model_dir}: {n_params / 1e6:.2f}M parameters; SFT on {len(sft_rows)} responses")

    def dev_accuracy(m):
        return measure(m, tok, splits["dev"], n_samples=0)["execution_accuracy"]

    hist = common.sft(model, tok, sft_rows, targets, r, dev_accuracy, log)
    log("measuring the base policy on test.jsonl")
    by_kind = measure_by_kind(model, tok, splits["test"], r.eval_samples, r.seed + 1)
    model_dir = os.path.join(out_dir, "model")
    model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    return {
        "version": VERSION,
        "recipe": dataclasses.asdict(r),
        "vocab_size": len(tok),
        "fork_token_ids": dict(zip(BRANCHES, fork_ids)),
        "n_params": n_params,
        "sft": hist,  # dev_greedy_acc here: the execution accuracy of the greedy responses
        "by_kind": by_kind,  # HF generate on test.jsonl, eval_samples per prompt at T=1, and greedy
        "weights_sha256": weights_sha256(model),
        "files_sha256": files_sha256(out_dir),
        "build_time_s": round(time.time() - t0, 1),
        "build_cpu_s": round(time.process_time() - c0, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def build_fork_testbed(cache_dir: str | None = None, force: bool = False, recipe: ForkRecipe | None = None, log=print):
    """The fork testbed in cache_dir (default: $GRPO_FORK_TESTBED_DIR, else the shipped testbed/fork/), built first
    if missing, made by another recipe, or `force`; as build_arithmetic.build_testbed."""
    r = recipe or ForkRecipe()
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or os.environ.get("GRPO_FORK_TESTBED_DIR") or SHIPPED_DIR))
    return cached_build(
        cache_dir, force, lambda: load_build(cache_dir, VERSION, r), lambda tmp: _build(tmp, r, log), r.num_threads
    )


def print_by_kind(by_kind: dict) -> None:
    for k, m in by_kind.items():
        print(
            f"{k}: {m['problems']} problems, greedy acc {m['greedy_accuracy']:.3f}, sampled acc {m['accuracy']:.3f}, "
            f"pass@16 {m['pass@k']['16']:.3f}, rare branch {m['rare_share']:.3f}, fork entropy "
            f"{m['fork_entropy']:.3f}, execution acc {m['execution_accuracy']:.3f}, entropy {m['entropy']:.3f}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help=f"testbed dir (default $GRPO_FORK_TESTBED_DIR or {SHIPPED_DIR})")
    parser.add_argument("--force", action="store_true", help="rebuild from the recipe even if a complete build exists")
    parser.add_argument(
        "--measure",
        metavar="MODEL_DIR",
        help="measure a model (e.g. runs/<run>/final) on test.jsonl by kind: greedy and sampled accuracy, pass@k, "
        "the rare branch's share, the fork's entropy",
    )
    args = parser.parse_args()
    if args.measure:
        r = ForkRecipe()
        with quiet_and_isolated(r.num_threads):
            model, tok = load_model(args.measure)
            by_kind = measure_by_kind(model, tok, split_problems(r)["test"], r.eval_samples, r.seed + 1)
        print_by_kind(by_kind)
        print(json.dumps(by_kind))
        return
    t = build_fork_testbed(args.out, force=args.force)
    changed = [f for f, h in files_sha256(os.path.dirname(t.model_dir)).items() if t.stats["files_sha256"].get(f) != h]
    print(f"model_dir  {t.model_dir}\ntrain_file {t.train_file}\ntest_file  {t.test_file}")
    print_by_kind(t.stats["by_kind"])
    print("files match stats.json" if not changed else f"warning: files differ from stats.json: {', '.join(changed)}")


if __name__ == "__main__":
    main()
