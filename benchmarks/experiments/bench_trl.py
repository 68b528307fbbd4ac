"""Ours (grpo_vanilla.py) against TRL's GRPOTrainer doing the same work on a CPU: s/step, real tokens/s, padding, RSS.

    python -m benchmarks.experiments.bench_trl                  # 3.36M random Qwen2, 2 prompts x 8 x 32 tokens
    python -m benchmarks.experiments.bench_trl --steps 30 --repeats 3 \
        --variants ours-hf trl-hf trl-hf-zero2 ours-vllm trl-vllm
    python -m benchmarks.experiments.bench_trl --varlen --max-response-length 256 --steps 10 --warmup 2  # ~64 tokens

Same work on both sides: the same model (a random-weights Qwen2 on the testbed tokenizer, see perf_common.random_qwen2;
random weights never stop early, so every completion is exactly --max-response-length tokens), the same prompts at
every step (the first problems of the testbed's train.jsonl in ours' seeded draw order: TRL reads a copy written in
that order, unshuffled; checked by their answers; chat template applied by both), the same reward
(math-verify via utils.reward.grade, in the training process: ours --grading-workers 1), sampling at T=1 / top_p 1 /
top_k 0, fp32, no gradient checkpointing, AdamW at the same learning rate, grad-norm clipping at 1, no KL (ours
--kl-coef 0, TRL beta=0), seed 1, one process each.
trl-hf-zero2 is TRL with DeepSpeed ZeRO-2 (its `deepspeed` config, via accelerate), the engine ours always trains with:
the like-for-like peer for a multi-GPU codebase; trl-hf is TRL on plain PyTorch.

--varlen: the same model family made to stop (perf_common.random_qwen2_varlen: an eos logit in the weights, so HF
generate and vLLM stop alike), responses of --mean-response-length tokens on average (default a quarter of the
maximum), lengths close to geometric: ~2% reach the maximum. The *-packed variants of ours add
--max-tokens-per-micro-batch N --padding-free (micro-batches of at most N prompt + response tokens, each one row
without padding); ours-hf / ours-vllm keep fixed micro-batches of the whole mini-batch, padded to its longest sequence,
as TRL pads its batch (prompts left-padded to the longest prompt, completions right-padded to the longest completion).

Mapping of one training step (one rollout batch of P prompts x G completions, M optimizer updates):
- ours: --num-prompts-per-step P --group-size G --num-mini-batches M --num-epochs 1 --micro-batch-size P*G/M
  --loss-agg token-mean; time/step from runs/<run>/metrics.jsonl (generation to weight push, no logging).
- TRL: per_device_train_batch_size P*G/M (it counts completions), num_generations G, steps_per_generation M,
  num_iterations 1, gradient_accumulation_steps 1, loss_type "dapo" (token sum / active tokens of the whole
  generation batch = our token-mean); a callback times on_step_begin -> on_step_end of each optimizer step, and the
  M steps that share one generation are summed.
With M = 1 TRL skips the "old log-prob" forward (old = current, detached) and ours runs it (its old log-probs come
from that pass in every run, since December 2026); with M > 1 both run it. With vLLM TRL always runs it.

Each variant runs as its own subprocess, variants alternating (A B A B ...) --repeats times (with --max-load, each
run first waits up to --max-wait seconds for the 1-minute load average to drop below it); the first --warmup steps
of every run are dropped. Every repeat of a variant samples the same responses (seeded), so it repeats the same
work: each counted step's time is its median over the repeats (a repeat slowed by other jobs drops out), s/step the
median over the steps, tokens/s the steps' real tokens over their seconds; with the peak RSS of the process
(os.wait4) and the end-to-end wall time including start-up. Ratios are ours / TRL.
Real tokens are the prompt + response tokens of a step (ours: charts/tokens_per_second x time/step; TRL: its prompt
and completion masks in compute_loss); tokens/s is per step, and per training phase: ours time/logprob +
time/training, TRL its step less _generate_and_score_completions (forward, backward, optimizer step; at M = 1 the
generation holds no policy forward besides sampling). Padding fraction: ours charts/padding_frac, TRL 1 - real
tokens / the positions of its padded [batch, prompt + completion] inputs.
Phases: TRL's "generation" is _generate_and_score_completions (sampling, reward, and with vLLM or M > 1 its old-log-prob
forward), "hf_generate" the sampling alone (model.generate), comparable to ours' generation.
On a shared machine other jobs stretch wall times: the table also gives the best run (the lowest per-run median) and
the 1-minute load average seen at the start of the runs.
"""

