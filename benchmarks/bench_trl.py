"""Ours (grpo_vanilla.py) against TRL's GRPOTrainer doing the same work on a CPU: seconds per training step, peak RSS.

    python benchmarks/bench_trl.py                              # 3.36M random Qwen2, 2 prompts x 8 x 32 tokens
    python benchmarks/bench_trl.py --steps 30 --repeats 3 --variants ours-hf trl-hf trl-hf-zero2 ours-vllm trl-vllm

Same work on both sides: the same model (a random-weights Qwen2 on the testbed tokenizer, see perf_common.random_qwen2;
random weights never stop early, so every completion is exactly --max-response-length tokens), the same prompt file
(the first --num-prompts problems of the testbed's train.jsonl, chat template applied by both), the same reward
(math-verify via utils.reward.grade), sampling at T=1 / top_p 1 / top_k 0, fp32, no gradient checkpointing, AdamW at
the same learning rate, grad-norm clipping at 1, no KL (ours --kl-coef 0, TRL beta=0), one process each.
trl-hf-zero2 is TRL with DeepSpeed ZeRO-2 (its `deepspeed` config, via accelerate), the engine ours always trains with:
the like-for-like peer for a multi-GPU codebase; trl-hf is TRL on plain PyTorch.

Mapping of one training step (one rollout batch of P prompts x G completions, M optimizer updates):
- ours: --num-prompts-per-step P --group-size G --num-mini-batches M --num-epochs 1 --micro-batch-size P*G/M
  --loss-agg token-mean; time/step from runs/<run>/metrics.jsonl (generation to weight push, no logging).
- TRL: per_device_train_batch_size P*G/M (it counts completions), num_generations G, steps_per_generation M,
  num_iterations 1, gradient_accumulation_steps 1, loss_type "dapo" (token sum / active tokens of the whole
  generation batch = our token-mean); a callback times on_step_begin -> on_step_end of each optimizer step, and the
  M steps that share one generation are summed.
With M = 1 both skip the "old log-prob" forward (old = current, detached; ours takes entropy/full from the training
forward); with M > 1 both run it. With vLLM TRL always runs it.

Each variant runs as its own subprocess, variants alternating (A B A B ...) --repeats times; the first --warmup steps
of every run are dropped, the median over the remaining steps of all repeats is reported, with the peak RSS of the
process (os.wait4) and the end-to-end wall time including start-up. Ratios are ours / TRL for the matching generator.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perf_common import ROOT, median, n_params, prompt_file, random_qwen2, read_metrics, run_measured, tail  # noqa: E402


def trl_child(a):
    """Runs inside the TRL subprocess: train a.steps steps, write per-step times to a.out."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from utils.data import format_prompt, load_problems
    from utils.reward import grade

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    rows = load_problems(a.prompts, None, None, None)
    data = Dataset.from_list([{"prompt": format_prompt(r["problem"], tokenizer), "answer": r["answer"]} for r in rows])

    def reward(completions, answer, **kw):
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
    trainer.compute_loss = timed("forward", trainer.compute_loss)
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
    trainer.train()
    per_rollout = [sum(timer.times[i : i + M]) for i in range(0, len(timer.times), M)]
    json.dump({"step_times": per_rollout, "phases": phases}, open(a.out, "w"))


def command(a, variant: str, out: str) -> list:
    py = sys.executable
    if variant.startswith("trl"):
        return [
            py,
            os.path.abspath(__file__),
            "--child",
            "--vllm" if variant == "trl-vllm" else "--no-vllm",
            *(["--zero2"] if variant == "trl-hf-zero2" else []),
            "--model",
            a.model,
            "--prompts",
            a.prompts,
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
    }
    cmd = [py, os.path.join(ROOT, "grpo_vanilla.py"), "--no-gradient-checkpointing"]
    cmd += [] if variant == "ours-vllm" else ["--no-use-vllm"]
    for k, v in flags.items():
        cmd += [f"--{k}", str(v)]
    return cmd


def step_times(variant: str, out: str) -> list:
    if variant.startswith("trl"):
        return json.load(open(out))["step_times"]
    return [m["time/step"] for m in read_metrics(out)]


