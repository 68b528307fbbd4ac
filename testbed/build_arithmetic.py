"""The arithmetic testbed, a laptop-scale stand-in for real GRPO runs: tiny Qwen2 + tokenizer + a worked arithmetic
task, built offline.

The built testbed ships with the repository in `testbed/` (model weights, tokenizer, data, and stats.json with the
base policy's measured stats and the sha256 of every file), so every machine trains the same base policy;
`python -m testbed.build_arithmetic --force` rebuilds it from the recipe below (~7 min on one core; another CPU or
thread count may change the last bits of the weights: compare the hashes).

Task: three two-digit numbers, "What is 37 + 48 + 26?", and with a quarter each "a - b + c" and "a + b - c" (the
subtracted number smaller than the other two). A solution combines two of the numbers, then the third:
    37 + 26 = 63. 63 + 48 = 111. \\boxed{111}
about 31 tokens (digits are single tokens, Qwen2's splitting rules). Three paths are valid (which pair goes first) and
the SFT data takes one at random. The SFT data is a mixture of right and plausible wrong solutions:
- each of the two sums is written wrong with probability `step_error_rate` (a units or tens digit off by one, or a
  dropped carry or borrow), the next step carrying the wrong value on correctly;
- "a + b - c" is read as "a + b + c" with probability `misread_rate` (a misconception: the minus of "a - b + c" is
  always read right, which is where the model learns to subtract).

What this gives the base policy (measured on test.jsonl, stats.json): the regime of a pretrained model on MATH.
A sample at T=1 is right about a quarter of the time, greedy decoding about 60%, and 16 samples solve most problems
once (pass@1 low, pass@16 high): the right solution is there, as minority mass. Its uncertainty is spread over the
response (the path, the digits of both sums, the sign of the last step) rather than 2-3 answer digits. GRPO can raise
accuracy a lot by sharpening: dropping the slips and amplifying the minority reading of the minus, and it collapses
the entropy while doing so.

Splits (disjoint problems): SFT (used only here), dev (SFT progress log), train.jsonl (4,000, for GRPO), test.jsonl
(500). SFT never sees train or test, so the base accuracy is the same on both. SFT runs a fixed number of steps.

Determinism: everything is seeded and the build runs on `num_threads` torch threads; the same recipe on the same
machine gives the same weights (stats.json records their sha256). Bump VERSION whenever the recipe changes.
"""

import argparse
import dataclasses
import os
import random
import re
import time

from testbed import common
from testbed.common import (
    ROOT,
    Recipe,
    Testbed,
    cached_build,
    chatml,
    files_sha256,
    load_build,
    load_model,
    make_model,
    quiet_and_isolated,
    sft,
    train_tokenizer,
    weights_sha256,
    write_jsonl,
)

VERSION = "testbed-v3"
SHIPPED_DIR = os.path.join(ROOT, "testbed")
PATHS = ((0, 1, 2), (0, 2, 1), (1, 2, 0))
"""The three solution paths: (first, second, third) operand positions; the first two are added first."""


@dataclasses.dataclass(kw_only=True)
class ArithmeticRecipe(Recipe):
    """The arithmetic testbed's build (with Recipe's fields). Changing a default here means bumping VERSION."""

    n_test: int = 500
    n_sft: int = 35244
    minus_share: float = 0.25
    """share of problems a - b + c, and again of a + b - c (the rest: a + b + c)"""
    step_error_rate: float = 0.3
    """chance that an SFT solution writes one of its two sums wrong (each independently)"""
    misread_rate: float = 0.75
    """chance that an SFT solution of a + b - c reads its last minus as a plus (the base policy's misconception; the
    minus of a - b + c is always read right, which is where the model learns to subtract)"""
    vocab_size: int = 400
    """BPE vocabulary cap incl. 256 bytes + 3 special tokens (the task text saturates below it; the config pads the
    embedding to a multiple of 64)"""
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    """head_dim 32 (vLLM CPU accepts 32, 64, 80, ...)"""
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    lr: float = 1e-3
    sft_steps: int = 1750
    eval_every: int = 250


