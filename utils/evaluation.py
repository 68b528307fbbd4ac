"""Held-out evaluation during a run: greedy answers and n samples per prompt from the sampler, graded, their summed
token entropy under the policy, and the scores over all ranks (per test set and their mean)."""

import math
from collections import Counter

import torch
import torch.distributed as dist

from .batching import collate
from .distributed import all_reduce_sums
from .reward import grade, pass_at_k


def evaluate(args, sampler, policy, tokenizer, eval_data: list, logprobs) -> dict:
    """Held-out greedy accuracy; with --eval-samples n also n samples per prompt at the training temperature (seeded by
    the prompt's position: the same draw each time), their mean accuracy, pass@k, entropy (eval_metrics)."""
    rank, world_size, n, device = dist.get_rank(), dist.get_world_size(), args.eval_samples, policy.device
    shard = eval_data[rank::world_size]
    prompts = [p for p, _, _ in shard]
    greedy = sampler.generate(prompts, [0] * len(prompts), 1, greedy=True)
    seeds = [(rank + i * world_size) * n for i in range(len(prompts))]  # global position x n
    sampled = sampler.generate(prompts, seeds, n) if n else []
    entropies = sample_entropies(logprobs, policy, tokenizer, prompts, sampled, n, args.micro_batch_size)
    return eval_metrics(tokenizer, shard, greedy, sampled, n, entropies, eval_data, device)


def sample_entropies(logprobs, policy, tokenizer, prompts: list, samples: list, n: int, micro_batch_size: int) -> list:
    """Each sample's summed token entropy under the policy (`logprobs`: the script's log-prob function; samples: n per
    prompt, prompt-major), micro-batch by micro-batch; ZeRO-3 gathers the weights per forward, so every rank calls
    the model equally often (past its own samples, with empty micro-batches). The vLLM engine is awake meanwhile: the
    forward's activations come on top of its budget (benchmarks/results/gpu_memory_plan.md counts them)."""
    mbs, device, entropies = micro_batch_size, policy.device, []
    calls = torch.tensor([math.ceil(len(samples) / mbs)], device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    with torch.no_grad():
        for s in range(0, int(calls.item()) * mbs, mbs):
            chunk = [x.ids for x in samples[s : s + mbs]]
            batch = collate([prompts[k // n] for k in range(s, s + len(chunk))], chunk, tokenizer.pad_token_id, device)
            token_entropy = logprobs(policy, batch, with_entropy=True)[1]
            entropies += [e.sum().item() for e in token_entropy.split(batch["lengths"].tolist())]
    return entropies


def eval_metrics(tokenizer, shard: list, greedy: list, sampled: list, n: int, entropies: list, eval_data: list, device):
    """Held-out metrics over all ranks from this rank's Samples of its `shard` of `eval_data` ((prompt, answer, set)
    rows; every rank passes all of them, for the sets and their sizes); `entropies`: each sample's summed token
    entropy. Per set eval/<set>/<metric>, and eval/<metric> their mean over the sets: acc and response_length of the
    greedy answers; with n samples per prompt, mean_acc, pass@k (k = 2, 4, ..., n), entropy, sampled_response_length."""

    def reward(ids, answer) -> float:
        return grade(tokenizer.decode(ids, skip_special_tokens=True), answer)[0]

    sizes = Counter(name for _, _, name in eval_data)  # set -> prompts, in first-seen order on every rank
    ks = sorted({min(2**i, n) for i in range(1, n.bit_length() + 1)})  # 2, 4, ..., n
    fields = ["correct", "length", "sampled_correct", "tokens", "entropy", *(f"pass@{k}" for k in ks)]
    sums = {f"{name}|{field}": 0.0 for name in sizes for field in fields}
    for i, ((_, answer, name), answer_sample) in enumerate(zip(shard, greedy)):
        sums[f"{name}|correct"] += reward(answer_sample.ids, answer)
        sums[f"{name}|length"] += len(answer_sample.ids)
        if n:
            c = sum(reward(s.ids, answer) == 1 for s in sampled[i * n : (i + 1) * n])
            sums[f"{name}|sampled_correct"] += c
            sums[f"{name}|tokens"] += sum(len(s.ids) for s in sampled[i * n : (i + 1) * n])
            sums[f"{name}|entropy"] += sum(entropies[i * n : (i + 1) * n])
            for k in ks:
                sums[f"{name}|pass@{k}"] += pass_at_k(n, c, k)
    totals = all_reduce_sums(sums, device)
    per_set = {}
    for name, m in sizes.items():
        t = {field: totals[f"{name}|{field}"] for field in fields}
        per_set[name] = {"acc": t["correct"] / m, "response_length": t["length"] / m}
        if n:
            per_set[name]["mean_acc"] = t["sampled_correct"] / (n * m)
            per_set[name].update({f"pass@{k}": t[f"pass@{k}"] / m for k in ks})
            per_set[name]["entropy"] = t["entropy"] / max(t["tokens"], 1)
            per_set[name]["sampled_response_length"] = t["tokens"] / (n * m)

    def mean(key: str) -> float:
        return sum(values[key] for values in per_set.values()) / len(per_set)

    metrics = {"eval/acc": mean("acc"), "eval/response_length": mean("response_length")}
    if n:
        metrics["eval/mean_acc"] = mean("mean_acc")
        metrics.update({f"eval/pass@{k}": mean(f"pass@{k}") for k in ks})
        metrics["eval/entropy"] = mean("entropy")
        metrics["eval/sampled_response_length"] = mean("sampled_response_length")
    metrics.update({f"eval/{name}/{key}": v for name, values in per_set.items() for key, v in values.items()})
    return metrics
