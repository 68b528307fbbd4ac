"""Run by tests/test_zero3_bf16.py under torchrun on CPU: the policy in bf16 (a GPU run's dtype, --dtype bfloat16 on
the CPU) built by utils.models.make_policy in the real DeepSpeed engine; `bf16_probe.py CHECKS MODEL_DIR` runs the
comma-separated checks in turn, each printing `<check> OK` or `<check> FAIL <assertion>` on rank 0.

`buffers`: ZeRO-3 loading (zero.Init) leaves every buffer of the policy and of the reference with the dtype and value
of a plain bf16 load (the rotary inv_freq fp32, not bf16). `logprobs`: so the ZeRO-3 policy scores a 4096-token
sequence as the plain bf16 model does (the rotary phase at far positions). `grads2` / `grads3`: under ZeRO-2 / ZeRO-3,
the gradient that two ranks reduce, two micro-batches each through the chunked log-prob kernel (the output head, tied
to the embedding, called once per chunk), equals the gradient of the same loss over the four micro-batches in one
process (DeepSpeed #8224's class: since #7665, checked in 0.19.3 and 0.19.6.dev, the engine divided by the
accumulation steps only the gradients that flow back through its forward's outputs (0.19.6.dev runtime/engine.py
l. 2839, 3001), not those of the head, called on them outside; 0.19.8 divides the loss in engine.backward and leaves
the outputs' gradients alone: l. 3413, 3423, 3182).

`grads2` runs before any ZeRO-3 check: after a ZeRO-3 load every from_pretrained of the process is a ZeRO-3 one."""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import deepspeed  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from grpo_vanilla import Args  # noqa: E402
from utils import distributed, models  # noqa: E402
from utils.batching import collate  # noqa: E402
from utils.engine import make_args  # noqa: E402
from utils.logprobs import response_logprobs  # noqa: E402

LONG = 4096
"""tokens of the `logprobs` check's sequence (the testbed model's rotary embedding has no position limit)"""


def bf16_args(model_dir: str, stage: int, **overrides):
    """The scripts' Args with bf16 weights on the CPU (the field the scripts' --dtype sets)."""
    return make_args(
        Args, model_name_or_path=model_dir, zero_stage=stage, micro_batch_size=2, dtype="bfloat16", **overrides
    )


def buffer_mismatches(model, plain: dict) -> list:
    """(name, dtype, plain dtype, max relative difference) of each buffer that differs from the plain load's."""
    buffers = dict(model.named_buffers())
    assert buffers.keys() == plain.keys(), (sorted(buffers), sorted(plain))
    out = []
    for name, buffer in buffers.items():
        ref = plain[name]
        if buffer.dtype != ref.dtype or not torch.equal(buffer, ref):
            err = ((buffer.double() - ref.double()).abs() / ref.double().abs().clamp_min(1e-30)).max().item()
            out.append((name, buffer.dtype, ref.dtype, err))
    return out


def zero3_policies(state: dict, model_dir: str) -> tuple:
    """The ZeRO-3 bf16 policy and its reference (kl_coef > 0 loads it), made once per process."""
    if "zero3" not in state:
        state["zero3"] = models.make_policy(bf16_args(model_dir, 3, kl_coef=0.1), False, 1, 1)
    policy, _, ref_policy = state["zero3"]
    return policy, ref_policy


def check_buffers(state: dict, model_dir: str, rank: int, world_size: int) -> None:
    policy, ref_policy = zero3_policies(state, model_dir)
    plain = dict(state["plain_bf16"].named_buffers())
    assert plain and all(b.dtype == torch.float32 for b in plain.values()), plain  # the premise: fp32 in a plain load
    found = {role: buffer_mismatches(e.module, plain) for role, e in (("policy", policy), ("reference", ref_policy))}
    if rank == 0:
        print(f"buffers: {len(plain)} compared ({', '.join(plain)}); differing: {found}", flush=True)
    assert not any(found.values()), found


def check_logprobs(state: dict, model_dir: str, rank: int, world_size: int) -> None:
    """Teacher-forced log-probs of one LONG-token sequence (the same on both ranks: ZeRO-3 gathers on every call)."""
    policy = zero3_policies(state, model_dir)[0]
    generator = torch.Generator().manual_seed(0)
    vocab = policy.module.config.vocab_size
    ids = torch.randint(3, vocab, (LONG,), generator=generator).tolist()
    batch = collate([ids[:16]], [ids[16:]], 0, torch.device("cpu"))
    with torch.no_grad():
        zero3, plain, exact = (
            response_logprobs(model, batch, 1.0, 1024, False, num_chunks=4)[0].double()
            for model in (policy, state["plain_bf16"], state["plain_fp32"])
        )
    diff = (zero3 - plain).abs()
    if rank == 0:  # the scale: how far bf16 itself takes the plain model from fp32 (the same weights)
        spans = ((16, 512), (512, 2048), (2048, LONG))
        parts = {f"{a}-{b}": f"{diff[a - 16 : b - 16].max().item():.3g}" for a, b in spans}
        noise = (plain - exact).abs()
        print(
            f"logprobs: max |zero3 - plain| bf16 by position {parts}, mean {diff.mean().item():.3g}; "
            f"|plain bf16 - fp32| max {noise.max().item():.3g}, mean {noise.mean().item():.3g}",
            flush=True,
        )
    assert torch.equal(zero3, plain), diff.max().item()