def default_cache_dir() -> str:
    return os.environ.get("GRPO_TESTBED_DIR") or SHIPPED_DIR


def make_problems(seed: int, n: int, minus_share: float = 0.25) -> list[dict]:
    """n distinct problems in a seeded order, with their signed terms: a + b + c, and with probability minus_share
    each a - b + c or a + b - c. a, b, c in [10, 99]; a subtracted number is smaller than the other two (no path has
    a negative intermediate)."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n:
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
        kind = rng.random()
        if kind < 2 * minus_share:
            k = 1 if kind < minus_share else 2  # which term is subtracted
            others = [x for i, x in enumerate((a, b, c)) if i != k]
            if min(others) <= 10:
                continue
            terms = [a, b, c]
            terms[k] = -rng.randint(10, min(others) - 1)
            terms = tuple(terms)
        else:
            terms = (a, b, c)
        if terms not in seen:
            seen.add(terms)
            problem = "What is {}?".format(
                f"{terms[0]}" + "".join(f" {'-' if t < 0 else '+'} {abs(t)}" for t in terms[1:])
            )
            rows.append({"problem": problem, "answer": str(sum(terms)), "terms": terms})
    return rows


def split_problems(r: ArithmeticRecipe) -> dict[str, list[dict]]:
    """The recipe's problems in their disjoint splits: test, train, dev, then the rest for SFT."""
    rows = make_problems(r.seed, r.n_test + r.n_train + r.n_dev + r.n_sft, r.minus_share)
    test, train = rows[: r.n_test], rows[r.n_test : r.n_test + r.n_train]
    dev, sft = rows[r.n_test + r.n_train : r.n_test + r.n_train + r.n_dev], rows[r.n_test + r.n_train + r.n_dev :]
    return {"test": test, "train": train, "dev": dev, "sft": sft}


def slip(x: int, y: int, rng: random.Random) -> int:
    """A plausible wrong value of x + y (y < 0: a subtraction): units or tens digit off by one, or the carry (borrow)
    dropped when the units carry (borrow)."""
    s = x + y
    carry = x % 10 + y % 10 >= 10 if y >= 0 else x % 10 < -y % 10
    options = [s - 1, s + 1, s - 10, s + 10] + ([s - 10 if y >= 0 else s + 10] if carry else [])
    return rng.choice(options)


def solution(
    terms, path: int, rng: random.Random | None = None, error_rate: float = 0.0, misread_rate: float = 0.0
) -> str:
    """The worked solution along PATHS[path] (a pair starting with a subtracted number is written the other way round:
    c - b, not -b + c). With `rng`, each sum is a slip() with probability error_rate, and a subtraction in the last
    place (a + b - c) is read as an addition with probability misread_rate (the misconception)."""
    if rng is not None and terms[2] < 0 and rng.random() < misread_rate:
        terms = (terms[0], terms[1], -terms[2])
    i, j, k = PATHS[path]
    x, y, z = (terms[j], terms[i], terms[k]) if terms[i] < 0 else (terms[i], terms[j], terms[k])
    s1 = slip(x, y, rng) if rng is not None and rng.random() < error_rate else x + y
    s2 = slip(s1, z, rng) if rng is not None and rng.random() < error_rate else s1 + z

    def op(v):
        return f"- {-v}" if v < 0 else f"+ {v}"

    return f"{x} {op(y)} = {s1}. {s1} {op(z)} = {s2}. \\boxed{{{s2}}}"


def sft_targets(rows: list[dict], r: ArithmeticRecipe) -> list[str]:
    """One sampled solution per SFT problem: a random path, each sum wrong with probability step_error_rate, a
    subtraction misread as an addition with probability misread_rate."""
    rng = random.Random(r.seed + 1)
    return [solution(row["terms"], rng.randrange(len(PATHS)), rng, r.step_error_rate, r.misread_rate) for row in rows]


