"""A laptop-scale stand-in for real GRPO runs: tiny Qwen2 + tokenizer + a worked arithmetic task, built offline.

The built testbed ships with the repository in `testbed/` (model weights, tokenizer, data, and stats.json with the
base policy's measured stats and the sha256 of every file), so every machine trains the same base policy;
`python -m utils.testbed --force` rebuilds it from the recipe below (~7 min on one core; another CPU or thread count
may change the last bits of the weights: compare the hashes).

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
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile
import time

VERSION = "testbed-v3"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, -, eos
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_env(path: str) -> dict:
    """VARIABLE=value lines (comments: #) as a dict."""
    with open(path) as f:
        return dict(line.strip().split("=", 1) for line in f if line.strip() and not line.startswith("#"))


# the environment the scripts, benchmarks and tests run in on a CPU machine (cpu.env, defined once; less the log level)
CPU_ENV = {k: v for k, v in read_env(os.path.join(ROOT, "cpu.env")).items() if k != "VLLM_LOGGING_LEVEL"}
SHIPPED_DIR = os.path.join(ROOT, "testbed")
PATHS = ((0, 1, 2), (0, 2, 1), (1, 2, 0))
"""The three solution paths: (first, second, third) operand positions; the first two are added first."""


@dataclasses.dataclass
class Recipe:
    """Everything that determines the build. Changing a default here means bumping VERSION."""

    seed: int = 0
    num_threads: int = 1
    """torch threads while building (the weights depend on it)"""
    n_test: int = 500
    n_train: int = 4000
    n_dev: int = 256
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
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 20
    sft_steps: int = 1750
    eval_every: int = 250
    """log SFT loss and dev greedy accuracy every this many steps"""
    eval_samples: int = 16
    """samples per test prompt for the base stats (mean accuracy, pass@k, entropy)"""


@dataclasses.dataclass
class Testbed:
    model_dir: str
    """HF model dir: Qwen2ForCausalLM (fp32 safetensors), its tokenizer and generation_config"""
    train_file: str
    """jsonl with "problem" and "answer" (the number as a string), for GRPO training"""
    test_file: str
    """jsonl with the same fields, disjoint from train_file"""
    stats: dict
    """measured base stats of the model on test_file (see stats.json)"""


def default_cache_dir() -> str:
    return os.environ.get("GRPO_TESTBED_DIR") or SHIPPED_DIR


# ----------------------------------------------------------------------------------------------------------------
# Data


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


def split_problems(r: Recipe) -> dict[str, list[dict]]:
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


def sft_targets(rows: list[dict], r: Recipe) -> list[str]:
    """One sampled solution per SFT problem: a random path, each sum wrong with probability step_error_rate, a
    subtraction misread as an addition with probability misread_rate."""
    rng = random.Random(r.seed + 1)
    return [solution(row["terms"], rng.randrange(len(PATHS)), rng, r.step_error_rate, r.misread_rate) for row in rows]


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({"problem": row["problem"], "answer": row["answer"]}) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def qwen2_pre_tokenizer():
    """Exactly the normalizer/pre-tokenizer Qwen2Tokenizer rebuilds on load, so ids match whichever loader is used."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level])


def chatml(prompt_content: str, response: str) -> str:
    return f"<|im_start|>user\n{prompt_content}<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>\n"


def train_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE on `corpus` with Qwen2's splitting rules; wrapped as a Qwen2Tokenizer (left padding, ChatML)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    raw = Tokenizer(models.BPE())
    raw.normalizer, raw.pre_tokenizer = qwen2_pre_tokenizer()
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(raw.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )
    return tok


# ----------------------------------------------------------------------------------------------------------------
# Model, SFT and measurement


def make_model(r: Recipe, vocab_size: int, tok):
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64 * math.ceil(vocab_size / 64),
        hidden_size=r.hidden_size,
        intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_layers,
        num_attention_heads=r.num_heads,
        num_key_value_heads=r.num_kv_heads,
        max_position_embeddings=r.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(r.seed)
    model = Qwen2ForCausalLM(config).float()
    # Sampling defaults follow the policy exactly (HF's default top_k=50 would not).
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    return model


def encode_sft(rows: list[dict], targets: list[str], tok) -> tuple[list[list[int]], list[int]]:
    """Token ids of prompt + response + eos, and the prompt length of each row."""
    from utils.data import format_prompt

    seqs, prompt_lens = [], []
    for row, target in zip(rows, targets):
        p = tok(format_prompt(row["problem"], tok), add_special_tokens=False)["input_ids"]
        c = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + c)
        prompt_lens.append(len(p))
    return seqs, prompt_lens


def sft_batch(seqs, prompt_lens, idx, pad_id):
    """Right-padded batch; labels only on response tokens (incl. eos)."""
    import torch

    n = max(len(seqs[i]) for i in idx)
    ids = torch.full((len(idx), n), pad_id, dtype=torch.long)
    labels = torch.full((len(idx), n), -100, dtype=torch.long)
    mask = torch.zeros((len(idx), n), dtype=torch.long)
    for j, i in enumerate(idx):
        s = torch.tensor(seqs[i])
        ids[j, : len(s)], mask[j, : len(s)] = s, 1
        labels[j, prompt_lens[i] : len(s)] = s[prompt_lens[i] :]
    return ids, mask, labels


def first_path(text: str, terms) -> int | None:
    """Which of PATHS a response starts on (its first two numbers, as written, signs ignored), or None."""
    numbers = sorted(int(x) for x in re.findall(r"\d+", text)[:2])
    for p, (i, j, _) in enumerate(PATHS):
        if numbers == sorted([abs(terms[i]), abs(terms[j])]):
            return p
    return None


def measure(
    model, tok, rows: list[dict], n_samples: int, seed: int = 0, max_new_tokens: int = 48, batch_size: int = 64
) -> dict:
    """HF generate at T=1 (top_k=0, top_p=1) with n_samples per prompt, or greedy (n_samples=0): accuracy (exact match
    of the last boxed answer; math-verify agrees on integers), pass@k (unbiased estimator, k = 1, 2, 4, .., n),
    mean response-token entropy (nats, token mean, eos included), response length, truncation rate (no eos within
    max_new_tokens), the share of each solution path, and for 8+ samples the fraction of prompts whose first 8
    samples are all right or all wrong (zero-advantage GRPO groups of 8)."""
    import torch

    from utils.data import format_prompt
    from utils.reward import last_boxed, pass_at_k

    model.eval()
    n = max(n_samples, 1)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if n_samples else dict(do_sample=False)
    correct, ent_sum, n_tok, n_trunc, paths = [], 0.0, 0, 0, [0] * (len(PATHS) + 1)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for s in range(0, len(rows), batch_size):
            chunk = rows[s : s + batch_size]
            enc = tok(
                [format_prompt(r["problem"], tok) for r in chunk],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            )
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
            valid = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # response tokens up to and including eos
            logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)
            ent_sum += float((-(logp.exp() * logp).sum(-1) * valid).sum())
            n_tok += int(valid.sum())
            n_trunc += int((~is_eos.any(1)).sum())
            texts = tok.batch_decode(resp, skip_special_tokens=True)
            correct += [(last_boxed(t) or "").strip() == chunk[k // n]["answer"] for k, t in enumerate(texts)]
            for k, t in enumerate(texts):
                path = first_path(t, chunk[k // n]["terms"])
                paths[len(PATHS) if path is None else path] += 1
    per_prompt = [sum(correct[i : i + n]) for i in range(0, len(correct), n)]
    stats = {
        "accuracy": sum(correct) / len(correct),
        "entropy": ent_sum / max(n_tok, 1),
        "response_len": n_tok / len(correct),
        "truncated": n_trunc / len(correct),
        "path_share": [round(c / len(correct), 4) for c in paths],
    }
    if n_samples:
        ks = sorted({min(2**i, n) for i in range(n.bit_length() + 1)})
        stats["pass@k"] = {k: sum(pass_at_k(n, c, k) for c in per_prompt) / len(per_prompt) for k in ks}
    if n_samples >= 8:
        groups = [correct[i : i + 8] for i in range(0, len(correct), n)]
        stats["all_equal_groups_of_8"] = sum(len(set(g)) == 1 for g in groups) / len(groups)
    return stats


def sft(model, tok, sft_rows, dev_rows, r, log=print, targets=None, dev_accuracy=None) -> dict:
    """Supervised warm-up on the noisy worked solutions (AdamW, linear warm-up, constant lr, loss on response tokens
    only), a fixed number of steps; logs the loss and the dev greedy accuracy every eval_every steps. `targets` and
    `dev_accuracy(model)` default to this testbed's (utils/fork_testbed.py passes its own)."""
    import torch

    seqs, prompt_lens = encode_sft(sft_rows, sft_targets(sft_rows, r) if targets is None else targets, tok)
    gen = torch.Generator().manual_seed(r.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / r.warmup_steps))
    history, order = [], torch.empty(0, dtype=torch.long)
    steps = r.sft_steps
    t0 = time.time()
    for step in range(1, steps + 1):
        if len(order) < r.batch_size:
            order = torch.cat([order, torch.randperm(len(seqs), generator=gen)])
        idx, order = order[: r.batch_size].tolist(), order[r.batch_size :]
        ids, mask, labels = sft_batch(seqs, prompt_lens, idx, tok.pad_token_id)
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % r.eval_every == 0 or step == steps:
            greedy = dev_accuracy(model) if dev_accuracy else measure(model, tok, dev_rows, n_samples=0)["accuracy"]
            history.append({"step": step, "loss": round(loss.item(), 4), "dev_greedy_acc": round(greedy, 4)})
            log(f"sft step {step:4d}  loss {loss.item():.3f}  dev greedy acc {greedy:.3f}  ({time.time() - t0:.0f}s)")
    return {"steps": steps, "history": history}


