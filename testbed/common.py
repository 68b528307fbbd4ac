"""What the two CPU testbeds share (testbed/build_arithmetic.py, testbed/build_fork.py): the recipe type, the tokenizer
and model builders, the SFT loop, the one measurement of a policy (HF generate, graded), the cached and locked build.
No part of a run: the scripts train on what these build (the files beside, in testbed/ and testbed/fork/)."""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, -, eos
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def read_env(path: str) -> dict:
    """VARIABLE=value lines (comments: #) as a dict."""
    with open(path) as f:
        return dict(line.strip().split("=", 1) for line in f if line.strip() and not line.startswith("#"))


# the environment the scripts, benchmarks and tests run in on a CPU machine (cpu.env, defined once; less the log level)
CPU_ENV = {k: v for k, v in read_env(os.path.join(ROOT, "cpu.env")).items() if k != "VLLM_LOGGING_LEVEL"}


@dataclasses.dataclass(kw_only=True)
class Recipe:
    """Everything that determines a build; each testbed's recipe adds its task's fields and sets the defaults. Changing
    a default means bumping the testbed's VERSION (stats.json records the recipe: a build by another one is rebuilt)."""

    seed: int = 0
    num_threads: int = 1
    """torch threads while building (the weights depend on it)"""
    n_train: int = 4000
    n_dev: int = 256
    batch_size: int = 64
    lr: float
    warmup_steps: int = 20
    sft_steps: int
    eval_every: int
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


def write_jsonl(path: str, rows: list[dict], fields=("problem", "answer")) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in fields}) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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


def sft(model, tok, rows: list[dict], targets: list[str], r: Recipe, dev_accuracy, log=print) -> dict:
    """Supervised warm-up on the testbed's noisy worked solutions (`targets`, one per row; AdamW, linear warm-up,
    constant lr, loss on response tokens only), a fixed number of steps; logs the loss and `dev_accuracy(model)` (the
    testbed's greedy accuracy on its dev rows) every eval_every steps."""
    import torch

    seqs, prompt_lens = encode_sft(rows, targets, tok)
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
            greedy = dev_accuracy(model)
            history.append({"step": step, "loss": round(loss.item(), 4), "dev_greedy_acc": round(greedy, 4)})
            log(f"sft step {step:4d}  loss {loss.item():.3f}  dev greedy acc {greedy:.3f}  ({time.time() - t0:.0f}s)")
    return {"steps": steps, "history": history}


def measure(model, tok, rows: list[dict], n_samples: int, seed: int = 0, max_new_tokens: int = 48, judge=None) -> dict:
    """HF generate at T=1 (top_k=0, top_p=1) with n_samples per prompt, or greedy (n_samples=0), 64 prompts at a time:
    accuracy (exact match of the last boxed answer; math-verify agrees on integers), pass@k (unbiased estimator, k = 1,
    2, 4, .., n), mean response-token entropy (nats, token mean, eos included), the first token's (a fork's), response
    length, truncation rate (no eos within max_new_tokens), for 8+ samples the fraction of prompts whose first 8
    samples are all right or all wrong (zero-advantage GRPO groups of 8); and "judged": `judge(row, text)` of each
    response in order, given its boxed answer (the testbed's own reading of it: its path, its branch)."""
    import torch

    from utils.data import format_prompt
    from utils.reward import last_boxed, pass_at_k

    model.eval()
    n = max(n_samples, 1)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if n_samples else dict(do_sample=False)
    correct, judged, first_ent, ent_sum, n_tok, n_trunc = [], [], 0.0, 0.0, 0, 0
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
            valid = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # response tokens up to and including eos
            logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)
            entropy = -(logp.exp() * logp).sum(-1)
            first_ent += float(entropy[:, 0].sum())
            ent_sum += float((entropy * valid).sum())
            n_tok += int(valid.sum())
            n_trunc += int((~is_eos.any(1)).sum())
            for k, text in enumerate(tok.batch_decode(resp, skip_special_tokens=True)):
                answer = (last_boxed(text) or "").strip()
                correct.append(answer == chunk[k // n]["answer"])
                judged.append(judge(chunk[k // n], text, answer) if judge else None)
    per_prompt = [sum(correct[i : i + n]) for i in range(0, len(correct), n)]
    stats = {
        "accuracy": sum(correct) / len(correct),
        "entropy": ent_sum / max(n_tok, 1),
        "first_token_entropy": first_ent / len(correct),
        "response_len": n_tok / len(correct),
        "truncated": n_trunc / len(correct),
        "judged": judged,
    }
    if n_samples:
        ks = sorted({min(2**i, n) for i in range(n.bit_length() + 1)})
        stats["pass@k"] = {k: sum(pass_at_k(n, c, k) for c in per_prompt) / len(per_prompt) for k in ks}
    if n_samples >= 8:
        groups = [correct[i : i + 8] for i in range(0, len(correct), n)]
        stats["all_equal_groups_of_8"] = sum(len(set(g)) == 1 for g in groups) / len(groups)
    return stats


def measure_by_kind(measure_one, rows: list[dict], kinds: dict, n_samples: int, seed: int) -> dict:
    """`measure_one(rows, n_samples, seed)` (a testbed's measure on its model) greedy and sampled on the rows of each
    kind (`kinds`: name -> whether a row is of it): {kind: {"problems", "greedy_accuracy", **sampled}}."""
    out = {}
    for name, selects in kinds.items():
        chosen = [row for row in rows if selects(row)]
        sampled, greedy = measure_one(chosen, n_samples, seed), measure_one(chosen, 0, 0)
        out[name] = {"problems": len(chosen), "greedy_accuracy": greedy["accuracy"], **sampled}
    return out


def load_model(model_dir: str):
    """A saved policy (e.g. a run's final/) and its tokenizer, float32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(
        model_dir
    )


def weights_sha256(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def files_sha256(root: str) -> dict:
    """sha256 of every file a build wrote under root (stats.json, which records them, aside), by relative path: a
    folder below with a stats.json of its own is another testbed (testbed/fork/) and left out, as its build's lock
    (testbed/fork.lock) and the builders' code beside the data (testbed/*.py, __pycache__)."""
    hashes = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if d != "__pycache__" and not os.path.isfile(os.path.join(dirpath, d, "stats.json"))
        )
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel != "stats.json" and not rel.endswith((".lock", ".py")):
                with open(path, "rb") as f:
                    hashes[rel] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(hashes.items()))


def load_build(cache_dir: str, version: str, r: Recipe) -> Testbed | None:
    """The complete build in cache_dir, or None (absent, unfinished, or made by another version or recipe)."""
    try:
        with open(os.path.join(cache_dir, "stats.json")) as f:
            stats = json.load(f)
    except (OSError, ValueError):
        return None
    if stats.get("version") != version or stats.get("recipe") != dataclasses.asdict(r):
        return None
    return Testbed(*(os.path.join(cache_dir, x) for x in ("model", "train.jsonl", "test.jsonl")), stats)


@contextlib.contextmanager
def quiet_and_isolated(num_threads: int):
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
            with quiet_and_isolated(num_threads):
                stats = build(tmp)
            with open(os.path.join(tmp, "stats.json"), "w") as f:
                json.dump(stats, f, indent=1)
            if os.path.exists(cache_dir):
                for name in set(os.listdir(cache_dir)) - set(os.listdir(tmp)):  # what the build does not write stays:
                    os.rename(os.path.join(cache_dir, name), os.path.join(tmp, name))  # testbed/fork/, the builders
                os.rename(cache_dir, old)
            os.rename(tmp, cache_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
    return load()
