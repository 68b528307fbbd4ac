"""A step-time model of one 8-GPU node: colocated engines against K rollout GPUs (--rollout-ranks K) at
--max-staleness 0 and 1, for Qwen2.5 1.5B / 7B / 32B and 3k / 8k-token responses. A model, not a measurement:
nothing here has run on a GPU, and bench_gpu.py (the measured phase times it should be checked against) has not run
on one either. Every input is stated below; change them and rerun.

    python -m benchmarks.experiments.rollout_model      # H200s (benchmarks/results/rollout_model.md)
    python -m benchmarks.experiments.rollout_model --gpu h100

Per step: 128 prompts x 8 samples (the scripts' defaults), prompts of 256 tokens, response lengths geometric with mean
a third of the maximum and capped at it (~5% reach it; the long tail of reasoning rollouts).
- Training (log-prob pass, then forward + backward with gradient checkpointing): 10 N FLOPs per token (2 + 6 + 2 for
  the recomputation) at MFU 0.35 of the GPU's dense bf16 peak, split evenly over the trainers (ZeRO: near-linear).
- Generation: decoding is bound by memory bandwidth: every decode step of an engine reads its weights (2 N bytes) and
  the KV cache of its running sequences, at 60% of the GPU's bandwidth; the sequences are split evenly over the
  engines (one per GPU, tensor parallel 1), as many running at once as the KV cache holds (colocated: half the GPU,
  --vllm-gpu-memory-utilization 0.5, less the weights; a rollout GPU: 0.9 of it), until the longest one ends, the
  batch shrinking as responses stop. The weight reads do not shrink with more engines: why generation scales worse
  than training. Prefill and grading are left out.
- Colocated: generation on 8 GPUs, then training on 8, then a weight push and the engine's sleep / wake
  (--vllm-sleep-level 1: 2 N bytes to host memory and back at 25 GB/s, plus 1 s).
- Rollout GPUs: generation on K, training on 8 - K; s = 0 one after the other, s = 1 overlapped (the step is the
  longer of the two); plus the push to the engines: 2 N bytes broadcast at 100 GB/s and 0.5 ms of header per tensor.
Published figures for comparison: verl's one-step-off-policy, Qwen2.5-Math-7B DAPO on 16 GPUs (4 generating, 12
training): 19h18m -> 15h34m, 1.24x (FSDP2), 18h21m -> 13h06m, 1.40x (Megatron) (verl docs/advance/one_step_off.md);
AReaL: up to 2.77x (fully asynchronous, larger clusters).
"""

import argparse

MODELS = {  # parameters, layers, KV heads, head dim, tensors in the state dict (Qwen2.5 configs)
    "1.5B": (1.54e9, 28, 2, 128, 338),
    "7B": (7.62e9, 28, 4, 128, 339),
    "32B": (32.8e9, 64, 8, 128, 771),
}
GPUS = {"h200": (989e12, 4.8e12, 141), "h100": (989e12, 3.35e12, 80)}  # dense bf16 FLOP/s, bytes/s, GB


def survival(k: int, mean: float, cap: int) -> float:
    """P(response longer than k tokens): geometric with the given mean, cut at the cap."""
    return 0.0 if k >= cap else (1 - 1 / mean) ** k


def generation_s(model, cap: int, engines: int, sequences: int, prompt: int, bandwidth: float, kv_gb: float) -> float:
    """Seconds to decode `sequences` responses on `engines` engines with kv_gb of KV cache each: as many run at once as
    the cache holds (at prompt + mean tokens each); while more wait, every step runs a full batch; then the last ones
    drain, the batch shrinking as they stop."""
    n, layers, kv_heads, head_dim, _ = MODELS[model]
    kv_per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16
    mean, per_engine = cap / 3, sequences / engines
    running = min(per_engine, max(1.0, kv_gb * 1e9 / (kv_per_token * (prompt + mean))))
    full_steps = (per_engine - running) * mean / running  # continuous batching: a full batch while others wait
    total = full_steps * (2 * n + kv_per_token * running * (prompt + mean)) / (0.6 * bandwidth)
    for k in range(cap):
        active = running * survival(k, mean, cap)
        if active * engines < 0.5:  # the last response has ended
            break
        total += (2 * n + kv_per_token * max(active, 1) * (prompt + k)) / (0.6 * bandwidth)
    return total


def training_s(model, cap: int, trainers: int, sequences: int, prompt: int, peak: float) -> float:
    mean = sum(survival(k, cap / 3, cap) for k in range(cap))  # the expected response length
    return sequences * (prompt + mean) * 10 * MODELS[model][0] / (trainers * 0.35 * peak)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", choices=GPUS, default="h200")
    a = p.parse_args()
    peak, bandwidth, memory = GPUS[a.gpu]
    sequences, prompt, gpus = 1024, 256, 8
    print(f"8 x {a.gpu.upper()}, 128 prompts x 8 samples, the inputs of the docstring; s/step, speed-up vs colocated")
    print(
        "| model | max response | generation (8 GPUs) s | training (8 GPUs) s | colocated s/step | "
        "K=1 s1 | K=2 s1 | K=3 s1 | K=4 s1 | K=2 s0 | best | trainer state GB/GPU at best K |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in MODELS:
        n, *_, tensors = MODELS[model]
        for cap in (3072, 8192):
            kv = {"colocated": 0.5 * memory - 2 * n / 1e9, "rollout": 0.9 * memory - 2 * n / 1e9}  # GB per engine
            if kv["colocated"] < 5:  # the weights leave no room for a KV cache at tensor parallel 1
                print(f"| {model} | {cap} | " + " | ".join(["-"] * 9) + " | needs tensor parallel > 1: not modelled |")
                continue
            gen = {k: generation_s(model, cap, k, sequences, prompt, bandwidth, kv["rollout"]) for k in range(1, 8)}
            gen[gpus] = generation_s(model, cap, gpus, sequences, prompt, bandwidth, kv["colocated"])
            train = {k: training_s(model, cap, k, sequences, prompt, peak) for k in range(1, gpus + 1)}
            colocated = gen[gpus] + train[gpus] + 2 * 2 * n / 25e9 + 1.0
            push = 2 * n / 100e9 + tensors * 5e-4
            s1 = {k: max(gen[k], train[gpus - k]) + push for k in range(1, gpus)}
            s0 = gen[2] + train[gpus - 2] + push
            best = min(s1, key=s1.get)
            state = 16 * n / (gpus - best) / 1e9  # bf16 weights + fp32 master, grads and Adam, ZeRO over trainers
            cells = " | ".join(f"{colocated / s1[k]:.2f}x" for k in (1, 2, 3, 4))
            fits = "" if state < 0.7 * memory else " (ZeRO-3 + --offload)"
            print(
                f"| {model} | {cap} | {gen[gpus]:.0f} | {train[gpus]:.0f} | {colocated:.0f} | {cells} | "
                f"{colocated / s0:.2f}x | K={best}: {colocated / s1[best]:.2f}x | {state:.0f}{fits} |"
            )
    print("s1: --max-staleness 1 (overlapped); s0: --max-staleness 0 (the trainers wait); K: rollout GPUs of 8")


if __name__ == "__main__":
    main()