def weights_sha256(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# Build


def _build(out_dir: str, r: Recipe, log=print) -> dict:
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
    hist = sft(model, tok, splits["sft"], splits["dev"], r, log=log)
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


def files_sha256(root: str) -> dict:
    """sha256 of every file under root except stats.json (which records them), by relative path; a folder below with
    a stats.json of its own is another testbed (testbed/fork/) and left out, as its build's lock (testbed/fork.lock)."""
    hashes = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not os.path.isfile(os.path.join(dirpath, d, "stats.json")))
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel != "stats.json" and not rel.endswith(".lock"):
                with open(path, "rb") as f:
                    hashes[rel] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(hashes.items()))


def _load(cache_dir: str, r: Recipe) -> Testbed | None:
    """The complete build in cache_dir, or None (absent, unfinished, or made by another version or recipe)."""
    try:
        with open(os.path.join(cache_dir, "stats.json")) as f:
            stats = json.load(f)
    except (OSError, ValueError):
        return None
    if stats.get("version") != VERSION or stats.get("recipe") != dataclasses.asdict(r):
        return None
    return Testbed(
        os.path.join(cache_dir, "model"),
        os.path.join(cache_dir, "train.jsonl"),
        os.path.join(cache_dir, "test.jsonl"),
        stats,
    )


