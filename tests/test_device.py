"""The device rehearsal (tests/device_rehearsal.py): every method file's training step with its tensors' devices
followed as on a GPU, over every flag that changes the step's code path, its host-to-accelerator copies per update
bounded; and the rehearsal's rules, each shown to raise on the bug it is for (the two crashes found by reading: GSPO's
lengths before e2a7afc, CE-GPPO's SFT term; a 0-dim host tensor outside an elementwise op, accelerator indices into a
host tensor, a mix inside a GPU branch, the token weights copied in every micro-batch)."""

import os
import re

import pytest
import torch
from device_rehearsal import ACCELERATOR, DeviceMixError, Rehearsal, on_accelerator
from launch import ROOT, free_port, read_metrics, run_dir, run_python, script_argv, script_flags

from testbed.common import CPU_ENV

REHEARSAL = os.path.join(ROOT, "tests", "device_rehearsal.py")
# the flags that change the step's code path, spread over the runs: every method file, each method's own paths
# (CE-GPPO's SFT term and dual clip, GSPO's two levels, AEnt's box, the entropy bonus's target rule, its cadences and
# signals, the Cov and Lp-Reg scopes, CISPO's cap, W-REINFORCE's bonus), every 80/20 scope, source and norm, the
# reference KL, the rollout correction (vLLM's log-probs), one update and several, two epochs, the three loss
# aggregations, packing and token budgets, dynamic sampling and overlong shaping, evaluation, ZeRO-3 on 2 ranks, a
# rollout rank one step off
STEP = {"num-mini-batches": 2, "micro-batch-size": 4, "total-steps": 1}
TOP20 = {"top-entropy-quantile": 0.2}
RUNS = {
    "vanilla_vllm_kl_top20_current": (
        "grpo_vanilla.py",
        {
            **TOP20,
            "entropy-mask-source": "current",
            "entropy-mask-norm": "kept",
            "kl-coef": 0.01,
            "vllm": True,
            "eval": True,
        },
    ),
    "vanilla_z3_packed_budget_micro": (
        "grpo_vanilla.py",
        {
            "zero-stage": 3,
            "padding-free": True,
            **TOP20,
            "max-tokens-per-micro-batch": 200,
            "entropy-mask-scope": "microbatch",
            "filter-groups": True,
            "eval": True,
            "overlong-buffer-len": 8,
            "nproc": 2,
        },
    ),
    "vanilla_one_update": ("grpo_vanilla.py", {"num-mini-batches": 1, "clip-ratio-c": 3.0}),
    # bf16 weights: the float32 head (models.Fp32Head) in the trainer; the deterministic mode's kernels and fills
    "vanilla_bf16_fp32_head_deterministic": (
        "grpo_vanilla.py",
        {"dtype": "bfloat16", "head-dtype": "float32", "full-determinism": True, "vllm": True},
    ),
    "aent_box_kl_top20": ("grpo_aent.py", {**TOP20, "kl-coef": 0.01, "vllm": True}),
    "entreg_target_update_all_clamped": (
        "grpo_entreg.py",
        {
            **TOP20,
            "entropy-mask-scope": "microbatch",
            "coef-rule": "target",
            "coef-cadence": "update",
            "entropy-bonus-tokens": "all",
            "clamp-p": 0.33,
        },
    ),
    "entreg_target_nll_one_update": (
        "grpo_entreg.py",
        {"num-mini-batches": 1, "coef-rule": "target", "coef-signal": "nll"},
    ),
    "klcov_global_2ranks": ("grpo_klcov.py", {"nproc": 2, "kl-cov-ratio": 0.2}),
    "klcov_microbatch": ("grpo_klcov.py", {"cov-scope": "microbatch", "kl-cov-ratio": 0.2, **TOP20}),
    "clipcov_global": ("grpo_clipcov.py", {"clip-cov-ratio": 0.2}),
    "clipcov_microbatch_2ranks": ("grpo_clipcov.py", {"cov-scope": "microbatch", "clip-cov-ratio": 0.2, "nproc": 2}),
    "entadv": ("grpo_entadv.py", {**TOP20}),
    "cispo_cap_2_epochs": ("grpo_cispo.py", {"cispo-max-weight": 1.5, "vllm": True, "num-epochs": 2}),
    "cegppo_sft_dual_clip": ("grpo_cegppo.py", {"cegppo-sft-coef": 0.1, "clip-ratio-c": 3.0, **TOP20}),
    "lpreg_global": ("grpo_lpreg.py", {"kl-coef": 0.01, "vllm": True}),
    "lpreg_microbatch_2ranks": ("grpo_lpreg.py", {"lpreg-scope": "microbatch", "nproc": 2}),
    "sapo_seq_mean": ("grpo_sapo.py", {**TOP20, "loss-agg": "seq-mean-token-mean"}),
    "gspo_token": ("grpo_gspo.py", {"gspo-level": "token"}),
    "gspo_sequence_one_update": ("grpo_gspo.py", {"gspo-level": "sequence", "num-mini-batches": 1}),
    "wreinforce_entropy_sum_norm": (
        "grpo_wreinforce.py",
        {"wr-entropy-coef": 0.001, "loss-agg": "seq-mean-token-sum-norm"},
    ),
    "passk": ("grpo_passk.py", {"passk-k": 2}),
    "vanilla_geo_mask_kl_is_masked": (
        "grpo_vanilla.py",
        {"rollout-correction": "geo-mask", "vllm-is-min": 0.5, "kl-coef": 0.01, "kl-estimator": "k3-is"}
        | {"mask-truncated": True, "max-response-length": 28},
    ),
    "vanilla_rollout_rank_stale": (
        "grpo_vanilla.py",
        {"rollout-ranks": 1, "max-staleness": 1, "vllm": True, "nproc": 2, "total-steps": 2},
    ),
}


