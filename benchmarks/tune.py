"""An equal-budget tuner: every method the same number of trials of the same length, on optuna (CleanRL's tuner, made
multi-objective). Each trial runs a method script as a user would and reads its metrics.jsonl.

The search spaces, the objectives and the testbed settings are fixed here, before any study runs. Objectives, both
maximised, at the run's last evaluation: the majority kind's mean@16 and the minority kind's pass@16 of the fork
testbed (testbed/fork/: eval/majority/mean_acc, eval/minority/pass@16): optuna's Pareto front per method. Each method
searches its own knobs and, alike for all, the learning rate and the updates per step (--num-mini-batches).

The study lives in one journal file (optuna's JournalStorage): a killed tuner resumes where it stopped, on this machine
or another day; a trial that was running when it was killed is marked failed and its point tried again.

On GPUs the --parallel trials at a time never share one: worker slot k runs its trials on the visible GPUs
[k x n, (k + 1) x n), n a trial's processes (--num-gpus, or 1 with the torch launcher), through CUDA_VISIBLE_DEVICES
(within the tuner's own where it is set); more than the visible GPUs is refused before the study starts.

    python -m benchmarks.tune --method grpo_aent --trials 24 --steps 60 --journal benchmarks/results/tune/study.log
    python -m benchmarks.tune --method grpo_vanilla --trials 24 --steps 60 --journal ...   # the same budget
    # on GPUs: each trial through DeepSpeed's launcher, your own model and data after --
    python -m benchmarks.tune --method grpo_aent --launcher deepspeed --num-gpus 8 --parallel 1 --dry-run -- \\
        --model-name-or-path Qwen/Qwen2.5-Math-1.5B --dataset <train file> --eval-dataset <test file>
"""

import argparse
import json
import os
import queue
import subprocess
import sys
import threading