def first_path(text: str, terms) -> int | None:
    """Which of PATHS a response starts on (its first two numbers, as written, signs ignored), or None."""
    numbers = sorted(int(x) for x in re.findall(r"\d+", text)[:2])
    for p, (i, j, _) in enumerate(PATHS):
        if numbers == sorted([abs(terms[i]), abs(terms[j])]):
            return p
    return None


def measure(model, tok, rows: list[dict], n_samples: int, seed: int = 0, max_new_tokens: int = 48) -> dict:
    """common.measure on this task (responses of at most 48 tokens), and the share of each solution path (the last:
    none of them)."""
    m = common.measure(
        model, tok, rows, n_samples, seed, max_new_tokens, judge=lambda r, t, _: first_path(t, r["terms"])
    )
    paths = [0] * (len(PATHS) + 1)
    for path in m["judged"]:
        paths[len(PATHS) if path is None else path] += 1
    keys = ("accuracy", "entropy", "response_len", "truncated")
    stats = {k: m[k] for k in keys} | {"path_share": [round(c / len(m["judged"]), 4) for c in paths]}
    return stats | {k: m[k] for k in ("pass@k", "all_equal_groups_of_8") if k in m}


def _build(out_dir: str, r: ArithmeticRecipe, log=print) -> dict:
    """Write train.jsonl, test.jsonl and model/ into out_dir; return the stats (stats.json is the caller's job)."""
    import torch
    import transformers

    from utils.data import INSTRUCTION

    t0, c0 = time.time(), time.process_time()
    splits = split_problems(r)
    write_jsonl(os.path.join(out_dir, "train.jsonl"), splits["train"])
    write_jsonl(os.path.join(out_dir, "test.jsonl"), splits["test"])
    targets = sft_targets(splits["sft"], r)
    corpus = [chatml(f"{row['problem']}\n{INSTRUCTION}", t) for row, t in zip(splits["sft"], targets)]
    tok = train_tokenizer(corpus, r.vocab_size)
    model = make_model(r, len(tok), tok)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"tokenizer: {len(tok)} tokens; model: {n_params / 1e6:.2f}M parameters; SFT on {len(splits['sft'])} problems")

    def dev_accuracy(m):
        return measure(m, tok, splits["dev"], n_samples=0)["accuracy"]

    hist = sft(model, tok, splits["sft"], targets, r, dev_accuracy, log)
    sft_time = time.time() - t0
    log("measuring the base policy on test.jsonl")
    sampled = measure(model, tok, splits["test"], n_samples=r.eval_samples, seed=r.seed + 1)
    greedy = measure(model, tok, splits["test"], n_samples=0)
    model_dir = os.path.join(out_dir, "model")
    model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    return {
        "version": VERSION,
        "recipe": dataclasses.asdict(r),
        "vocab_size": len(tok),
        "config_vocab_size": model.config.vocab_size,
        "n_params": n_params,
        "sft": hist,
        # base policy on test.jsonl, HF generate, max 48 new tokens; sampled: eval_samples per prompt at T=1
        "sampled_accuracy": sampled["accuracy"],
        "greedy_accuracy": greedy["accuracy"],
        "pass_at_k": {str(k): v for k, v in sampled["pass@k"].items()},
        "entropy": sampled["entropy"],
        "greedy_entropy": greedy["entropy"],
        "response_len": sampled["response_len"],
        "truncated": sampled["truncated"],
        "path_share": sampled["path_share"],
        "all_equal_groups_of_8": sampled.get("all_equal_groups_of_8"),  # None below 8 samples
        "weights_sha256": weights_sha256(model),
        "files_sha256": files_sha256(out_dir),
        "sft_time_s": round(sft_time, 1),
        "build_time_s": round(time.time() - t0, 1),
        "build_cpu_s": round(time.process_time() - c0, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def build_testbed(
    cache_dir: str | None = None, force: bool = False, recipe: ArithmeticRecipe | None = None, log=print
) -> Testbed:
    """The testbed in `cache_dir` (default: $GRPO_TESTBED_DIR, else the shipped `testbed/`), built first if missing,
    made by another recipe, or `force` (~10 min on an idle core). Concurrent callers wait on a file lock; a build goes
    to a temp dir renamed into place with stats.json written last, so a dir is either complete or rebuilt."""
    r = recipe or ArithmeticRecipe()
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    return cached_build(
        cache_dir, force, lambda: load_build(cache_dir, VERSION, r), lambda tmp: _build(tmp, r, log), r.num_threads
    )


KINDS = {"a + b + c": lambda t: min(t) > 0, "a - b + c": lambda t: t[1] < 0, "a + b - c": lambda t: t[2] < 0}
"""The three kinds of problem, by the signs of their terms (SFT misreads the minus of the last kind)."""


def measure_by_kind(model_dir: str, r: ArithmeticRecipe, n_samples: int = 16) -> dict:
    """measure() of a model (e.g. a run's final/) on test.jsonl, greedy and sampled, for each kind of problem."""
    model, tok = load_model(model_dir)
    rows = make_problems(r.seed, r.n_test, r.minus_share)  # test.jsonl, with the terms
    kinds = {kind: lambda row, selects=selects: selects(row["terms"]) for kind, selects in KINDS.items()}
    return common.measure_by_kind(lambda *a: measure(model, tok, *a), rows, kinds, n_samples, r.seed + 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help=f"testbed dir (default $GRPO_TESTBED_DIR or {default_cache_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild from the recipe even if a complete build exists")
    parser.add_argument(
        "--measure",
        metavar="MODEL_DIR",
        help="measure a model (e.g. runs/<run>/final) on test.jsonl, "
        "by kind of problem: greedy accuracy, and 16 samples' accuracy, pass@k, entropy, paths",
    )
    args = parser.parse_args()
    if args.measure:
        with quiet_and_isolated(ArithmeticRecipe().num_threads):
            by_kind = measure_by_kind(args.measure, ArithmeticRecipe())
        for kind, m in by_kind.items():
            print(
                f"{kind}: {m['problems']} problems, greedy acc {m['greedy_accuracy']:.3f}, sampled acc "
                f"{m['accuracy']:.3f}, pass@16 {m['pass@k'][16]:.3f}, entropy {m['entropy']:.3f}, "
                f"paths {' / '.join(f'{x:.2f}' for x in m['path_share'])}"
            )
        return
    tb = build_testbed(args.out, force=args.force)
    s, n = tb.stats, tb.stats["recipe"]["eval_samples"]
    changed = [f for f, h in files_sha256(os.path.dirname(tb.model_dir)).items() if s["files_sha256"].get(f) != h]
    print(f"model_dir  {tb.model_dir}\ntrain_file {tb.train_file}\ntest_file  {tb.test_file}")
    print(
        f"vocab {s['vocab_size']}, {s['n_params'] / 1e6:.2f}M params, {s['sft']['steps']} SFT steps; test: "
        f"sampled acc {s['sampled_accuracy']:.3f}, greedy acc {s['greedy_accuracy']:.3f}, "
        f"pass@{n} {s['pass_at_k'][str(n)]:.3f}, token entropy {s['entropy']:.3f} nats, "
        f"response {s['response_len']:.1f} tokens, truncated {s['truncated']:.3f}, "
        f"all-equal groups of 8 {s['all_equal_groups_of_8']:.2f}; built in {s['build_time_s']:.0f}s"
    )
    print("files match stats.json" if not changed else f"warning: files differ from stats.json: {', '.join(changed)}")


if __name__ == "__main__":
    main()