def rehearse(testbed, tmp_path, script, overrides, check=True):
    """Run `script` under the rehearsal; return the finished process."""
    overrides = {**STEP, **overrides}
    nproc, vllm, evaluation = overrides.pop("nproc", 0), overrides.pop("vllm", False), overrides.pop("eval", False)
    if evaluation:
        overrides |= {"eval-dataset": testbed.test_file, "eval-every": 1, "eval-num-prompts": 4, "eval-samples": 2}
    flags = script_flags(testbed, **overrides, **({} if vllm else {"no-use-vllm": True}))
    argv, env = script_argv(script, flags, tmp_path)
    proc = run_python([REHEARSAL, *argv], env, nproc, timeout=600)
    if check and proc.returncode != 0:
        pytest.fail(f"{script} under the device rehearsal exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def accelerator_calls(proc) -> list:
    """Each rank's count of the calls the rehearsal met with an accelerator tensor among their arguments."""
    return [int(n) for n in re.findall(r"device rehearsal: \d+ calls checked, (\d+) with accelerator", proc.stderr)]


def copies_per_update(proc) -> list:
    """Each trainer rank's (most host-to-accelerator copies in one update of its loop, most micro-batches in one)."""
    found = re.findall(r"at most (\d+) in one of its [1-9]\d* updates \(of at most (\d+) micro-batches\)", proc.stderr)
    return [(int(copies), int(micro_batches)) for copies, micro_batches in found]


COPIES_PER_UPDATE = 2  # the mini-batch's token weights, and a global selection's sample order (in_sample_order)
PER_MICRO_BATCH = {  # the copies left in a micro-batch (each a stream synchronisation on a GPU), bounded here
    "grpo_gspo.py": 2,  # sequence_log_ratios and gspo_sums move the collated CPU lengths
    "grpo_cegppo.py": 2,  # correct_tokens: the grades and the lengths (with --cegppo-sft-coef)
    "grpo_clipcov.py": 1,  # clip_cov_select's draw, made by a CPU generator for reproducibility
}


def test_every_method_file_is_rehearsed():
    scripts = {f for f in os.listdir(ROOT) if f.startswith("grpo_") and f.endswith(".py")}
    assert scripts == {script for script, _ in RUNS.values()}, "a method file without a device rehearsal run"


@pytest.mark.launches
@pytest.mark.parametrize("name", list(RUNS))
def test_the_step_keeps_every_tensor_on_its_device(testbed, tmp_path, name):
    script, overrides = RUNS[name]
    proc = rehearse(testbed, tmp_path, script, overrides)
    assert len(read_metrics(run_dir(tmp_path))) >= STEP["total-steps"]
    counts = accelerator_calls(proc)
    assert counts and max(counts) > 1000, f"the run met no accelerator tensor: {counts}"
    per_update = copies_per_update(proc)
    assert per_update, "no optimizer update counted"
    for copies, micro_batches in per_update:
        assert copies <= COPIES_PER_UPDATE + PER_MICRO_BATCH.get(script, 0) * micro_batches, proc.stderr[-2000:]


@pytest.mark.launches
def test_the_gpu_benchmark_keeps_every_tensor_on_its_device(tmp_path):
    """benchmarks/experiments/bench_gpu.py (gpu_smoke's `bench`, on the first GPU lease) starts through init_distributed
    too."""
    argv = [REHEARSAL, os.path.join(ROOT, "benchmarks", "experiments", "bench_gpu.py"), "--tiny"]
    env = {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port()), "WANDB_DIR": str(tmp_path)}
    proc = run_python(argv, env, 0, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = accelerator_calls(proc)
    assert counts and counts[0] > 1000, counts


# ---- the two known crashes, put back into today's files: the rehearsal stops each at its line ----
REVERTED = {  # each fix undone: (the fixed text, the text before the fix)
    "grpo_gspo.py": [("    lengths = lengths.to(logp.device)\n", "")],  # e2a7afc
    "grpo_cegppo.py": [  # 914cf49
        ("for k in samples], device=device)", "for k in samples], device=lengths.device)"),
        ("correct.repeat_interleave(lengths.to(device))", "correct.repeat_interleave(lengths)"),
    ],
}


@pytest.mark.launches
@pytest.mark.parametrize(
    "script, overrides, crash",
    [
        ("grpo_gspo.py", {"gspo-level": "token"}, r"grpo_gspo_reverted.py:\d+: repeat_interleave\(\) mixes devices"),
        ("grpo_cegppo.py", {"cegppo-sft-coef": 0.1}, r"grpo_cegppo_reverted.py:\d+: mul\(\) mixes devices"),
    ],
)
def test_the_known_crashes_stop_the_rehearsal(testbed, tmp_path, script, overrides, crash):
    text = open(os.path.join(ROOT, script)).read()
    for fixed, before in REVERTED[script]:
        assert text.count(fixed) == 1, f"{script} no longer has {fixed!r}: update REVERTED"
        text = text.replace(fixed, before)
    reverted = tmp_path / script.replace(".py", "_reverted.py")  # imports utils/ from the runner's path
    reverted.write_text(text)
    proc = rehearse(testbed, tmp_path, str(reverted), overrides, check=False)
    assert proc.returncode != 0 and re.search(r"DeviceMixError: \S*" + crash, proc.stderr), proc.stderr[-3000:]


# ---- the rules, each on the bug it is for ----
def lengths_and_logp():
    """A collated batch's lengths (kept on the CPU by utils.batching.collate) and log-probs on the accelerator."""
    lengths = torch.tensor([3, 2])
    logp = torch.zeros(5, device=ACCELERATOR)
    return lengths, logp


def test_cegppo_sft_term_before_the_fix_raises():
    """grpo_cegppo.correct_tokens as it was: its tensor made on lengths.device, the CPU, then times the log-probs."""
    with Rehearsal():
        lengths, logp = lengths_and_logp()
        correct = torch.tensor([1.0, 0.0], device=lengths.device).repeat_interleave(lengths)
        with pytest.raises(DeviceMixError, match="mul.. mixes devices"):
            correct * logp
        fixed = torch.tensor([1.0, 0.0], device=logp.device).repeat_interleave(lengths.to(logp.device))
        assert (fixed * logp).device == ACCELERATOR


def test_gspo_lengths_before_e2a7afc_raise():
    """grpo_gspo before e2a7afc: per-sequence values on the accelerator repeated by the CPU lengths."""
    with Rehearsal():
        lengths, logp = lengths_and_logp()
        per_sequence = torch.stack([logp[:3].mean(), logp[3:].mean()])
        with pytest.raises(DeviceMixError, match="repeat_interleave"):
            per_sequence.repeat_interleave(lengths)
        with pytest.raises(DeviceMixError, match="div"):
            logp[:2] / lengths


def test_what_cuda_allows_does_not_raise():
    """A 0-dim CPU tensor is a scalar to CUDA; x[index] takes CPU indices; copy_ and the moves cross devices;
    .to(device) is a copy on a GPU, so the CPU original stays on the CPU."""
    with Rehearsal():
        lengths, logp = lengths_and_logp()
        logp * torch.tensor(2.0)
        logp[torch.tensor([0, 2])], logp[torch.tensor([True, False, True, False, True])]
        logp.copy_(torch.ones(5))
        moved = lengths.to(logp.device)
        assert moved.device == ACCELERATOR and lengths.device == torch.device("cpu")
        with pytest.raises(DeviceMixError):
            lengths * moved
        assert (moved.cpu() * lengths).sum().item() == 13


def test_models_and_factories_follow_the_accelerator():
    """Parameters on the accelerator; a tensor made on another's device follows it (transformers' masks); .numpy() of
    an accelerator tensor raises, as on a GPU."""
    model = torch.nn.Linear(3, 2)
    on_accelerator(model)
    with Rehearsal():
        x = torch.ones(4, 3, device=ACCELERATOR)
        y = model(x)
        mask = torch.arange(4, device=y.device)
        assert y.device == ACCELERATOR and mask.device == ACCELERATOR
        with pytest.raises(DeviceMixError, match="linear"):
            model(torch.ones(4, 3))
        with pytest.raises(DeviceMixError, match="numpy"):
            y.detach().numpy()
        assert y.detach().cpu().numpy().shape == (4, 2)


# ---- the rules of issue 70 (part 4), each on the bug it is for ----
def test_a_0dim_host_tensor_is_a_scalar_to_elementwise_ops_only():
    """CUDA reads a 0-dim CPU tensor as a scalar in its elementwise (TensorIterator) kernels only: a host zero stacked
    with an accelerator statistic raises at the stack, as do cat, index_select, where's condition and an out=."""
    with Rehearsal():
        _, logp = lengths_and_logp()
        zero = torch.tensor(0.0)  # made without device=: on the host
        logp * zero, zero - logp, torch.where(logp > 0, zero, logp), logp.clamp(max=zero), logp.lerp(logp, zero)
        with pytest.raises(DeviceMixError, match=r"stack\(\) mixes devices: a host tensor \(\) float32 .* elementwise"):
            torch.stack([logp.sum(), zero])  # the bug: a metric's host default beside an accelerator sum
        assert torch.stack([logp.sum(), logp.new_zeros(())]).device == ACCELERATOR  # the fix: made on its device
        for bug in (
            lambda: torch.cat([logp, zero[None]]),
            lambda: logp.index_select(0, torch.tensor(1)),
            lambda: torch.where(torch.tensor(True), logp, logp),
            lambda: torch.mul(logp.sum(), 2.0, out=torch.tensor(0.0)),
        ):
            with pytest.raises(DeviceMixError, match="mixes devices"):
                bug()


def test_accelerator_indices_into_a_host_tensor_raise():
    """A selection made on the accelerator indexing a collated batch's CPU lengths: CUDA stops at the indexing line
    ('indices should be either on cpu or on the same device as the indexed tensor'), reading or writing; CPU indices
    into an accelerator tensor, and a 0-dim one read as a number, pass."""
    with Rehearsal():
        lengths, logp = lengths_and_logp()
        kept = (logp[:2] >= 0).nonzero().squeeze(-1)  # on the accelerator
        with pytest.raises(DeviceMixError, match=r"__getitem__\(\) indexes a host tensor \(2,\) int64 with an accel"):
            lengths[kept]
        with pytest.raises(DeviceMixError, match="__setitem__"):
            lengths[kept] = 0
        with pytest.raises(DeviceMixError, match="index_put_"):
            lengths.index_put_((kept,), torch.tensor(0))
        assert lengths.to(logp.device)[kept].device == ACCELERATOR and lengths[kept.cpu()].device.type == "cpu"
        assert logp[lengths - 1].device == ACCELERATOR and lengths[kept[0]].shape == ()


def test_gpu_branches_run_and_a_mix_inside_one_raises(monkeypatch):
    """The accelerator answers is_cuda / is_cpu as a GPU to our code: ops.kth_smallest takes kthvalue, not its CPU
    path (torch.lt made to fail), AEnt's clamped_entropy picks the GPU's block; a host tensor inside a GPU branch, which
    never ran on a CPU before, raises."""
    import grpo_aent
    from utils import ops

    def cpu_path(*a, **k):
        raise AssertionError("kth_smallest took its CPU path")

    def gpu_only(x):  # the bug: a host tensor in a branch that runs on GPUs only
        return x * torch.ones(x.shape) if x.is_cuda else x

    z = torch.randn(3, 4096)
    monkeypatch.setattr(torch, "lt", cpu_path)
    with pytest.raises(AssertionError, match="CPU path"):
        ops.kth_smallest(z, 2048)
    monkeypatch.setattr(grpo_aent.ClampedEntropy, "apply", lambda logits, k, rows: rows)  # the rows of a block
    assert grpo_aent.clamped_entropy(torch.zeros(2048, 1024), 0.2) == 1024  # a CPU's 1M-element blocks
    with Rehearsal():
        on_gpu = z.to(ACCELERATOR)
        assert on_gpu.is_cuda and not on_gpu.is_cpu
        assert torch.equal(ops.kth_smallest(on_gpu, 2048).cpu(), z.kthvalue(2048, dim=-1, keepdim=True).values)
        assert grpo_aent.clamped_entropy(torch.zeros(2048, 1024, device=ACCELERATOR), 0.2) == 2048  # one 16M block
        with pytest.raises(DeviceMixError, match="mul"):
            gpu_only(on_gpu)
        assert torch.equal(gpu_only(z), z)  # on the host the branch is not taken: the CPU never saw the bug


@pytest.mark.launches
def test_a_copy_in_every_micro_batch_breaks_the_bound(testbed, tmp_path):
    """The token weights copied onto the device in every micro-batch, as before they were made once per mini-batch:
    8 micro-batches per update, a copy in each, above the bound of an update."""
    loop, pad = "for i, weights in zip(mini, mini_weights.split(sizes)):\n", " " * 20
    fixed = f"{loop}{pad}batch = batches[i]\n"
    weights = 'token_weights(batch["lengths"], counted[batch["index"]], *aggregation).to(device)'
    before = f"for i in mini:\n{pad}batch = batches[i]\n{pad}weights = {weights}\n"
    text = open(os.path.join(ROOT, "grpo_vanilla.py")).read()
    assert text.count(fixed) == 1, "grpo_vanilla.py no longer has the mini-batch's weights: update this test"
    script = tmp_path / "grpo_vanilla_per_micro_batch.py"
    script.write_text(text.replace(fixed, before))
    proc = rehearse(testbed, tmp_path, str(script), {"micro-batch-size": 1})
    [(copies, micro_batches)] = copies_per_update(proc)
    assert micro_batches == 8 and copies > COPIES_PER_UPDATE + PER_MICRO_BATCH.get("grpo_vanilla.py", 0) * 8, copies