import argparse
import json
import os
import sys
import tempfile
import time

from benchmarks.experiments.perf_common import (
    ROOT,
    length_stats,
    median,
    n_params,
    prompt_file,
    random_qwen2,
    random_qwen2_varlen,
    read_metrics,
    run_measured,
    tail,
)
from testbed.ports import free_port

VARIANTS = ["ours-hf", "ours-hf-packed", "trl-hf", "trl-hf-zero2", "ours-vllm", "ours-vllm-packed", "trl-vllm"]


def trl_child(a):
    """Runs inside the TRL subprocess: train a.steps steps, write per-step times, phases and batch shapes to a.out."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from utils.data import format_prompt, load_problems
    from utils.reward import grade

    torch.set_num_threads(1)
    if a.vllm:  # ours' CPU engine settings: linear weights kept (so that weight pushes land), no graph compilation
        import functools

        import trl.generation.vllm_generation as trl_vllm

        from utils.vllm_engine import keep_vllm_cpu_weights

        keep_vllm_cpu_weights()
        trl_vllm.LLM = functools.partial(trl_vllm.LLM, enforce_eager=True)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    rows = load_problems(a.prompts, None, None, None)
    data = Dataset.from_list([{"prompt": format_prompt(r["problem"], tokenizer), "answer": r["answer"]} for r in rows])

    answers = []  # per reward call (a generation batch): the prompts' answers, to check they are ours'

    def reward(completions, answer, **kw):
        answers.append(list(answer))
        return [grade(c, ans)[0] for c, ans in zip(completions, answer)]

    class Timer(TrainerCallback):
        begin, times = 0.0, []

        def on_step_begin(self, args, state, control, **kw):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.begin)

    M = a.num_mini_batches
    config = GRPOConfig(
        output_dir=a.out + ".trl",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        beta=0.0,
        report_to="none",
        max_steps=a.steps * M,
        per_device_train_batch_size=a.num_prompts * a.group_size // M,
        num_generations=a.group_size,
        steps_per_generation=M,
        num_iterations=1,
        gradient_accumulation_steps=1,
        loss_type="dapo",
        max_completion_length=a.max_response_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=a.lr,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        save_strategy="no",
        logging_steps=10**6,
        shuffle_dataset=False,
        seed=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        use_vllm=a.vllm,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=False,
        deepspeed=(
            {
                "zero_optimization": {"stage": 2},
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "bf16": {"enabled": False},
                "zero_force_ds_cpu_optimizer": False,
            }
            if a.zero2
            else None
        ),
    )
    timer = Timer()
    trainer = GRPOTrainer(
        model=a.model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    phases = {
        "generation": [],
        "hf_generate": [],
        "forward": [],
        "backward": [],
    }  # per-call seconds of TRL's own methods

    def timed(name, fn):
        def wrapper(*args, **kw):
            start = time.perf_counter()
            out = fn(*args, **kw)
            phases[name].append(time.perf_counter() - start)
            return out

        return wrapper

    trainer._generate_and_score_completions = timed("generation", trainer._generate_and_score_completions)
    trainer.model.generate = timed("hf_generate", trainer.model.generate)  # the sampling alone, as ours' generation
    batches = []  # per compute_loss call: real tokens, padded positions, completion lengths

    def shapes(fn):
        def wrapper(model, inputs, *args, **kw):
            masks = inputs["prompt_mask"], inputs["completion_mask"]
            real, positions = sum(int(m.sum()) for m in masks), sum(m.numel() for m in masks)
            batches.append({"real": real, "positions": positions, "lengths": masks[1].sum(1).tolist()})
            return fn(model, inputs, *args, **kw)

        return wrapper

    trainer.compute_loss = shapes(timed("forward", trainer.compute_loss))
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
    trainer.train()
    per_rollout = [sum(timer.times[i : i + M]) for i in range(0, len(timer.times), M)]
    per_batch = [batches[i : i + M] for i in range(0, len(batches), M)]
    steps = [
        {k: sum(b[k] for b in bs) for k in ("real", "positions")} | {"lengths": [x for b in bs for x in b["lengths"]]}
        for bs in per_batch
    ]
    json.dump({"step_times": per_rollout, "phases": phases, "batches": steps, "answers": answers}, open(a.out, "w"))


def command(a, variant: str, out: str) -> list:
    py = sys.executable
    if variant.startswith("trl"):
        return [
            py,
            "-m",
            "benchmarks.experiments.bench_trl",
            "--child",
            "--vllm" if variant == "trl-vllm" else "--no-vllm",
            *(["--zero2"] if variant == "trl-hf-zero2" else []),
            "--model",
            a.model,
            "--prompts",
            a.trl_prompts,
            "--out",
            out,
            "--steps",
            str(a.steps),
            "--num-prompts",
            str(a.num_prompts),
            "--group-size",
            str(a.group_size),
            "--max-response-length",
            str(a.max_response_length),
            "--num-mini-batches",
            str(a.num_mini_batches),
            "--lr",
            str(a.lr),
        ]
    packed = variant.endswith("-packed")
    flags = {
        "model-name-or-path": a.model,
        "dataset": a.prompts,
        "output-dir": out,
        "total-steps": a.steps,
        "num-prompts-per-step": a.num_prompts,
        "group-size": a.group_size,
        "max-prompt-length": 128,
        "max-response-length": a.max_response_length,
        "num-mini-batches": a.num_mini_batches,
        "num-epochs": 1,
        "micro-batch-size": a.num_prompts * a.group_size // a.num_mini_batches,
        "learning-rate": a.lr,
        "save-every": 0,
        "eval-every": 0,
        "loss-agg": "token-mean",
        "grading-workers": 1,  # in the training process, as TRL grades
        **({"max-tokens-per-micro-batch": a.max_tokens_per_micro_batch} if packed else {}),
    }
    cmd = [py, os.path.join(ROOT, "grpo_vanilla.py"), "--no-gradient-checkpointing"]
    cmd += [] if variant.startswith("ours-vllm") else ["--no-use-vllm"]
    if variant.startswith("ours-vllm") and a.vllm_kv_cache_memory:
        cmd += ["--vllm-kv-cache-memory", str(a.vllm_kv_cache_memory)]
    cmd += ["--padding-free"] if packed else []
    for k, v in flags.items():
        cmd += [f"--{k}", str(v)]
    return cmd


def step_records(variant: str, out: str) -> list:
    """Per training step: seconds, real tokens, padding fraction, training-phase seconds, response lengths (TRL: each
    completion's; ours: the mean, the longest and the fraction stopped at the maximum)."""
    if variant.startswith("trl"):
        data = json.load(open(out))
        generation = phase_per_step(data)["generation"]
        return [
            {"step": t, "real": b["real"], "padding": 1 - b["real"] / b["positions"], "train": t - g}
            | {"lengths": b["lengths"]}
            for t, b, g in zip(data["step_times"], data["batches"], generation)
        ]
    return [
        {
            "step": m["time/step"],
            "real": m["charts/tokens_per_second"] * m["time/step"],
            "padding": m["charts/padding_frac"],
            "train": m["time/logprob"] + m["time/training"],
            "mean_length": m["rollout/response_length"],
            "max_length": m["rollout/response_length_max"],
            "truncated": m["rollout/truncation_rate"],
        }
        for m in read_metrics(out)
    ]


def phase_per_step(data: dict) -> dict:
    """TRL's per-call phase timers summed per rollout batch."""
    steps = len(data["step_times"])
    chunks = {k: len(v) // steps for k, v in data["phases"].items()}  # calls per rollout batch
    return {
        k: [sum(v[i * chunks[k] : (i + 1) * chunks[k]]) for i in range(steps)]
        for k, v in data["phases"].items()
        if chunks[k]
    }


def phase_times(variant: str, out: str, warmup: int) -> dict:
    """Seconds per rollout batch of each phase: ours from metrics.jsonl, TRL from timers around its methods
    (generation = _generate_and_score_completions incl. reward and, with vLLM, the old log-prob pass; forward =
    compute_loss; backward = accelerator.backward; the rest of its step is the optimizer step and bookkeeping)."""
    if variant.startswith("trl"):
        return {k: v[warmup:] for k, v in phase_per_step(json.load(open(out))).items()}
    ms = read_metrics(out)[warmup:]
    phases = ("generation", "reward", "logprob", "training", "weight_push")
    return {k: [m[f"time/{k}"] for m in ms] for k in phases}


def ours_order(a, path: str) -> tuple:
    """The prompt file in the order ours draws it (utils.data.step_prompt_indices, seed 1), for TRL, which reads its
    unshuffled dataset in order: both sides train on the same prompts at every step. Also each step's answers."""
    from utils.data import load_problems, step_prompt_indices

    rows, answers = open(a.prompts).readlines(), [r["answer"] for r in load_problems(a.prompts, None, None, None)]
    layout = argparse.Namespace(num_prompts_per_step=a.num_prompts, num_mini_batches=a.num_mini_batches, seed=1)
    picks = [[i for _, i in step_prompt_indices(step, layout, len(rows), 0, 1)] for step in range(a.steps)]
    with open(path, "w") as f:
        f.writelines(rows[i] for step in picks for i in step)
    return path, [[answers[i] for i in step] for step in picks]


def wait_for_load(max_load: float, max_wait: float) -> float:
    """Sleep until the 1-minute load average is below max_load (at most max_wait seconds); return it."""
    deadline = time.time() + max_wait
    while max_load and os.getloadavg()[0] >= max_load and time.time() < deadline:
        time.sleep(10)
    return os.getloadavg()[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS, help="default: see the first line printed")
    p.add_argument("--model", default=None, help="HF model dir (default: a 3.36M random Qwen2, see perf_common)")
    p.add_argument("--steps", type=int, default=25, help="training steps (rollout batches) per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run not counted")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-response-length", type=int, default=32)
    p.add_argument("--varlen", action="store_true", help="responses that stop (perf_common.random_qwen2_varlen)")
    p.add_argument("--mean-response-length", type=float, default=None, help="with --varlen (default: max / 4)")
    p.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        default=0,
        help="of ours' *-packed variants (default: 512, or more "
        "if the longest possible sequence, 128 prompt tokens + --max-response-length, needs it)",
    )
    p.add_argument("--num-mini-batches", type=int, default=1, help="optimizer updates per rollout batch (M)")
    p.add_argument(
        "--vllm-kv-cache-memory",
        type=float,
        default=0.0,
        help="ours-vllm*: the engine's KV cache in GiB (--vllm-kv-cache-memory; 0: VLLM_CPU_KVCACHE_SPACE's, 1 GiB)",
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--max-load", type=float, default=0.0, help="wait before each run for a lower load average")
    p.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for --max-load at most, per run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=False, help=argparse.SUPPRESS)
    p.add_argument("--zero2", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return trl_child(a)

    L = a.max_response_length
    a.max_tokens_per_micro_batch = a.max_tokens_per_micro_batch or max(512, 128 + L)
    if a.varlen:
        a.mean_response_length = a.mean_response_length or L / 4
        a.model = a.model or random_qwen2_varlen(L, a.mean_response_length)
        a.variants = a.variants or ["ours-hf", "ours-hf-packed", "trl-hf", "ours-vllm-packed"]
    else:
        a.model = a.model or random_qwen2()
        a.variants = a.variants or ["ours-hf", "trl-hf", "trl-hf-zero2", "ours-vllm", "trl-vllm"]
    work = tempfile.mkdtemp(prefix="bench_trl_")
    a.prompts = prompt_file(max(64, a.num_prompts * a.steps), os.path.join(work, "prompts.jsonl"))
    a.trl_prompts, step_answers = ours_order(a, os.path.join(work, "prompts_trl.jsonl"))
    results = {v: {"runs": [], "phases": [], "rss": [], "wall": [], "load": [], "failed": None} for v in a.variants}
    for r in range(a.repeats):
        for v in a.variants:
            if results[v]["failed"]:
                continue
            out = os.path.join(work, f"{v}_{r}" + (".json" if v.startswith("trl") else ""))
            results[v]["load"].append(wait_for_load(a.max_load, a.max_wait))
            env = {"MASTER_PORT": str(free_port())}  # DeepSpeed under TRL (accelerate): a 1-process distributed env
            env.update(
                {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
                if v == "trl-hf-zero2"
                else {}
            )
            run = run_measured(command(a, v, out), env, out + ".log", a.timeout)
            if run["rc"] != 0:
                results[v]["failed"] = f"exit {run['rc']}, log {run['log']}"
                print(f"{v}: FAILED ({results[v]['failed']}):\n{tail(run['log'], 1500)}", file=sys.stderr)
                continue
            if v.startswith("trl"):  # the same prompts as ours at every step
                seen = [batch[:: a.group_size] for batch in json.load(open(out))["answers"]]
                results[v]["same_prompts"] = results[v].get("same_prompts", True) and seen == step_answers
            results[v]["runs"].append(step_records(v, out)[a.warmup :])
            results[v]["phases"].append(phase_times(v, out, a.warmup))
            results[v]["rss"].append(run["peak_rss"])
            results[v]["wall"].append(run["wall"])
            run_step = median([x["step"] for x in results[v]["runs"][-1]])
            print(
                f"repeat {r} {v}: {run_step:.3f} s/step, peak RSS {run['peak_rss'] / 2**20:.0f} MB, "
                f"wall {run['wall']:.1f} s, load {results[v]['load'][-1]:.1f}",
                file=sys.stderr,
            )

    def over_repeats(series: list) -> list:
        """Each counted step's median over the repeats (a repeat samples the same responses: the same work)."""
        return [median([xs[i] for xs in series]) for i in range(min(map(len, series)))]

    def summary(res: dict) -> dict:
        step, train, real, padding = (
            over_repeats([[x[k] for x in run] for run in res["runs"]]) for k in ("step", "train", "real", "padding")
        )
        return {
            "step": median(step),
            "best": min(median([x["step"] for x in run]) for run in res["runs"]),
            "real": median(real),
            "tps": sum(real) / sum(step),
            "train_tps": sum(real) / sum(train),
            "padding": median(padding),
            "rss": max(res["rss"]),
            "wall": median(res["wall"]),
            "load": median(res["load"]),
            "phases": {k: median(over_repeats([ph[k] for ph in res["phases"]])) for k in res["phases"][0]},
        }

    done = {v: summary(res) for v, res in results.items() if res["runs"]}
    lengths = f"{L} tokens" if not a.varlen else f"at most {L} tokens (mean {a.mean_response_length:g} by design)"
    print(
        f"model {a.model} ({n_params(a.model) / 1e6:.2f}M params), {a.num_prompts} prompts x {a.group_size} "
        f"completions x {lengths}, {a.num_mini_batches} optimizer update(s) per step, {a.steps} steps per run "
        f"(first {a.warmup} not counted), {a.repeats} alternating repeats, 1 process, OMP_NUM_THREADS=1"
        + (
            f"; *-packed: --max-tokens-per-micro-batch {a.max_tokens_per_micro_batch} --padding-free"
            if a.varlen
            else ""
        )
        + (f"; ours-vllm*: --vllm-kv-cache-memory {a.vllm_kv_cache_memory:g}" if a.vllm_kv_cache_memory else "")
    )
    if a.varlen:
        print("response lengths (tokens, eos included), counted steps:")
        for v, res in results.items():
            rec = res["runs"][0] if res["runs"] else []  # every repeat samples the same
            if rec and v.startswith("trl"):
                st = length_stats([x for r in rec for x in r["lengths"]], L)
                print(
                    f"- {v}: {st['n']} samples: mean {st['mean']:.1f}, median {st['median']:g}, p90 {st['p90']:g}, "
                    f"at the maximum {100 * st['at_max']:.1f}%"
                )
            elif rec:
                mean = sum(x["mean_length"] for x in rec) / len(rec)
                print(
                    f"- {v}: {len(rec)} steps x {a.num_prompts * a.group_size} samples: mean {mean:.1f}, "
                    "stopped at the maximum "
                    f"{100 * sum(x['truncated'] for x in rec) / len(rec):.1f}%, longest per step (median) "
                    f"{median([x['max_length'] for x in rec]):g}"
                )
    print(
        "| variant | s/step (median) | s/step (best run) | real tokens/step | tokens/s (step) "
        "| tokens/s (training phase) | padding frac | peak RSS (MB) | run wall incl. start-up (s) | load avg |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for v, res in results.items():
        if v not in done:
            print(f"| {v} | failed: {res['failed']} | | | | | | | | |")
            continue
        d = done[v]
        print(
            f"| {v} | {d['step']:.3f} | {d['best']:.3f} | {d['real']:.0f} | {d['tps']:.0f} | {d['train_tps']:.0f} | "
            f"{d['padding']:.3f} | {d['rss'] / 2**20:.0f} | {d['wall']:.1f} | {d['load']:.1f} |"
        )
    for ours in (v for v in done if v.startswith("ours")):
        for trl in (v for v in done if v.startswith("trl")):
            o, t = done[ours], done[trl]
            print(
                f"| ratio {ours} / {trl} | {o['step'] / t['step']:.2f} | {o['best'] / t['best']:.2f} | "
                f"{o['real'] / t['real']:.2f} | **{o['tps'] / t['tps']:.2f}** | "
                f"**{o['train_tps'] / t['train_tps']:.2f}** | | **{o['rss'] / t['rss']:.2f}** | "
                f"{o['wall'] / t['wall']:.2f} | |"
            )
    print(
        "phases, median seconds per step:",
        "; ".join(f"{v}: " + ", ".join(f"{k} {x:.3f}" for k, x in d["phases"].items()) for v, d in done.items()),
    )
    for v in (v for v in results if "same_prompts" in results[v]):
        print(f"{v}'s prompts at every step are ours' (checked by their answers): {results[v]['same_prompts']}")
    print(f"runs and logs: {work}")


if __name__ == "__main__":
    main()
