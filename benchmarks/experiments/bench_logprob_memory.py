"""The log-prob / entropy pass at Qwen2.5's real sizes (vocabulary 151,936, hidden 1536, random weights), forward +
backward: ours (utils.logprobs.chunked_logprobs_entropy, the head run --chunk-size tokens at a time and recomputed in
the backward) against the naive pass (full [tokens, vocab] float32 logits, log_softmax, entropy from them).

    python -m benchmarks.experiments.bench_logprob_memory                      # CPU: 1k, 4k, 16k tokens, --max-gb 7
    python -m benchmarks.experiments.bench_logprob_memory --tokens 64 256 --hidden 64 --vocab 4096 --in-process  # fast
    python -m benchmarks.experiments.bench_logprob_memory --tokens 4096 16384 65536 --device cuda --max-gb 60

Both compute the log-prob of each target token and the full-vocabulary entropy at temperature 1 from final hidden
states [N, H] and the head weight [V, H]; the loss sum(u * logp) + sum(w * entropy) (random u, w) is back-propagated
into the hidden states and the head weight. Their gradient buffers exist before the call (as in training, where they
persist), so "extra peak memory" is what the pass itself allocates on top of its inputs and gradients.
Memory: on CUDA torch.cuda.max_memory_allocated; on CPU every case runs alone in a fresh subprocess that resets its
peak resident size (Linux /proc/self/clear_refs) just before the pass and reads VmHWM after it, so every allocation
torch makes is seen. Time: the same single run (CPU: --threads threads), or the median of --repeats on CUDA.
A naive case whose estimated peak (linear in tokens from the smallest naive case measured, and at least one float32
[tokens, vocab] tensor) exceeds --max-gb is skipped and reported as such. Values and gradients of the two are
compared at the smallest size.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.experiments.perf_common import case_in_child, extra_peak_bytes
from utils.logprobs import chunked_logprobs_entropy


def naive_logprobs_entropy(hidden, head, targets):
    logits = head(hidden).float()
    logp_all = F.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


def make_inputs(a, n):
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, a.dtype)
    head = torch.nn.Linear(a.hidden, a.vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(a.vocab, a.hidden, generator=g) * 0.02)
    hidden = torch.randn(n, a.hidden, generator=g).to(dtype)
    targets = torch.randint(0, a.vocab, (n,), generator=g)
    u, w = torch.randn(n, generator=g), torch.randn(n, generator=g)
    head, hidden = head.to(a.device), hidden.to(a.device).requires_grad_()
    head.weight.grad, hidden.grad = torch.zeros_like(head.weight), torch.zeros_like(hidden)  # persistent grad buffers
    return head, hidden, targets.to(a.device), u.to(a.device), w.to(a.device)


def forward_backward(a, variant, head, hidden, targets, u, w):
    if variant == "ours":
        chunk = a.chunk_size if hidden.shape[0] != a.check_tokens else max(1, a.check_tokens // 4)
        logp, entropy, _ = chunked_logprobs_entropy(hidden, head, targets, 1.0, chunk, True)
    else:
        logp, entropy = naive_logprobs_entropy(hidden, head, targets)
    ((logp * u).sum() + (entropy * w).sum()).backward()
    return logp.detach(), entropy.detach()


def sync(a):
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(a, variant, n) -> dict:
    """Extra peak bytes and seconds of one forward + backward (CPU: call this in a fresh process)."""
    inputs = make_inputs(a, n)
    cuda = a.device.startswith("cuda")
    if cuda:
        forward_backward(a, variant, *inputs)  # warm-up (kernels, allocator)
        times = []
        for _ in range(a.repeats):
            sync(a)
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            forward_backward(a, variant, *inputs)
            sync(a)
            times.append(time.perf_counter() - start)
        return {"extra_bytes": torch.cuda.max_memory_allocated() - before, "seconds": statistics.median(times)}
    start = time.perf_counter()
    _, extra = extra_peak_bytes(lambda: forward_backward(a, variant, *inputs))
    return {"extra_bytes": extra, "seconds": time.perf_counter() - start}


def run_case(a, variant, n) -> dict:
    if a.device.startswith("cuda") or a.in_process:
        return measure(a, variant, n)
    return case_in_child("--case", variant, str(n))


def check_agreement(a) -> tuple:
    """Max |difference| of log-probs, entropies and both gradients between ours and naive, on --check-tokens tokens."""
    outs = {}
    for variant in ("ours", "naive"):
        head, hidden, targets, u, w = make_inputs(a, a.check_tokens)
        logp, entropy = forward_backward(a, variant, head, hidden, targets, u, w)
        outs[variant] = (logp, entropy, hidden.grad, head.weight.grad)
    return tuple((x.float() - y.float()).abs().max().item() for x, y in zip(outs["ours"], outs["naive"]))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--hidden", type=int, default=1536, help="hidden width (Qwen2.5-1.5B: 1536)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen2.5: 151,936)")
    p.add_argument("--chunk-size", type=int, default=1024, help="grpo_*.py --logprob-chunk-size")
    p.add_argument("--check-tokens", type=int, default=256, help="tokens for the agreement check (chunk: 1/4 of them)")
    p.add_argument("--dtype", default="float32", help="hidden states and head weight (logits are float32 in both)")
    p.add_argument("--max-gb", type=float, default=7.0, help="skip a naive case estimated to need more extra memory")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (CUDA; CPU runs each case once)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="CPU: measure every case in this process (faster start, "
        "but memory freed by earlier cases may be reused; for quick checks)",
    )
    p.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.case:
        return print(json.dumps(measure(a, a.case[0], int(a.case[1]))))

    diffs = check_agreement(a)  # with chunks of a quarter of the tokens, so that several chunks are exercised
    rows, per_token = [], None
    for n in sorted(a.tokens):
        ours = run_case(a, "ours", n)
        estimate = per_token * n if per_token else None
        if estimate and estimate > a.max_gb * 2**30:
            naive = {"skipped": f"estimated {estimate / 2**30:.1f} GB > --max-gb {a.max_gb:g}"}
        else:
            naive = run_case(a, "naive", n)
            per_token = per_token or max(naive["extra_bytes"] / n, a.vocab * 4)  # >= one float32 logits row
        rows.append((n, ours, naive))

    print(
        f"log-prob + entropy pass, forward + backward: vocabulary {a.vocab}, hidden {a.hidden}, {a.dtype} inputs, "
        f"float32 logits, chunk {a.chunk_size}, {a.device}"
        + ("" if a.device.startswith("cuda") else f", {a.threads} thread(s)")
    )
    print(
        "| tokens | ours: extra peak (MB) | naive: extra peak (MB) | memory naive / ours | ours: time (s) | "
        "naive: time (s) | time ours / naive |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, ours, naive in rows:
        om = ours["extra_bytes"] / 2**20
        if "skipped" in naive:
            print(f"| {n} | {om:.0f} | skipped: {naive['skipped']} | | {ours['seconds']:.2f} | | |")
            continue
        nm = naive["extra_bytes"] / 2**20
        print(
            f"| {n} | {om:.0f} | {nm:.0f} | {nm / max(om, 1e-9):.1f}x | "
            f"{ours['seconds']:.2f} | {naive['seconds']:.2f} | "
            f"{ours['seconds'] / naive['seconds']:.2f} |"
        )
    print(
        f"ours (chunks of {max(1, a.check_tokens // 4)}) vs naive on {a.check_tokens} tokens, max |difference|: "
        f"log-prob {diffs[0]:.1e}, entropy {diffs[1]:.1e}, "
        f"hidden grad {diffs[2]:.1e}, head grad {diffs[3]:.1e}"
    )
    ok = all(d < 1e-3 for d in diffs)
    print(f"values and gradients agree to 1e-3: {'yes' if ok else 'NO'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
