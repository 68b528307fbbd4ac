"""Small helpers shared by the performance benchmarks (bench_trl.py, bench_scaling.py): a random-weights Qwen2 on the
testbed's tokenizer, a prompt file, and running a command as a subprocess while measuring its wall time and peak RSS."""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from utils.testbed import CPU_ENV  # noqa: E402

PHASES = ("time/generation", "time/logprob", "time/training", "time/weight_push", "time/step")


def random_qwen2(hidden: int = 256, layers: int = 4, heads: int = 4, intermediate: int = 688, seed: int = 0) -> str:
    """A random-weights Qwen2 with the testbed's tokenizer and vocabulary, saved once under ~/.cache/grpo-entropy.

    So that every response runs to --max-response-length (the length is then set exactly by the flag), the output
    head is untied, its rows drawn with std 0.2 instead of 0.02 (logits std ~3: sampling is far from uniform but not
    deterministic) and its rows for the special tokens (pad, eos) zero: eos gets logit 0, a probability of ~1e-5 per
    token. Defaults: 3.36M parameters (hidden 256, 4 layers, 4 heads of 64, intermediate 688, vocabulary 384).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from utils.testbed import build_testbed

    name = f"bench-qwen2-noeos-h{hidden}-l{layers}-a{heads}-i{intermediate}-s{seed}"
    out = os.path.join(os.path.expanduser("~/.cache/grpo-entropy"), name)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    testbed = build_testbed(log=lambda *a: None).model_dir
    base = json.load(open(os.path.join(testbed, "config.json")))
    config = Qwen2Config(
        vocab_size=base["vocab_size"],
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=base["eos_token_id"],
        pad_token_id=base["pad_token_id"],
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.normal_(0.0, 0.2)
        head[[config.pad_token_id, config.eos_token_id]] = 0.0
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out))
    model.save_pretrained(tmp)
    for f in os.listdir(testbed):  # tokenizer, chat template, generation config
        if f.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(os.path.join(testbed, f), tmp)
    os.replace(tmp, out) if not os.path.exists(out) else shutil.rmtree(tmp)
    return out


def n_params(model_dir: str) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())


def prompt_file(n: int, path: str) -> str:
    """The first n problems of the testbed's train.jsonl (the same prompts for every side of a comparison)."""
    from utils.testbed import build_testbed

    with open(build_testbed(log=lambda *a: None).train_file) as f:
        rows = [next(f) for _ in range(n)]
    with open(path, "w") as f:
        f.writelines(rows)
    return path


def run_measured(cmd: list, env: dict, log_path: str, timeout: int = 900) -> dict:
    """Run `cmd` (cwd: repository root); return its exit code, wall time and peak resident memory (os.wait4 rusage of
    that one process, which is where the trainer, HF generate and a colocated vLLM engine all run)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, **CPU_ENV, **env}, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "wall": time.perf_counter() - start,
        "peak_rss": usage.ru_maxrss * 1024,
        "log": log_path,
    }


def tail(path: str, n: int = 3000) -> str:
    with open(path) as f:
        return f.read()[-n:]


def read_metrics(run_dir: str) -> list:
    (name,) = [d for d in os.listdir(run_dir) if d != "wandb"]
    with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "time/step" in line]


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")