# the search spaces, fixed before the runs: flag -> ("log", low, high) | ("float", low, high) | ("int", low, high)
# | ("choice", [values]); the flags each method's own, at ranges around its published value scaled to the testbed
# (benchmarks/reproduce/testbed.sh says how), wide enough to hold both
SHARED = {"learning-rate": ("log", 5e-5, 1e-3), "num-mini-batches": ("choice", [1, 2, 4])}
SPACES = {
    "grpo_vanilla": {"kl-coef": ("choice", [0.0, 0.001, 0.01, 0.1, 1.0])},  # GRPO's KL to the initial policy
    "grpo_vanilla_top": {"top-entropy-quantile": ("float", 0.05, 1.0)},  # the 80/20 rule's share
    "grpo_aent": {
        "entropy-coef": ("log", 1e-3, 0.5),
        "clamp-p": ("float", 0.0, 0.6),
        "entropy-low": ("float", 0.01, 0.07),
        "entropy-high": ("float", 0.01, 0.07),  # ordered after sampling: the box is [min, max] of the two
        "entropy-coef-lr": ("log", 0.01, 2.0),
        "entropy-coef-warmup": ("int", 0, 20),
    },
    # the plain bonus (full entropy), constant or annealed to 0 over the run (--entropy-coef-end 0, the default)
    "grpo_entreg": {"entropy-coef": ("log", 1e-3, 0.5), "coef-rule": ("choice", ["constant", "linear", "cosine"])},
    "grpo_klcov": {"kl-cov-ratio": ("log", 1e-3, 0.5), "ppo-kl-coef": ("log", 0.1, 10.0)},
    "grpo_clipcov": {
        "clip-cov-ratio": ("log", 1e-3, 0.2),
        "clip-cov-lb": ("float", 0.0, 2.0),
        "clip-cov-ub": ("float", 2.0, 10.0),
    },
    "grpo_entadv": {"entadv-alpha": ("log", 0.01, 2.0), "entadv-kappa": ("float", 1.1, 5.0)},
    "grpo_cispo": {"clip-eps-low": ("choice", [0.2, 1.0, 10.0]), "clip-eps-high": ("log", 0.05, 4.0)},
    "grpo_cegppo": {"cegppo-beta1": ("float", 0.0, 1.0), "cegppo-beta2": ("float", 0.0, 1.0)},
    "grpo_lpreg": {
        "lpreg-kappa": ("log", 0.005, 0.2),
        "lpreg-rho": ("log", 0.005, 0.3),
        "lpreg-beta": ("log", 0.1, 10.0),
    },
    "grpo_sapo": {"sapo-tau-pos": ("log", 0.1, 10.0), "sapo-tau-neg": ("log", 0.1, 10.0)},
    "grpo_gspo": {"clip-eps-low": ("log", 1e-4, 0.2), "clip-eps-high": ("log", 1e-4, 0.2)},
    "grpo_wreinforce": {"wr-lambda": ("float", 0.0, 1.0)},
    "grpo_passk": {"passk-k": ("int", 1, 8)},
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORK = os.path.join(ROOT, "testbed", "fork")
# the fork testbed with `make testbed TESTBED=fork`'s GRPO settings, evaluated at the run's end (and every 25 steps)
TESTBED = [
    "--model-name-or-path", f"{FORK}/model", "--dataset", f"{FORK}/train.jsonl",
    "--eval-dataset", f"{FORK}/test.jsonl", "--num-prompts-per-step", "16", "--group-size", "8",
    "--max-prompt-length", "128", "--max-response-length", "32", "--micro-batch-size", "32",
    "--warmup-steps", "5", "--no-gradient-checkpointing", "--eval-every", "25", "--eval-num-prompts", "100",
    "--eval-samples", "16", "--save-every", "0", "--vllm-is-cap", "0",
]  # fmt: skip
OBJECTIVES = ("eval/majority/mean_acc", "eval/minority/pass@16")


def suggest(trial, method: str) -> dict:
    """The trial's flags: the method's own knobs and the shared ones, drawn from the spaces above."""
    flags = {}
    for flag, (kind, *spec) in {**SPACES[method], **SHARED}.items():
        if kind == "choice":
            flags[flag] = trial.suggest_categorical(flag, spec[0])
        elif kind == "int":
            flags[flag] = trial.suggest_int(flag, spec[0], spec[1])
        else:
            flags[flag] = trial.suggest_float(flag, spec[0], spec[1], log=kind == "log")
    if "entropy-low" in flags:  # AEnt's box: the two draws in order
        flags["entropy-low"], flags["entropy-high"] = sorted((flags["entropy-low"], flags["entropy-high"]))
    if method == "grpo_klcov":  # KL-Cov's penalty is zero on an on-policy update: at least 2
        flags["num-mini-batches"] = max(flags["num-mini-batches"], 2)
    return flags


def visible_gpus() -> list:
    """The GPUs the tuner may hand out, as CUDA_VISIBLE_DEVICES entries: its own entries where it is set, else 0 .. the
    device count - 1; none on a CPU host (a stray CUDA_VISIBLE_DEVICES there changes nothing)."""
    import torch

    # CUDA_VISIBLE_DEVICES' valid entries, up to the first invalid one, read without starting CUDA (torch 2.13
    # torch/cuda/__init__.py:1150-1175, _device_count_nvml at :1092)
    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if count == 0 or listed is None:
        return [str(i) for i in range(count)]
    return [entry.strip() for entry in listed.split(",")][:count]


def slot_devices(gpus: list, parallel: int, per_trial: int, per_trial_flag: str) -> list:
    """Worker slot k's CUDA_VISIBLE_DEVICES: gpus[k x per_trial, (k + 1) x per_trial), disjoint, so two trials never put
    their colocated vLLM engines on one GPU (the second fails its memory check); None per slot without GPUs (a CPU host:
    the environment unchanged). ValueError, one line naming the flags, where the slots need more GPUs than `gpus`."""
    if parallel < 1:
        raise ValueError(f"--parallel {parallel}: at least 1 trial at a time")
    if not gpus:
        return [None] * parallel
    if parallel * per_trial > len(gpus):
        raise ValueError(
            f"--parallel {parallel} x {per_trial_flag} needs {parallel * per_trial} GPUs, {len(gpus)} visible "
            f"({','.join(gpus)}): lower --parallel{' or --num-gpus' if per_trial_flag.startswith('--') else ''}"
        )
    return [",".join(gpus[k * per_trial : (k + 1) * per_trial]) for k in range(parallel)]


def command(a, method: str, flags: dict, out: str, port: int, devices: str | None = None) -> list:
    """The trial's command line, as a user launches the script: torch's launcher (CPU) or DeepSpeed's (GPUs). `devices`:
    the trial's CUDA_VISIBLE_DEVICES (trial_env), which DeepSpeed's launcher then takes instead of --num_gpus."""
    script = os.path.join(ROOT, method.removesuffix("_top") + ".py")
    if a.launcher == "deepspeed":
        # with --num_gpus DeepSpeed ignores and deletes CUDA_VISIBLE_DEVICES and runs on GPUs 0 .. n-1 (deepspeed 0.19.8
        # launcher/runner.py:451-460, 400-403); without it, it turns the variable into --include localhost:<ids> (:458)
        gpus = [] if devices else ["--num_gpus", str(a.num_gpus)]
        launch = ["deepspeed", *gpus, "--master_port", str(port), script]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(port)]
        launch.append(script)
    args = [*(TESTBED if a.launcher == "torch" else []), "--total-steps", str(a.steps), "--seed", str(a.seed)]
    args += ["--output-dir", out, "--exp-name", method]
    for flag, value in flags.items():
        args += [f"--{flag}", str(value)]
    return launch + args + a.extra


def trial_env(devices: str | None) -> dict | None:
    """The trial's environment: the tuner's, with the slot's CUDA_VISIBLE_DEVICES; None (inherited) without GPUs."""
    return None if devices is None else {**os.environ, "CUDA_VISIBLE_DEVICES": devices}


def shown(cmd: list, devices: str | None) -> str:
    """The command as a shell line (command.txt, --dry-run), its devices in front."""
    return " ".join(([f"CUDA_VISIBLE_DEVICES={devices}"] if devices else []) + cmd)


