"""The no-grad log-prob pass (utils.logprobs.response_logprobs, as the scripts' log-prob pass, reference policy and
evaluation entropies call it) with the forward asked for the last decoder layer's hidden states only (the code) against
the same pass asked for every layer's (output_hidden_states=True, the code before this benchmark was written), on a
Qwen2 model built locally with random weights (no download).

    python -m benchmarks.experiments.bench_hidden_states_memory         # CPU: ~215M parameters, 2k-8k tokens
    python -m benchmarks.experiments.bench_hidden_states_memory --layers 2 --hidden 256 --tokens 512  # seconds

Memory: every case runs alone in a fresh subprocess, which builds the model, resets its peak resident size (Linux
/proc/self/clear_refs) just before the pass and reads VmHWM after it: the extra peak is what the pass allocates on top
of the model and its inputs. Every case also prints a checksum of its log-probs and entropies; the two variants must
print the same (the table says whether they do). Expected difference: (layers + 1) x tokens x hidden x 4 bytes (fp32),
the states kept alive to the end of the forward.
"""

import argparse
import json
import time

import torch

from benchmarks.experiments.perf_common import case_in_child, extra_peak_bytes
from utils import batching
from utils.logprobs import response_logprobs


def build_model(a):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64,
        num_key_value_heads=max(1, a.hidden // 256),
        max_position_embeddings=a.seq_len,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def ask_every_layer(model) -> None:
    """The forward asked for every layer's hidden states, whatever the caller passes (the code before)."""
    forward = model.forward

    def every_layer(*args, **kwargs):
        return forward(*args, **{**kwargs, "output_hidden_states": True})

    model.forward = every_layer


def measure(a, variant: str, tokens: int) -> dict:
    model = build_model(a)
    if variant == "every layer":
        ask_every_layer(model)
    g = torch.Generator().manual_seed(1)
    n = tokens // a.seq_len  # sequences of seq_len tokens, the last quarter of each its response
    prompts = [torch.randint(0, a.vocab, (a.seq_len * 3 // 4,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(0, a.vocab, (a.seq_len // 4,), generator=g).tolist() for _ in range(n)]
    batch = batching.collate(prompts, responses, 0, "cpu")
    start = time.perf_counter()
    with torch.no_grad():
        (logp, entropy, _), extra = extra_peak_bytes(lambda: response_logprobs(model, batch, 1.0, a.chunk_size, True))
    seconds = time.perf_counter() - start
    checksum = f"{logp.double().sum().item():.17g}/{entropy.double().sum().item():.17g}"
    return {"extra_bytes": extra, "seconds": seconds, "checksum": checksum}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="tokens of the micro-batch")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (prompt 3/4, response 1/4)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-size", type=int, default=1024, help="grpo_*.py --logprob-chunk-size")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.case:
        return print(json.dumps(measure(a, a.case[0], int(a.case[1]))))

    params = sum(x.numel() for x in build_model(a).parameters()) / 1e6
    print(
        f"no-grad log-prob pass (response_logprobs, entropies on), Qwen2 {params:.0f}M parameters (hidden {a.hidden}, "
        f"{a.layers} layers, vocabulary {a.vocab}, random weights, fp32, sdpa), sequences of {a.seq_len} tokens, "
        f"chunk {a.chunk_size}, {a.threads} thread(s), torch {torch.__version__}"
    )
    print(
        "| tokens | last layer only: extra peak (MB) | every layer: extra peak (MB) | saved (MB) | "
        "(layers + 1) x tokens x hidden x 4 (MB) | time last / every (s) | identical |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in a.tokens:
        rows = {variant: case_in_child("--case", variant, str(n)) for variant in ("last layer", "every layer")}
        last, every = rows["last layer"], rows["every layer"]
        mb = 2**20
        expected = (a.layers + 1) * n * a.hidden * 4 / mb
        print(
            f"| {n} | {last['extra_bytes'] / mb:.0f} | {every['extra_bytes'] / mb:.0f} | "
            f"{(every['extra_bytes'] - last['extra_bytes']) / mb:.0f} | {expected:.0f} | "
            f"{last['seconds']:.1f} / {every['seconds']:.1f} | "
            f"{'yes' if last['checksum'] == every['checksum'] else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