def phase_times(variant: str, out: str, warmup: int) -> dict:
    """Seconds per rollout batch of each phase: ours from metrics.jsonl, TRL from timers around its methods
    (generation = _generate_and_score_completions incl. reward and, with vLLM, the old log-prob pass; forward =
    compute_loss; backward = accelerator.backward; the rest of its step is the optimizer step and bookkeeping)."""
    if variant.startswith("trl"):
        data = json.load(open(out))
        steps = len(data["step_times"])
        chunks = {k: len(v) // steps for k, v in data["phases"].items()}  # calls per rollout batch
        return {
            k: [sum(v[i * chunks[k] : (i + 1) * chunks[k]]) for i in range(steps)][warmup:]
            for k, v in data["phases"].items()
            if chunks[k]
        }
    ms = read_metrics(out)[warmup:]
    return {k[5:]: [m[k] for m in ms] for k in ("time/generation", "time/logprob", "time/training", "time/weight_push")}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--variants",
        nargs="+",
        default=["ours-hf", "trl-hf", "trl-hf-zero2", "ours-vllm", "trl-vllm"],
        choices=["ours-hf", "trl-hf", "trl-hf-zero2", "ours-vllm", "trl-vllm"],
    )
    p.add_argument("--model", default=None, help="HF model dir (default: a 3.36M random Qwen2, see perf_common)")
    p.add_argument("--steps", type=int, default=25, help="training steps (rollout batches) per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run not counted")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-response-length", type=int, default=32)
    p.add_argument("--num-mini-batches", type=int, default=1, help="optimizer updates per rollout batch (M)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=False, help=argparse.SUPPRESS)
    p.add_argument("--zero2", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return trl_child(a)

    a.model = a.model or random_qwen2()
    work = tempfile.mkdtemp(prefix="bench_trl_")
    a.prompts = prompt_file(max(64, a.num_prompts * a.steps), os.path.join(work, "prompts.jsonl"))
    results = {v: {"steps": [], "runs": [], "rss": [], "wall": [], "load": [], "failed": None} for v in a.variants}
    for r in range(a.repeats):
        for v in a.variants:
            if results[v]["failed"]:
                continue
            out = os.path.join(work, f"{v}_{r}" + (".json" if v.startswith("trl") else ""))
            results[v]["load"].append(os.getloadavg()[0])
            env = {"MASTER_PORT": str(29600 + r)}  # DeepSpeed under TRL (accelerate) wants a 1-process distributed env
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
            times = step_times(v, out)
            results[v]["steps"] += times[a.warmup :]
            results[v]["runs"].append(median(times[a.warmup :]))
            for k, xs in phase_times(v, out, a.warmup).items():
                results[v].setdefault("phases", {}).setdefault(k, []).extend(xs)
            results[v]["rss"].append(run["peak_rss"])
            results[v]["wall"].append(run["wall"])
            print(
                f"repeat {r} {v}: {median(times[a.warmup :]):.3f} s/step, peak RSS {run['peak_rss'] / 2**20:.0f} MB, "
                f"wall {run['wall']:.1f} s",
                file=sys.stderr,
            )

    print(
        f"model {a.model} ({n_params(a.model) / 1e6:.2f}M params), "
        f"{a.num_prompts} prompts x {a.group_size} completions "
        f"x {a.max_response_length} tokens, {a.num_mini_batches} optimizer update(s) per step, {a.steps} steps per run "
        f"(first {a.warmup} not counted), {a.repeats} alternating repeats, 1 process, OMP_NUM_THREADS=1"
    )
    print("| variant | s/step (median) | s/step (best run) | peak RSS (MB) | run wall incl. start-up (s) | load avg |")
    print("| --- | --- | --- | --- | --- | --- |")
    for v, res in results.items():
        if res["failed"] and not res["steps"]:
            print(f"| {v} | failed: {res['failed']} | | | | |")
        else:
            print(
                f"| {v} | {median(res['steps']):.3f} | {min(res['runs']):.3f} | {max(res['rss']) / 2**20:.0f} | "
                f"{median(res['wall']):.1f} | {median(res['load']):.1f} |"
            )
    for gen, peer in (("hf", "hf"), ("hf", "hf-zero2"), ("vllm", "vllm")):
        ours, trl = results.get(f"ours-{gen}"), results.get(f"trl-{peer}")
        if ours and trl and ours["steps"] and trl["steps"]:
            t, best, m = (
                median(ours["steps"]) / median(trl["steps"]),
                min(ours["runs"]) / min(trl["runs"]),
                max(ours["rss"]) / max(trl["rss"]),
            )
            print(
                f"| ratio ours / TRL ({peer}) | {t:.2f} | {best:.2f} | {m:.2f} | "
                f"{median(ours['wall']) / median(trl['wall']):.2f} | |"
            )
    print(
        "phases, median seconds per step:",
        "; ".join(
            f"{v}: " + ", ".join(f"{k} {median(xs):.3f}" for k, xs in res.get("phases", {}).items())
            for v, res in results.items()
            if res.get("phases")
        ),
    )
    print(f"runs and logs: {work}")


if __name__ == "__main__":
    main()