def micro_batches(vocab: int, n: int) -> list:
    """n micro-batches of 2 sequences (prompts of 4-11 tokens, responses of 9-39), advantages of either sign."""
    generator = torch.Generator().manual_seed(1)

    def ids(k):
        return torch.randint(3, vocab, (k,), generator=generator).tolist()

    out = []
    for _ in range(n):
        prompts = [ids(int(torch.randint(4, 12, (), generator=generator))) for _ in range(2)]
        responses = [ids(int(torch.randint(9, 40, (), generator=generator))) for _ in range(2)]
        advantages = torch.randn(2, generator=generator)
        out.append(collate(prompts, responses, 0, torch.device("cpu"), advantages=advantages))
    return out


CHUNK, CHUNKS = 8, 6
"""the output head's chunks: CHUNK rows each under ZeRO-2 (2-10 calls a micro-batch here), CHUNKS calls under ZeRO-3
(every rank calls it equally often, as the scripts' head_calls arranges)"""


def loss_of(model, batch, stage: int) -> torch.Tensor:
    """A policy-gradient loss with an entropy term through the scripts' log-prob kernel."""
    num_chunks = CHUNKS if stage == 3 else None
    logp, entropy, _ = response_logprobs(model, batch, 0.9, CHUNK, True, num_chunks=num_chunks)
    return -(logp.float() * batch["advantages"]).mean() - 0.01 * entropy.float().mean()


def one_process_grads(model, batches: list, stage: int) -> dict:
    """The gradient of the mean of the micro-batches' losses, each micro-batch's summed in float64."""
    total = {}
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss_of(model, batch, stage).backward()
        for name, p in model.named_parameters():
            total[name] = total.get(name, 0) + p.grad.double() / len(batches)
    return total


def check_grads(state: dict, model_dir: str, rank: int, world_size: int, stage: int) -> None:
    args = bf16_args(model_dir, stage, logprob_chunk_size=CHUNK)
    start = time.perf_counter()
    policy = models.make_policy(args, False, 2, 1)[0]  # 2 micro-batches an update
    assert policy.bfloat16_enabled() and policy.zero_optimization_stage() == stage
    batches = micro_batches(policy.module.config.vocab_size, 2 * world_size)
    first, second = batches[2 * rank : 2 * rank + 2]
    policy.backward(loss_of(policy, first, stage))
    policy.step()  # not the boundary: the engine counts the micro-batch, the optimizer does not step
    policy.backward(loss_of(policy, second, stage))
    assert policy.is_gradient_accumulation_boundary()
    reduced = {}
    for name, p in policy.module.named_parameters():  # the fp32 gradient partition, gathered (before the step)
        reduced[name] = deepspeed.utils.safe_get_full_grad(p).double()
    train_s = time.perf_counter() - start
    # the same loss over all four micro-batches in one process: in fp32 from the bf16 weights (the exact gradient up to
    # fp32 rounding), and in bf16 (the rounding a single-process bf16 backward makes: the scale of the tolerance)
    exact = one_process_grads(state["plain_fp32"], batches, stage)
    single_bf16 = one_process_grads(state["plain_bf16"], batches, stage)
    errors = {}
    for name, g in exact.items():
        norm = g.norm().item()
        errors[name] = ((reduced[name] - g).norm().item() / norm, (single_bf16[name] - g).norm().item() / norm)
    worst = max(errors, key=lambda name: errors[name][0])
    if rank == 0:
        ds_err, bf16_err = errors[worst]
        print(
            f"grads zero-{stage}: {len(errors)} tensors; largest relative L2 error of the reduced gradient "
            f"{ds_err:.3g} ({worst}; a one-process bf16 backward: {bf16_err:.3g}; worst of those "
            f"{max(e[1] for e in errors.values()):.3g}); engine build + 2 backwards {train_s:.1f} s",
            flush=True,
        )
    # bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3 an operation): a one-process bf16 backward lands 0.9%
    # from the exact gradient on the embedding, 2.2% on a key bias (whose exact gradient is near 0: softmax ignores a
    # shift of every score), printed above. The reduced gradient is the same bf16 backward on each rank, summed in
    # fp32: as far, not farther. A lost or doubled share (DeepSpeed 0.19.3-0.19.6: the head's part of the tied
    # embedding's gradient not divided by the 2 accumulation steps) errs by 30-100% (0.54 there).
    bad = {name: e for name, e in errors.items() if e[0] > max(3 * e[1], 0.02)}
    assert not bad, bad


CHECKS = {
    "buffers": check_buffers,
    "logprobs": check_logprobs,
    "grads2": lambda *a: check_grads(*a, stage=2),
    "grads3": lambda *a: check_grads(*a, stage=3),
}


def main(checks: str, model_dir: str) -> None:
    rank, _, world_size, _, _ = distributed.init_distributed()
    torch.manual_seed(0)
    # the plain loads first: after a ZeRO-3 load every from_pretrained of the process goes through zero.Init
    state = {
        "plain_bf16": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    }
    models.fp32_head(state["plain_bf16"])  # the scripts' head (--head-dtype float32): float32 logits from bf16 weights
    exact = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    for exact_p, p in zip(exact.parameters(), state["plain_bf16"].parameters()):
        exact_p.data.copy_(p.data)  # the weights the bf16 engine holds, in fp32
    state["plain_fp32"] = exact
    for check in checks.split(","):
        start, outcome = time.perf_counter(), "OK"
        try:  # each check's collectives come before its asserts, which fail alike on both ranks: the next one can run
            CHECKS[check](state, model_dir, rank, world_size)
        except AssertionError as error:
            outcome = f"FAIL {str(error)[:1500]}"
        dist.barrier()
        if rank == 0:
            print(f"{check}: {time.perf_counter() - start:.1f} s\n{check} {outcome}", flush=True)
    dist.destroy_process_group()  # before exit: gloo's threads torn down at interpreter exit once aborted a rank


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