def last_evaluation(run_dir: str) -> tuple:
    """The objectives at the run's last evaluation (its metrics.jsonl rows that hold them)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    last = [r for r in rows if all(k in r for k in OBJECTIVES)][-1]
    return tuple(last[k] for k in OBJECTIVES)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", required=True, choices=sorted(SPACES))
    p.add_argument("--trials", type=int, required=True, help="the study's budget: complete trials of this method")
    p.add_argument("--steps", type=int, default=60, help="training steps of every trial")
    p.add_argument("--journal", required=True, help="the study's file (optuna's journal): resumed if it exists")
    p.add_argument("--output-dir", default="runs/tune", help="each trial's run: <output-dir>/<method>/trial_<n>/")
    p.add_argument("--parallel", type=int, default=2, help="trials at a time (one core each on a CPU; GPUs: its own)")
    p.add_argument("--seed", type=int, default=1, help="the runs' seed and the sampler's")
    p.add_argument("--launcher", choices=["torch", "deepspeed"], default="torch")
    p.add_argument("--num-gpus", type=int, default=8, help="--launcher deepspeed: GPUs of each trial")
    p.add_argument("--port", type=int, default=29700, help="trial n's master port: this + n")
    p.add_argument("--dry-run", action="store_true", help="print the first trial's command and stop")
    p.add_argument("extra", nargs="*", help="after --: flags for every trial (GPUs: the model and the data)")
    a = p.parse_args(argv)
    per_trial = a.num_gpus if a.launcher == "deepspeed" else 1
    per_trial_flag = f"--num-gpus {a.num_gpus}" if a.launcher == "deepspeed" else "1 GPU a trial (--launcher torch)"
    try:  # before the study is touched: a refusal writes nothing
        slots = slot_devices(visible_gpus(), a.parallel, per_trial, per_trial_flag)
    except ValueError as e:
        print(f"tune.py: error: {e}", file=sys.stderr)
        return 2

    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    if a.dry_run:
        flags = suggest(optuna.trial.FixedTrial(defaults(a.method)), a.method)
        out = os.path.join(a.output_dir, a.method, "trial_0")
        print(shown(command(a, a.method, flags, out, a.port, slots[0]), slots[0]))
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(a.journal)), exist_ok=True)
    storage = JournalStorage(JournalFileBackend(a.journal))
    sampler = optuna.samplers.TPESampler(seed=a.seed, multivariate=True)
    # a study in the journal is loaded: create_study(load_if_exists=True) would append its creation to the journal
    # again (optuna 5.1's JournalStorage.create_new_study writes the operation before it finds the name taken)
    if a.method in {s.study_name for s in storage.get_all_studies()}:
        study = optuna.load_study(study_name=a.method, storage=storage, sampler=sampler)
    else:
        study = optuna.create_study(
            study_name=a.method, storage=storage, directions=["maximize", "maximize"], sampler=sampler
        )
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):  # killed with the last tuner: again
        study.tell(t.number, state=TrialState.FAIL)
        study.enqueue_trial(t.params)
        print(f"trial {t.number} was running when the tuner stopped: failed, its point queued again")
    lock = threading.Lock()
    # the free worker slots: optuna runs at most n_jobs objectives at a time (optuna 5.1 study/_optimize.py:101-104),
    # so a trial always finds one, and returns it when it ends
    free = queue.SimpleQueue()
    for slot in range(a.parallel):
        free.put(slot)

    def objective(trial) -> tuple:
        flags = suggest(trial, a.method)
        out = os.path.abspath(os.path.join(a.output_dir, a.method, f"trial_{trial.number}"))
        os.makedirs(out, exist_ok=True)
        slot = free.get()
        try:
            devices = slots[slot]
            cmd = command(a, a.method, flags, out, a.port + trial.number, devices)
            with open(os.path.join(out, "command.txt"), "w") as f:
                f.write(shown(cmd, devices) + "\n")
            with open(os.path.join(out, "log.txt"), "w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=trial_env(devices)).returncode
        finally:
            free.put(slot)
        if rc != 0:
            raise RuntimeError(f"trial {trial.number} exited {rc}: {out}/log.txt")
        (run_dir,) = [os.path.join(out, d) for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))]
        values = last_evaluation(run_dir)
        with lock:
            print(f"trial {trial.number}: {values} with {flags}", flush=True)
        return values

    done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    if done < a.trials:  # the workers take exactly the trials the budget still lacks (a failed one stops the study)
        study.optimize(objective, n_trials=a.trials - done, n_jobs=a.parallel, catch=())
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    print(f"{a.method}: {len(complete)} complete trials; the Pareto front:")
    for t in study.best_trials:
        print(f"  trial {t.number}: {dict(zip(OBJECTIVES, t.values))} {t.params}")
    return 0


def defaults(method: str) -> dict:
    """A point of every space (its first choice, its lower end): the dry run's."""
    point = {}
    for flag, (kind, *spec) in {**SPACES[method], **SHARED}.items():
        point[flag] = spec[0][0] if kind == "choice" else spec[0]
    return point


if __name__ == "__main__":
    sys.exit(main())
