"""What `--cov-scope global` costs in grpo_klcov.py / grpo_clipcov.py, and `--entropy-mask-source current` (the 80/20
rule's global scope from the current policy's entropies) in every script, per optimizer mini-batch, on one device.

Global selection needs the current log-prob of every token of the mini-batch before its gradient passes. On the first
mini-batch of a rollout batch those are the rollout's own (free); on every later one they take one extra no-grad
forward over the mini-batch, plus an all-gather of (logp, A[, eligible]) per token and a top-k / draw on the gathered
vector. `--entropy-mask-source current` takes the same extra forward with the entropy (the log-prob pass's kernel).
This script times both extra forwards against the mini-batch's forward+backward (what training costs anyway) and
reports the all-gather volume for a given world size.

    python -m benchmarks.experiments.bench_cov_selection          # the CPU testbed's model
    python -m benchmarks.experiments.bench_cov_selection --model Qwen/Qwen2.5-Math-1.5B --seqs 32 --response-len 3072 \
        --micro-batch-size 4 --world-size 8                       # on a GPU
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from grpo_klcov import kl_cov_select, response_logprobs, token_covariance
from utils.batching import collate


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model path or hub id (default: the CPU testbed's model)")
    p.add_argument("--seqs", type=int, default=32, help="sequences per rank in one optimizer mini-batch")
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=1024, help="--logprob-chunk-size")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--world-size", type=int, default=8, help="ranks, for the all-gather volume and the top-k size")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()

    if a.model is None:
        from testbed.build_arithmetic import build_testbed

        a.model = build_testbed(log=lambda *x: None).model_dir
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(device)
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.seqs)]
    responses = [torch.randint(3, vocab, (a.response_len,), generator=g).tolist() for _ in range(a.seqs)]
    batches = [
        collate(prompts[s : s + a.micro_batch_size], responses[s : s + a.micro_batch_size], 0, device)
        for s in range(0, a.seqs, a.micro_batch_size)
    ]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def train_pass():  # what every mini-batch costs anyway: forward + backward of each micro-batch
        for batch in batches:
            logp, _, _ = response_logprobs(model, batch, 1.0, a.chunk_size, False)
            (-logp.exp()).sum().backward()
        model.zero_grad(set_to_none=True)

    def extra_forward(with_entropy=False):  # what global selection (log-probs) or the mask source (entropies) adds
        with torch.no_grad():  # on a later mini-batch
            out = [response_logprobs(model, batch, 1.0, a.chunk_size, with_entropy) for batch in batches]
            return torch.cat([o[1 if with_entropy else 0] for o in out])

    n_global = a.seqs * a.response_len * a.world_size
    logp_all, adv_all = -torch.rand(n_global, device=device), torch.randn(n_global, device=device)

    def select():  # the top-k over the gathered mini-batch of all ranks (every rank does the same)
        return kl_cov_select(token_covariance(logp_all, adv_all), 2e-3)

    times = {}
    phases = (
        ("train fwd+bwd", train_pass),
        ("extra no-grad fwd", extra_forward),
        ("... with entropy", lambda: extra_forward(with_entropy=True)),
        ("select (top-k)", select),
    )
    for name, fn in phases:
        fn()  # warm-up
        runs = []
        for _ in range(a.repeats):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            runs.append(time.perf_counter() - t)
        times[name] = statistics.median(runs)
    tokens = a.seqs * a.response_len
    print(
        f"model {a.model} on {device}, {a.seqs} sequences x ({a.prompt_len} + {a.response_len}) tokens per rank, "
        f"micro-batch {a.micro_batch_size}, gradient checkpointing {a.gradient_checkpointing}"
    )
    for name, t in times.items():
        print(f"  {name:18s} {t * 1e3:9.1f} ms")
    ratio = times["extra no-grad fwd"] / times["train fwd+bwd"]
    print(
        f"  extra forward / training pass = {ratio:.2f} per later mini-batch; with M mini-batches per rollout batch "
        f"the training phase grows by (M-1)/M x {ratio:.2f} (M=4: {0.75 * ratio:.2f})"
    )
    ratio = times["... with entropy"] / times["train fwd+bwd"]
    print(
        f"  --entropy-mask-source current: the extra forward with entropy / training pass = {ratio:.2f} per later "
        "mini-batch"
    )
    print(
        f"  all-gather per mini-batch: {tokens} tokens per rank x 2 (KL-Cov) or 3 (Clip-Cov) float32; each rank "
        f"receives {n_global * 8 / 2**20:.2f} / {n_global * 12 / 2**20:.2f} MiB at world size {a.world_size}"
    )


if __name__ == "__main__":
    main()
