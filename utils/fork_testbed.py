"""The fork testbed: a task where GRPO's collapse costs something, because a rare opening is the only way to solve some
problems and the model cannot tell which from the prompt.

Shipped in `testbed/fork/` (model, tokenizer, data, stats.json with the sha256 of every file) beside the first
testbed (utils/testbed.py): its policy, which already adds and subtracts two-digit numbers, is taught the new task by
a short SFT (its loop too is the first testbed's); `python -m utils.fork_testbed --force` rebuilds it (~2 min on one
core).

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

from utils import testbed as tb

VERSION = "fork-v1"
SHIPPED_DIR = os.path.join(tb.SHIPPED_DIR, "fork")
BASE_WEIGHTS_SHA256 = "4f707c83c22da27140d066d529d6ba54fececece201b11a1df5dcd610db6ecd0"
BRANCHES = ("add", "sub")
"""The fork: the first word of a response; the sum is right on the majority kind, the difference on the minority."""


@dataclasses.dataclass
class Recipe:
    """Everything that determines the build. Changing a default here means bumping VERSION."""

    seed: int = 0
    num_threads: int = 1
    """torch threads while building (the weights depend on it)"""
    n_test_per_kind: int = 200
    n_train: int = 4000
    n_dev: int = 256
    """the rest of the 8,010 pairs (3,354) are the SFT problems"""
    sft_repeats: int = 6
    """each SFT problem appears this many times, each with its own sampled response"""
    minority_every: int = 4
    """one problem in this many (by the hash of its numbers) is of the minority kind, `#` the difference"""
    rare_rate: float = 0.3
    """chance that an SFT solution opens with the difference, whatever the kind (the base policy's rare branch)"""
    slip_rate: float = 0.2
    """chance that an SFT solution writes its result wrong"""
    base: str = tb.VERSION
    """the policy it starts from: the first testbed's (testbed/model; its weights' sha256 is checked)"""
    batch_size: int = 64
    lr: float = 5e-4
    warmup_steps: int = 20
    sft_steps: int = 500
    eval_every: int = 100
    eval_samples: int = 16


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


def split_problems(r: Recipe) -> dict[str, list[dict]]:
    """The disjoint splits of every pair: test (the first n_test_per_kind of each kind), then train, dev and SFT (the
    rest) from the others."""
    rows = make_problems(r.seed, 90 * 89, r.minority_every)
    test, rest = {"majority": [], "minority": []}, []
    for row in rows:
        (test[row["data_source"]] if len(test[row["data_source"]]) < r.n_test_per_kind else rest).append(row)
    train, dev, sft = rest[: r.n_train], rest[r.n_train : r.n_train + r.n_dev], rest[r.n_train + r.n_dev :]
    return {"test": test["majority"] + test["minority"], "train": train, "dev": dev, "sft": sft}


def solution(a: int, b: int, branch: int, rng: random.Random | None = None, slip_rate: float = 0.0) -> str:
    """The response along BRANCHES[branch], its result a testbed.slip() with probability slip_rate."""
    x, y = (a, b) if branch == 0 else (max(a, b), -min(a, b))
    s = tb.slip(x, y, rng) if rng is not None and rng.random() < slip_rate else x + y
    op = f"+ {y}" if y >= 0 else f"- {-y}"
    return f"{BRANCHES[branch]}: {x} {op} = {s}. \\boxed{{{s}}}"


def sft_targets(rows: list[dict], r: Recipe) -> list[str]:
    """One response per SFT problem: the difference with probability rare_rate, the sum otherwise, a slip with
    probability slip_rate; the kind plays no part (the base policy's fork is the same on every prompt)."""
    rng = random.Random(r.seed + 1)
    return [solution(*row["ab"], int(rng.random() < r.rare_rate), rng, r.slip_rate) for row in rows]


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in ("problem", "answer", "data_source")}) + "\n")


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
    """HF generate at T=1 (n_samples per prompt) or greedy (0) on rows of one kind or several: accuracy, pass@k, the
    rare branch's share of the responses (by the first letter; rare_procedure_share: by the operator carried out), the
    entropy of the fork (the first response token; nats), the response
    tokens' mean entropy, and the execution accuracy (the result right for the branch taken)."""
    import torch

    from utils.data import format_prompt
    from utils.reward import last_boxed, pass_at_k

    model.eval()
    n = max(n_samples, 1)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if n_samples else dict(do_sample=False)
    correct, executed, branches, procedures, fork_ent, ent_sum, n_tok = [], [], [], [], 0.0, 0.0, 0
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for s in range(0, len(rows), 64):
            chunk = rows[s : s + 64]
            prompts = [format_prompt(row["problem"], tok) for row in chunk]
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **enc,
                **sampling,
                max_new_tokens=max_new_tokens,
                num_return_sequences=n,
                output_logits=True,
                return_dict_in_generate=True,
            )
            resp = out.sequences[:, enc["input_ids"].shape[1] :]
            is_eos = resp == tok.eos_token_id
            valid = (is_eos.long().cumsum(1) - is_eos.long()) == 0
            logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)
            entropy = -(logp.exp() * logp).sum(-1)
            fork_ent += float(entropy[:, 0].sum())
            ent_sum += float((entropy * valid).sum())
            n_tok += int(valid.sum())
            for k, text in enumerate(tok.batch_decode(resp, skip_special_tokens=True)):
                row, branch, answer = chunk[k // n], branch_of(text), (last_boxed(text) or "").strip()
                correct.append(answer == row["answer"])
                executed.append(branch is not None and answer == str(value(*row["ab"], branch)))
                branches.append(branch)
                procedures.append(procedure_of(text))
    per_prompt = [sum(correct[i : i + n]) for i in range(0, len(correct), n)]
    stats = {
        "accuracy": sum(correct) / len(correct),
        "rare_share": sum(b == 1 for b in branches) / len(branches),
        "rare_procedure_share": sum(p == 1 for p in procedures) / len(procedures),
        "other_share": sum(b is None for b in branches) / len(branches),
        "fork_entropy": fork_ent / len(correct),
        "entropy": ent_sum / max(n_tok, 1),
        "execution_accuracy": sum(executed) / len(executed),
        "response_len": n_tok / len(correct),
    }
    if n_samples:
        ks = sorted({min(2**i, n) for i in range(n.bit_length() + 1)})
        stats["pass@k"] = {str(k): sum(pass_at_k(n, c, k) for c in per_prompt) / len(per_prompt) for k in ks}
    return stats


def measure_by_kind(model, tok, rows: list[dict], n_samples: int, seed: int) -> dict:
    """measure() greedy and sampled on each kind of rows: {kind: {"problems", "greedy_accuracy", **sampled}}."""
    out = {}
    for k in ("majority", "minority"):
        chosen = [row for row in rows if row["data_source"] == k]
        sampled, greedy = measure(model, tok, chosen, n_samples, seed), measure(model, tok, chosen, 0)
        out[k] = {"problems": len(chosen), "greedy_accuracy": greedy["accuracy"], **sampled}
    return out


def _build(out_dir: str, r: Recipe, log=print) -> dict:
    """Write train.jsonl, test.jsonl and model/ into out_dir; return the stats."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0, c0 = time.time(), time.process_time()
    splits = split_problems(r)
    write_jsonl(os.path.join(out_dir, "train.jsonl"), splits["train"])
    write_jsonl(os.path.join(out_dir, "test.jsonl"), splits["test"])
    sft_rows = splits["sft"] * r.sft_repeats
    targets = sft_targets(sft_rows, r)
    base = tb.build_testbed()  # the first testbed's policy and tokenizer
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

    hist = tb.sft(model, tok, sft_rows, splits["dev"], r, log, targets=targets, dev_accuracy=dev_accuracy)
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
        "weights_sha256": tb.weights_sha256(model),
        "files_sha256": tb.files_sha256(out_dir),
        "build_time_s": round(time.time() - t0, 1),
        "build_cpu_s": round(time.process_time() - c0, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _load(cache_dir: str, r: Recipe) -> tb.Testbed | None:
    try:
        with open(os.path.join(cache_dir, "stats.json")) as f:
            stats = json.load(f)
    except (OSError, ValueError):
        return None
    if stats.get("version") != VERSION or stats.get("recipe") != dataclasses.asdict(r):
        return None
    files = (os.path.join(cache_dir, x) for x in ("model", "train.jsonl", "test.jsonl"))
    return tb.Testbed(*files, stats)


def build_fork_testbed(cache_dir: str | None = None, force: bool = False, recipe: Recipe | None = None, log=print):
    """The fork testbed in cache_dir (default: $GRPO_FORK_TESTBED_DIR, else the shipped testbed/fork/), built first
    if missing, made by another recipe, or `force`; as utils.testbed.build_testbed."""
    r = recipe or Recipe()
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or os.environ.get("GRPO_FORK_TESTBED_DIR") or SHIPPED_DIR))
    return tb.cached_build(
        cache_dir, force, lambda: _load(cache_dir, r), lambda tmp: _build(tmp, r, log), r.num_threads
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
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        r = Recipe()
        with tb._quiet_and_isolated(r.num_threads):
            tok = AutoTokenizer.from_pretrained(args.measure)
            model = AutoModelForCausalLM.from_pretrained(args.measure, dtype=torch.float32)
            by_kind = measure_by_kind(model, tok, split_problems(r)["test"], r.eval_samples, r.seed + 1)
        print_by_kind(by_kind)
        print(json.dumps(by_kind))
        return
    t = build_fork_testbed(args.out, force=args.force)
    changed = [
        f for f, h in tb.files_sha256(os.path.dirname(t.model_dir)).items() if t.stats["files_sha256"].get(f) != h
    ]
    print(f"model_dir  {t.model_dir}\ntrain_file {t.train_file}\ntest_file  {t.test_file}")
    print_by_kind(t.stats["by_kind"])
    print("files match stats.json" if not changed else f"warning: files differ from stats.json: {', '.join(changed)}")


if __name__ == "__main__":
    main()
