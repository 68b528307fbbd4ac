"""The device rehearsal (tests/device_rehearsal.py): every method file's training step with its tensors' devices
followed as on a GPU, over every flag that changes the step's code path; and the rehearsal's rules, each shown to
raise on the bug it is for (the two crashes found by reading: GSPO's lengths before e2a7afc, CE-GPPO's SFT term)."""

import os
import re

import pytest
import torch
from device_rehearsal import ACCELERATOR, DeviceMixError, Rehearsal, on_accelerator
from launch import ROOT, free_port, read_metrics, run_dir, run_python, script_argv, script_flags

from testbed.common import CPU_ENV

REHEARSAL = os.path.join(ROOT, "tests", "device_rehearsal.py")
# the flags that change the step's code path, spread over the runs: every method file, each method's own paths
# (CE-GPPO's SFT term and dual clip, GSPO's two levels, AEnt's rules and cadences, the Cov and Lp-Reg scopes, CISPO's
# cap, W-REINFORCE's bonus), every 80/20 scope, source and norm, the reference KL, the rollout correction (vLLM's
# log-probs), one update and several, two epochs, the three loss aggregations, packing and token budgets, dynamic
# sampling and overlong shaping, evaluation, ZeRO-3 on 2 ranks, a rollout rank one step off
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
    "aent_box_kl_top20": ("grpo_aent.py", {**TOP20, "kl-coef": 0.01, "vllm": True}),
    "aent_target_update_all": (
        "grpo_aent.py",
        {
            **TOP20,
            "entropy-mask-scope": "microbatch",
            "coef-rule": "target",
            "coef-cadence": "update",
            "entropy-bonus-tokens": "all",
        },
    ),
    "aent_target_nll_one_update": (
        "grpo_aent.py",
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
