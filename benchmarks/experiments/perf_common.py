"""Small helpers shared by the performance benchmarks (bench_trl.py, bench_scaling.py): a random-weights Qwen2 on the
testbed's tokenizer (responses of a fixed length, or of variable length with a set mean), a prompt file, and running a
command as a subprocess while measuring its wall time and peak RSS; and by the CPU memory benchmarks
(bench_logprob_memory.py, bench_clamped_entropy.py, bench_hidden_states_memory.py): one case's extra peak resident
size, each case in a fresh interpreter."""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from testbed.common import CPU_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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

    from testbed.build_arithmetic import build_testbed

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
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out))
    model.save_pretrained(tmp)
    for f in os.listdir(testbed):  # tokenizer, chat template, generation config
        if f.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(os.path.join(testbed, f), tmp)
    os.replace(tmp, out) if not os.path.exists(out) else shutil.rmtree(tmp)
    return out


EOS_DIM = 0
"""the residual-stream coordinate of random_qwen2_varlen's models that carries the end-of-sequence logit"""


def random_qwen2_varlen(
    max_length: int, mean_length: float, prompts: int = 32, per_prompt: int = 2, seed: int = 0, **dims
) -> str:
    """random_qwen2(**dims) made to stop: responses of `mean_length` tokens on average (the eos token included),
    lengths close to geometric (a fraction ~exp(-max_length / mean_length) reaches `max_length`: 2% at a quarter).

    The eos probability lives in the weights, so HF generate and vLLM sample the same lengths: coordinate EOS_DIM of
    every token's embedding is 0.1 and no layer writes to it (that row of every o_proj and down_proj is zero), so
    the final normalised hidden state's h_0 is nearly constant (0.1 / rms of the residual stream: std ~2% of its
    mean), and the head's eos row is b e_0: the eos logit b h_0 gives each position about the same eos probability.
    b is calibrated, not guessed: `per_prompt` continuations of max_length tokens of each of the testbed's first
    `prompts` prompts (the benchmarks' prompts; h_0, and so the mean length, differ somewhat from prompt to prompt)
    are drawn with eos off (conditioned on not stopping, the other tokens' distribution does not depend on b),
    then b is bisected so that the expected length over their positions' eos probabilities is mean_length. Saved
    once under ~/.cache/grpo-entropy, with the calibration in varlen.json.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from testbed.build_arithmetic import build_testbed
    from utils.data import format_prompt, load_problems

    base = random_qwen2(seed=seed, **dims)
    out = base.replace("-noeos-", f"-eos-m{mean_length:g}-L{max_length}-", 1)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        model.get_input_embeddings().weight[:, EOS_DIM] = 0.1
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[EOS_DIM] = 0.0
            layer.mlp.down_proj.weight[EOS_DIM] = 0.0
        rows = load_problems(build_testbed(log=lambda *a: None).train_file, None, None, None)[:prompts]
        by_length = {}  # prompts of one length sample in one batch, without padding
        for row in rows:
            ids = tokenizer(format_prompt(row["problem"], tokenizer), add_special_tokens=False)["input_ids"]
            by_length.setdefault(len(ids), []).append(ids)
        torch.manual_seed(seed)
        h0, log_rest = [], []  # per sample and position: h_0 and the log-sum-exp of the other tokens' logits
        for length, group in by_length.items():
            ids = torch.tensor(group).repeat_interleave(per_prompt, dim=0)
            ids = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_length, min_new_tokens=max_length,
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=eos,
            )  # fmt: skip
            output = model(ids, output_hidden_states=True)
            positions = slice(length - 1, length - 1 + max_length)  # the logits of response token 0, 1, ...
            h0.append(output.hidden_states[-1][:, positions, EOS_DIM])
            logits = output.logits[:, positions]
            logits[..., eos] = -torch.inf
            log_rest.append(logits.logsumexp(-1))
        h0, log_rest = torch.cat(h0).double(), torch.cat(log_rest).double()

        def expected(b: float) -> tuple:
            """Mean length (sum over k of P(length >= k)) and P(length = max_length without eos) at eos row b e_0."""
            survive = torch.cumprod(1 - torch.sigmoid(b * h0 - log_rest), dim=1)
            return (1 + survive[:, :-1].sum(1)).mean().item(), survive[:, -1].mean().item()

        low, high = 0.0, 1000.0
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if expected(mid)[0] > mean_length else (low, mid)
        b = (low + high) / 2
        head = model.get_output_embeddings().weight
        head[eos] = 0.0
        head[eos, EOS_DIM] = b
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out))
    model.save_pretrained(tmp)
    for f in os.listdir(base):
        if f.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(os.path.join(base, f), tmp)
    mean, at_max = expected(b)
    info = {"eos_weight": b, "h0_mean": h0.mean().item(), "h0_std": h0.std().item(), "samples": h0.shape[0]}
    info |= {"max_length": max_length, "expected_mean_length": mean, "expected_frac_at_max": at_max}
    json.dump(info, open(os.path.join(tmp, "varlen.json"), "w"), indent=1)
    os.replace(tmp, out) if not os.path.exists(out) else shutil.rmtree(tmp)
    return out


def length_stats(lengths: list, max_length: int) -> dict:
    """Mean, median, 90th percentile and the fraction at max_length of a list of response lengths."""
    xs = sorted(lengths)
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "median": statistics.median(xs),
        "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))],
        "at_max": sum(x >= max_length for x in xs) / len(xs),
    }


def n_params(model_dir: str) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())


def prompt_file(n: int, path: str) -> str:
    """The first n problems of the testbed's train.jsonl (the same prompts for every side of a comparison)."""
    from testbed.build_arithmetic import build_testbed

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


def resident_bytes(field: str) -> int:
    """This process's VmRSS (resident now) or VmHWM (its peak since the last reset) from /proc/self/status (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def extra_peak_bytes(run) -> tuple:
    """(run()'s result, how far the process's peak resident size rose above its resident size before the call): the
    peak is reset to the current size first (/proc/self/clear_refs "5"), so start-up peaks do not count. Every
    allocation torch makes is seen; one case a process (case_in_child), or the peak of an earlier one stays."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = resident_bytes("VmRSS")
    result = run()
    return result, resident_bytes("VmHWM") - before


def case_in_child(*case: str) -> dict:
    """The running benchmark's own command line plus `case` (its flag naming one case, and the values), run in a fresh
    interpreter so that the process-wide peak belongs to that case alone: the JSON of the child's last output line.
    The child runs the same module (`python -m benchmarks.experiments.<name>`) in this process's working directory."""
    module = sys.modules["__main__"].__spec__.name
    out = subprocess.run([sys.executable, "-m", module, *sys.argv[1:], *case], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"case {' '.join(case)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tail(path: str, n: int = 3000) -> str:
    with open(path) as f:
        return f.read()[-n:]


def read_metrics(run_dir: str) -> list:
    (name,) = [d for d in os.listdir(run_dir) if d != "wandb"]
    with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "time/step" in line]


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")
