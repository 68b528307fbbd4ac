"""A laptop-scale stand-in for real GRPO runs: tiny Qwen2 + tokenizer + synthetic arithmetic, built offline.

`build_testbed()` builds once, and caches on disk, what a GRPO script needs on a 2-core CPU: a byte-level BPE
tokenizer (Qwen2Tokenizer, ChatML), a 1.3M-parameter Qwen2 (hidden 256, 2 layers, 8 heads of 32, fp32) warmed up
by a short SFT so the base policy is right about a third of the time at T=1, and train/test jsonl files
("problem", "answer"). CLI: `python -m utils.testbed [--out DIR] [--force]` prints the paths and base stats.

Task: "What is 37 + 48?" / "What is 91 - 56?" with a, b in [10, 99] (a >= b for -): 12,195 problems.
The SFT target is only the boxed answer, `\\boxed{85}<|im_end|>`: 6-7 tokens, of which the 2-3 digits are the
uncertain ones. Why so short: a prototype whose target was a worked line ("37 + 48 = 85, so the answer is
\\boxed{85}", ~22 tokens) spent ~20 tokens copying a template, so its response-mean entropy (~0.1 nats) was
mostly dilution and moved slowly under GRPO. Here the mean token entropy (~0.3 nats) is the answer's own
uncertainty, and a rollout is a handful of tokens. The model ignores the prompt's "reason step by step"; the reward
(math-verify on the last \\boxed{}) does not need it. Digits are single tokens (Qwen2's splitting rules), so the
model must learn the carry to get the leading digit right: this is what SFT is stopped in the middle of.

Splits (disjoint): SFT problems (used only here), a dev slice (picks the SFT checkpoint), train.jsonl (4,000, for
GRPO) and test.jsonl (500). SFT never sees train or test, so the base accuracy is the same on both.

SFT stops by measurement, not by a step count: every `eval_every` steps it computes, from one forward pass, the
dev set's expected sampled accuracy at T=1 (mean probability of sampling the exact target: no sampling noise) and
keeps the checkpoint closest to `target_acc` inside [min_acc, max_acc]; accuracy climbs from ~5% to ~50% within
~100 steps, so the window is narrow. The kept model is then measured on test.jsonl with HF generate (8 samples per
prompt at T=1, top_k=0, top_p=1, and greedy) into stats.json.

Determinism: everything is seeded and SFT runs on `num_threads` torch threads; the same recipe on the same machine
gives the same weights (stats.json records their sha256). Another thread count or CPU may change the last bits and
hence the chosen checkpoint. Bump VERSION whenever the recipe changes (a cache made by another VERSION or recipe is
rebuilt anyway).
"""

import argparse
import contextlib
import copy
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time

VERSION = "testbed-v2"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, -, eos
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclasses.dataclass
class Recipe:
    """Everything that determines the build. Changing a default here means bumping VERSION."""

    seed: int = 0
    num_threads: int = 1
    """torch threads while building (the weights depend on it): 2 threads were ~1.8x faster on 2 idle cores but 4-6x
    slower than 1 whenever other processes shared the cores (OpenMP threads wait on each other)"""
    n_test: int = 500
    n_train: int = 4000
    n_dev: int = 256
    vocab_size: int = 400
    """BPE vocabulary cap incl. 256 bytes + 3 special tokens (the task text saturates at 334; the config pads the
    embedding to a multiple of 64)"""
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 8
    """head_dim 32 (vLLM CPU accepts 32, 64, 80, ...); 8 heads learn the carry in ~300 steps, 4 heads (dim 64) ~600"""
    num_kv_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    batch_size: int = 64
    lr: float = 1e-3
    """2e-3 stalls on a plateau for hundreds of steps at this size"""
    warmup_steps: int = 20
    max_steps: int = 3000
    eval_every: int = 20
    target_acc: float = 0.30
    min_acc: float = 0.15
    max_acc: float = 0.50


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
    return os.environ.get("GRPO_TESTBED_DIR") or os.path.join(os.path.expanduser("~/.cache/grpo-entropy"), VERSION)