@contextlib.contextmanager
def _quiet_and_isolated(num_threads: int):
    """Build on a fixed thread count, without touching the caller's RNG state, threads or transformers logging."""
    import torch
    import transformers

    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    torch.set_num_threads(num_threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def build_testbed(
    cache_dir: str | None = None, force: bool = False, recipe: Recipe | None = None, log=print
) -> Testbed:
    """The testbed in `cache_dir` (default: $GRPO_TESTBED_DIR, else the shipped `testbed/`), built first if missing,
    made by another recipe, or `force` (~10 min on an idle core). Concurrent callers wait on a file lock; a build goes
    to a temp dir renamed into place with stats.json written last, so a dir is either complete or rebuilt."""
    r = recipe or Recipe()
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    return cached_build(cache_dir, force, lambda: _load(cache_dir, r), lambda tmp: _build(tmp, r, log), r.num_threads)


def cached_build(cache_dir: str, force: bool, load, build, num_threads: int):
    """load() if it finds a complete build in cache_dir (and not `force`), else build(tmp) (its stats) into a temp dir
    under a file lock, stats.json written, the dir renamed into place, then load()."""
    if not force and (tb := load()) is not None:
        return tb
    parent = os.path.dirname(cache_dir)
    os.makedirs(parent, exist_ok=True)
    with open(cache_dir + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and (tb := load()) is not None:
            return tb  # another process built it while we waited
        tmp = tempfile.mkdtemp(prefix=os.path.basename(cache_dir) + ".tmp-", dir=parent)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the testbed is shared data
        old = tmp + ".old"
        try:
            with _quiet_and_isolated(num_threads):
                stats = build(tmp)
            with open(os.path.join(tmp, "stats.json"), "w") as f:
                json.dump(stats, f, indent=1)
            if os.path.exists(cache_dir):
                for name in os.listdir(cache_dir):  # a testbed kept inside this one (testbed/fork/) stays
                    if os.path.isfile(os.path.join(cache_dir, name, "stats.json")):
                        os.rename(os.path.join(cache_dir, name), os.path.join(tmp, name))
                os.rename(cache_dir, old)
            os.rename(tmp, cache_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
    return load()


KINDS = {"a + b + c": lambda t: min(t) > 0, "a - b + c": lambda t: t[1] < 0, "a + b - c": lambda t: t[2] < 0}
"""The three kinds of problem, by the signs of their terms (SFT misreads the minus of the last kind)."""


def measure_by_kind(model_dir: str, r: Recipe, n_samples: int = 16) -> dict:
    """measure() of a model (e.g. a run's final/) on test.jsonl, greedy and sampled, for each kind of problem."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = make_problems(r.seed, r.n_test, r.minus_share)  # test.jsonl, with the terms
    out = {}
    for kind, selects in KINDS.items():
        chosen = [row for row in rows if selects(row["terms"])]
        sampled, greedy = measure(model, tok, chosen, n_samples, seed=r.seed + 1), measure(model, tok, chosen, 0)
        out[kind] = {"problems": len(chosen), "greedy_accuracy": greedy["accuracy"], **sampled}
    return out


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
        with _quiet_and_isolated(Recipe().num_threads):
            by_kind = measure_by_kind(args.measure, Recipe())
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