# ----------------------------------------------------------------------------------------------------------------
# Data


def make_problems(seed: int) -> list[dict]:
    """All 12,195 problems a + b and a - b (a >= b), a, b in [10, 99], shuffled with `seed`."""
    rows = []
    for a in range(10, 100):
        for b in range(10, 100):
            rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
            if a >= b:
                rows.append({"problem": f"What is {a} - {b}?", "answer": str(a - b)})
    random.Random(seed).shuffle(rows)
    return rows


def split_problems(rows: list[dict], r: Recipe) -> dict[str, list[dict]]:
    test, train = rows[: r.n_test], rows[r.n_test : r.n_test + r.n_train]
    dev, sft = rows[r.n_test + r.n_train : r.n_test + r.n_train + r.n_dev], rows[r.n_test + r.n_train + r.n_dev :]
    return {"test": test, "train": train, "dev": dev, "sft": sft}


def response_text(answer: str) -> str:
    """The SFT target (before eos): just the boxed answer."""
    return f"\\boxed{{{answer}}}"


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


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
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
    )
    return model


def encode_sft(rows: list[dict], tok) -> tuple[list[list[int]], list[int]]:
    """Token ids of prompt + response + eos, and the prompt length of each row."""
    from utils.data import format_prompt

    seqs, prompt_lens = [], []
    for row in rows:
        p = tok(format_prompt(row["problem"], tok), add_special_tokens=False)["input_ids"]
        c = tok(response_text(row["answer"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
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


def measure(model, tok, rows: list[dict], sample: bool, seed: int = 0, n_samples: int = 1,
            max_new_tokens: int = 16, batch_size: int = 256) -> dict:
    """HF generate at T=1 (top_k=0, top_p=1) or greedy: accuracy (exact match of the last boxed answer; math-verify
    agrees on integers), mean response-token entropy (nats, token mean, eos included), mean response length,
    truncation rate (no eos within max_new_tokens), and the fraction of prompts whose n_samples are all right or
    all wrong (zero-advantage GRPO groups)."""
    import torch

    from utils.data import format_prompt
    from utils.reward import last_boxed

    model.eval()
    correct, ent_sum, n_tok, n_trunc, all_equal = [], 0.0, 0, 0, 0
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for s in range(0, len(rows), batch_size):
            chunk = rows[s : s + batch_size]
            enc = tok([format_prompt(r["problem"], tok) for r in chunk], return_tensors="pt", padding=True,
                      add_special_tokens=False)
            out = model.generate(**enc, **sampling, max_new_tokens=max_new_tokens, num_return_sequences=n_samples,
                                 output_logits=True, return_dict_in_generate=True)
            resp = out.sequences[:, enc["input_ids"].shape[1] :]
            # response tokens up to and including the first eos
            is_eos = resp == tok.eos_token_id
            valid = (is_eos.long().cumsum(1) - is_eos.long()) == 0
            logits = torch.stack(out.logits, 1).float()
            logp = torch.log_softmax(logits, -1)
            ent = -(logp.exp() * logp).sum(-1)
            ent_sum += float((ent * valid).sum())
            n_tok += int(valid.sum())
            n_trunc += int((~is_eos.any(1)).sum())
            texts = tok.batch_decode(resp, skip_special_tokens=True)
            ok = [(last_boxed(t) or "").strip() == chunk[k // n_samples]["answer"] for k, t in enumerate(texts)]
            correct += ok
            for k in range(0, len(ok), n_samples):
                all_equal += len(set(ok[k : k + n_samples])) == 1
    n = len(correct)
    return {
        "accuracy": sum(correct) / n,
        "entropy": ent_sum / max(n_tok, 1),
        "response_len": n_tok / n,
        "truncated": n_trunc / n,
        "all_equal_groups": all_equal / len(rows) if n_samples > 1 else None,
    }


def teacher_forced(model, tok, seqs, prompt_lens, batch_size: int = 256) -> dict:
    """Exact expected sampled accuracy at T=1 (mean probability of sampling the target response, eos included),
    greedy accuracy and mean per-token entropy of the SFT targets, from forward passes: no sampling noise."""
    import torch

    model.eval()
    p_seq, greedy, ent_sum, n_tok = [], [], 0.0, 0
    with torch.no_grad():
        for s in range(0, len(seqs), batch_size):
            idx = list(range(s, min(s + batch_size, len(seqs))))
            ids, mask, labels = sft_batch(seqs, prompt_lens, idx, tok.pad_token_id)
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
            labels = labels[:, 1:]
            m = labels != -100
            lp = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
            p_seq += (lp * m).sum(1).exp().tolist()
            greedy += ((logp.argmax(-1) == labels) | ~m).all(1).tolist()
            ent_sum += float((-(logp.exp() * logp).sum(-1) * m).sum())
            n_tok += int(m.sum())
    n = len(p_seq)
    return {"expected_acc": sum(p_seq) / n, "greedy_acc": sum(greedy) / n, "entropy": ent_sum / n_tok}


def sft(model, tok, sft_rows, dev_rows, r: Recipe, log=print, max_steps: int | None = None) -> dict:
    """Supervised warm-up (AdamW, linear warm-up, constant lr, loss on response tokens only). Every eval_every steps
    measure the dev expected sampled accuracy; keep the checkpoint closest to target_acc inside [min_acc, max_acc]
    and stop once accuracy passes target_acc. Loads the chosen weights into `model`; returns the SFT history."""
    import torch

    seqs, prompt_lens = encode_sft(sft_rows, tok)
    dev_seqs, dev_prompt_lens = encode_sft(dev_rows, tok)
    gen = torch.Generator().manual_seed(r.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / r.warmup_steps))
    best, history, order = None, [], torch.empty(0, dtype=torch.long)
    max_steps = r.max_steps if max_steps is None else max_steps
    t0 = time.time()
    for step in range(1, max_steps + 1):
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
        if step % r.eval_every == 0:
            m = teacher_forced(model, tok, dev_seqs, dev_prompt_lens)
            history.append({"step": step, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in m.items()}})
            log(f"sft step {step:4d}  loss {loss.item():.3f}  dev: expected sampled acc {m['expected_acc']:.3f}  "
                f"greedy acc {m['greedy_acc']:.3f}  target entropy {m['entropy']:.3f}  ({time.time() - t0:.0f}s)")
            acc = m["expected_acc"]
            if r.min_acc <= acc <= r.max_acc:
                if best is None or abs(acc - r.target_acc) < abs(best[0] - r.target_acc):
                    best = (acc, step, copy.deepcopy(model.state_dict()))
            if acc >= r.target_acc:
                break
    if best is None:
        if max_steps < r.max_steps:
            return {"steps": step, "chosen_step": None, "history": history}  # a truncated run (tests)
        raise RuntimeError(f"SFT never reached dev accuracy in [{r.min_acc}, {r.max_acc}]: {history}")
    model.load_state_dict(best[2])
    return {"steps": step, "chosen_step": best[1], "chosen_dev_expected_acc": round(best[0], 4), "history": history}


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
    splits = split_problems(make_problems(r.seed), r)
    write_jsonl(os.path.join(out_dir, "train.jsonl"), splits["train"])
    write_jsonl(os.path.join(out_dir, "test.jsonl"), splits["test"])
    corpus = [chatml(f"{row['problem']}\n{INSTRUCTION}", response_text(row["answer"])) for row in splits["sft"]]
    tok = train_tokenizer(corpus, r.vocab_size)
    model = make_model(r, len(tok), tok)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"tokenizer: {len(tok)} tokens; model: {n_params / 1e6:.2f}M parameters; SFT on {len(splits['sft'])} problems")
    hist = sft(model, tok, splits["sft"], splits["dev"], r, log=log)
    sft_time = time.time() - t0
    sampled = measure(model, tok, splits["test"], sample=True, seed=r.seed + 1, n_samples=8)
    greedy = measure(model, tok, splits["test"], sample=False)
    expected = teacher_forced(model, tok, *encode_sft(splits["test"], tok))
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
        # base policy on test.jsonl, HF generate, max 16 new tokens; sampled: 8 samples per prompt at T=1
        "sampled_accuracy": sampled["accuracy"],
        "greedy_accuracy": greedy["accuracy"],
        "expected_sampled_accuracy": expected["expected_acc"],
        "entropy": sampled["entropy"],
        "greedy_entropy": greedy["entropy"],
        "response_len": sampled["response_len"],
        "truncated": sampled["truncated"],
        "all_equal_groups_of_8": sampled["all_equal_groups"],
        "weights_sha256": weights_sha256(model),
        "sft_time_s": round(sft_time, 1),
        "build_time_s": round(time.time() - t0, 1),
        "build_cpu_s": round(time.process_time() - c0, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _load(cache_dir: str, r: Recipe) -> Testbed | None:
    """The complete build in cache_dir, or None (absent, unfinished, or made by another version or recipe)."""
    try:
        with open(os.path.join(cache_dir, "stats.json")) as f:
            stats = json.load(f)
    except (OSError, ValueError):
        return None
    if stats.get("version") != VERSION or stats.get("recipe") != dataclasses.asdict(r):
        return None
    return Testbed(os.path.join(cache_dir, "model"), os.path.join(cache_dir, "train.jsonl"),
                   os.path.join(cache_dir, "test.jsonl"), stats)


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


def build_testbed(cache_dir: str | None = None, force: bool = False, recipe: Recipe | None = None,
                  log=print) -> Testbed:
    """The testbed in `cache_dir` (default: $GRPO_TESTBED_DIR or ~/.cache/grpo-entropy/<VERSION>), built first if
    missing or `force` (~2 min on an idle core). Concurrent callers wait on a file lock; a build goes to a temp dir
    renamed into place with stats.json written last, so a cache dir is either complete or ignored and rebuilt."""
    r = recipe or Recipe()
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    if not force and (tb := _load(cache_dir, r)) is not None:
        return tb
    parent = os.path.dirname(cache_dir)
    os.makedirs(parent, exist_ok=True)
    with open(cache_dir + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and (tb := _load(cache_dir, r)) is not None:
            return tb  # another process built it while we waited
        tmp = tempfile.mkdtemp(prefix=os.path.basename(cache_dir) + ".tmp-", dir=parent)
        old = tmp + ".old"
        try:
            with _quiet_and_isolated(r.num_threads):
                stats = _build(tmp, r, log=log)
            with open(os.path.join(tmp, "stats.json"), "w") as f:
                json.dump(stats, f, indent=1)
            if os.path.exists(cache_dir):
                os.rename(cache_dir, old)
            os.rename(tmp, cache_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
    return _load(cache_dir, r)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help=f"cache dir (default $GRPO_TESTBED_DIR or {default_cache_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    args = parser.parse_args()
    tb = build_testbed(args.out, force=args.force)
    s = tb.stats
    print(f"model_dir  {tb.model_dir}\ntrain_file {tb.train_file}\ntest_file  {tb.test_file}")
    print(f"vocab {s['vocab_size']}, {s['n_params'] / 1e6:.2f}M params, SFT step {s['sft']['chosen_step']}; "
          f"test: sampled acc {s['sampled_accuracy']:.3f}, greedy acc {s['greedy_accuracy']:.3f}, "
          f"token entropy {s['entropy']:.3f} nats, response {s['response_len']:.1f} tokens, "
          f"truncated {s['truncated']:.3f}, all-equal groups of 8 {s['all_equal_groups_of_8']:.2f}; "
          f"built in {s['build_time_s']:.0f}s")


if __name__ == "__main__":
    main()
