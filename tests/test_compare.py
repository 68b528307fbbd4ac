"""benchmarks/compare.py on synthetic run directories: plots, table, seed aggregation and the law fit."""

import glob
import importlib
import json
import math
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
import tyro

from benchmarks.compare import Args, aggregate, diff_ci, fit_law, law_points, mean_ci, moving_average, run_summary, t95

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A, B = 0.6, 1.4  # the law the synthetic runs follow: R = -A exp(H) + B


def write_run(root, method, seed, entropy_end, steps=40, extra=None):
    """A run whose entropy decays from 1.0 to entropy_end and whose accuracies follow the law (plus a little noise)."""
    rng = np.random.default_rng(seed)
    path = os.path.join(root, f"{method}__{seed}__1700000000")
    os.makedirs(path)
    with open(os.path.join(path, "args.json"), "w") as f:
        json.dump({"exp_name": method, "seed": seed}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step in range(1, steps + 1):
            H = entropy_end + (1.0 - entropy_end) * math.exp(-step / 8)
            acc = -A * math.exp(H) + B + rng.normal(0, 0.005)
            row = {"step": step, "rollout/reward": acc, "rollout/accuracy": acc, "entropy/full": H, **(extra or {})}
            f.write(json.dumps(row) + "\n")
            if step % 5 == 0:  # evaluations are separate rows; this one measured the policy that samples step + 1
                h_step = step + 1 if step < steps else step  # (compare.py's stand-in for the last, unsampled policy)
                H_next = entropy_end + (1.0 - entropy_end) * math.exp(-h_step / 8)
                f.write(json.dumps({"step": step, "eval/acc": -A * math.exp(H_next) + B}) + "\n")
    return path


def run_compare(*flags):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.launches
def test_compare_writes_plots_and_table(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs, "grpo_vanilla", 1, 0.1)
    write_run(runs, "grpo_vanilla", 2, 0.2)
    write_run(runs, "grpo_aent", 1, 0.5, extra={"entropy/coef": 0.002, "entropy/clamped": 0.3})
    write_run(runs, "grpo_aent", 2, 0.5, extra={"entropy/coef": 0.003, "entropy/clamped": 0.3})
    write_run(runs, "grpo_mine", 1, 0.4, extra={"mine/bonus": 0.1, "mine/frac": 0.5})  # a new method's own metrics
    klcov = write_run(runs, "grpo_klcov", 1, 0.6, extra={"cov/selected_frac": 2e-3})
    os.makedirs(os.path.join(klcov, "eval"))  # benchmarks/eval.py's results on the final model
    with open(os.path.join(klcov, "eval", "results.json"), "w") as f:
        json.dump({"average": {"mean@4": 0.4321, "pass@4": 0.6}}, f)
    out = tmp_path / "compare"
    proc = run_compare("--runs", str(runs / "*"), "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("entropy.png", "reward.png", "eval_acc.png", "law.png", "aent.png", "cov.png", "mine.png"):
        with open(out / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    table = (out / "compare.md").read_text().split("| method | seeds | steps |")[1]  # the per-method summary
    rows = [line for line in table.splitlines() if line.startswith("| grpo_")]
    assert [r.split(" | ")[0] for r in rows] == ["| grpo_vanilla", "| grpo_aent", "| grpo_klcov", "| grpo_mine"]
    assert rows[2].endswith("| 0.432 |") and rows[0].endswith("| - |")  # baseline first, then by name
    summary = json.loads((out / "compare.json").read_text())
    assert summary["law_metric"] == "eval/acc"
    methods = summary["methods"]
    assert methods["grpo_vanilla"]["seeds"] == [1, 2] and methods["grpo_vanilla"]["entropy_retained"] == pytest.approx(
        1.0
    )
    assert methods["grpo_aent"]["entropy_retained"] > 2  # final entropy ~0.5 against vanilla's ~0.15
    for m in methods.values():  # the evaluations follow the law exactly and are paired with the right entropy
        assert m["a"] == pytest.approx(A, rel=1e-6) and m["b"] == pytest.approx(B, rel=1e-6)
        assert m["ceiling"] == pytest.approx(B - A, rel=1e-6)
    assert methods["grpo_vanilla"]["final_eval_acc"][0] == pytest.approx(
        -A * math.exp(0.1 + 0.9 * math.exp(-40 / 8)) + B
    )


# the papers' settings and the testbed comparison; not the equal-budget study's tune_*.sh (test_tune_report.py: the
# confirmation's dry run; the study itself runs for hours, DRY_RUN or not)
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "reproduce", "*.sh")))
SCRIPTS = [s for s in SCRIPTS if not os.path.basename(s).startswith("tune_")]


def dry_run(script: str, **settings) -> list:
    """Every command line a reproduction script prints with DRY_RUN=1 (and its `settings`, e.g. METHODS), split into
    arguments."""
    env = {**os.environ, "DRY_RUN": "1", **settings}
    proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines()]


def method_at(command: list) -> int | None:
    """Where a command names the method script it launches (None: it launches none)."""
    return next((i for i, t in enumerate(command) if t.startswith("grpo_") and t.endswith(".py")), None)


@pytest.mark.parametrize("script", SCRIPTS, ids=[os.path.basename(s) for s in SCRIPTS])
def test_reproduction_scripts_pass_valid_flags(script):
    """Every command a reproduction script launches parses with its script's Args and passes its checks."""
    import benchmarks.compare
    import benchmarks.eval

    commands = dry_run(script)
    methods = [method_at(c) for c in commands]
    launched = {c[i] for c, i in zip(commands, methods) if i}
    known = ("vanilla", "aent", "klcov", "clipcov", "cispo", "cegppo", "lpreg", "sapo", "gspo", "wreinforce")
    assert "grpo_vanilla.py" in launched and launched <= {f"grpo_{m}.py" for m in known}
    for c, i in zip(commands, methods):
        if i is not None:
            if c[0] == "deepspeed":
                world_size = int(c[c.index("--num_gpus") + 1]) * (
                    int(c[c.index("--num_nodes") + 1]) if "--num_nodes" in c else 1
                )
            else:
                world_size = int(c[c.index("--nproc_per_node") + 1])
            if not os.path.exists(os.path.join(ROOT, c[i])):
                continue  # a method not in this checkout yet
            module = importlib.import_module(c[i][: -len(".py")])
            module.validate_args(tyro.cli(module.Args, args=c[i + 1 :]), world_size=world_size)
        elif c[1:3] == ["-m", "benchmarks.eval"]:
            benchmarks.eval.validate_args(tyro.cli(benchmarks.eval.Args, args=c[3:]))
        else:
            assert c[1:3] == ["-m", "benchmarks.compare"], c
            tyro.cli(benchmarks.compare.Args, args=c[3:])


def test_the_cov_recipes_run_the_authors_experiment():
    """The settings docs/fidelity.md lists as the authors' (PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/*.sh)."""
    for size, lr, k in (("7b", 5e-7, 2e-3), ("32b", 1e-6, 2e-4)):
        commands = dry_run(os.path.join(ROOT, "benchmarks", "reproduce", f"cov_qwen2.5_{size}.sh"))
        names = set()
        for argv in (c for c in commands if method_at(c) is not None):
            at = method_at(argv)
            module = importlib.import_module(argv[at][: -len(".py")])
            args = tyro.cli(module.Args, args=argv[at + 1 :])
            names.add(args.exp_name)
            assert args.filter_groups and args.filter_groups_metric == "acc" and args.max_gen_batches == 10
            assert args.learning_rate == lr and args.num_prompts_per_step == 256 and args.group_size == 8
            assert args.num_mini_batches == 8 and args.max_response_length == 8192 and args.eval_every == 4
            assert args.kl_coef == 0 and args.vllm_is_cap == 0 and args.overlong_buffer_len == 0
            high = {"grpo_vanilla": 0.2, "grpo_vanilla_cliphigher": 0.28, "grpo_clipcov": 1.0}.get(args.exp_name)
            assert high is None or args.clip_eps_high == high
            if args.exp_name == "grpo_klcov":
                assert args.kl_cov_ratio == k and args.ppo_kl_coef == 1
        assert names == {"grpo_vanilla", "grpo_vanilla_cliphigher", "grpo_klcov", "grpo_clipcov"}


@pytest.mark.launches
def test_compare_without_runs_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--runs", str(tmp_path / "*")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: ")


def test_law_fit_recovers_a_and_b():
    H = np.linspace(0.05, 1.5, 30)
    assert fit_law(H, -0.8 * np.exp(H) + 1.7) == pytest.approx((0.8, 1.7))
    noisy = -0.8 * np.exp(H) + 1.7 + np.random.default_rng(0).normal(0, 0.01, H.shape)
    a, b = fit_law(H, noisy)
    assert abs(a - 0.8) < 0.03 and abs(b - 1.7) < 0.05
    assert all(math.isnan(x) for x in fit_law([0.3, 0.3], [0.5, 0.6]))  # one entropy value: no fit


def test_law_points_pair_an_evaluation_with_the_next_steps_entropy():
    rows = [
        {"step": 0, "eval/acc": 0.1},
        {"step": 1, "entropy/full": 1.0},
        {"step": 2, "entropy/full": 0.8},
        {"step": 2, "eval/acc": 0.3},
        {"step": 3, "entropy/full": 0.6},
        {"step": 3, "eval/acc": 0.4},
    ]
    H, R = law_points(rows, "eval/acc", "entropy/full")
    assert H.tolist() == [1.0, 0.6, 0.6] and R.tolist() == [0.1, 0.3, 0.4]  # the last one has no next step
    H, R = law_points(rows, "entropy/full", "entropy/full")
    assert H.tolist() == R.tolist() == [1.0, 0.8, 0.6]


def test_aggregate_over_seeds_with_different_steps():
    runs = [{"rows": [{"step": 1, "x": 1.0}, {"step": 2, "x": 3.0}]}, {"rows": [{"step": 1, "x": 2.0}]}]
    steps, mean, lo, hi = aggregate(runs, "x")
    assert (
        steps.tolist() == [1, 2]
        and mean.tolist() == [1.5, 3.0]
        and lo.tolist() == [1.0, 3.0]
        and hi.tolist() == [2.0, 3.0]
    )
    assert aggregate(runs, "missing") is None
    assert moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [1.0, 2.0, 4.0, 6.0]


def test_run_summary_keeps_the_initial_evaluation_apart(tmp_path):
    rows = [
        {"step": 0, "eval/acc": 0.5},
        {"step": 1, "entropy/full": 0.3},
        {"step": 10, "eval/acc": 0.4},
        {"step": 20, "eval/acc": 0.45},
        {"step": 30, "eval/acc": 0.42},
    ]
    summary = run_summary({"path": str(tmp_path), "rows": rows}, Args())
    assert (summary["initial_eval_acc"], summary["final_eval_acc"], summary["best_eval_acc"]) == (0.5, 0.42, 0.45)
    assert run_summary({"path": str(tmp_path), "rows": rows[1:]}, Args())["initial_eval_acc"] is None  # no step 0


def test_intervals_over_seeds():
    """95% t interval of a mean and Welch's interval of a difference, against values computed by hand (scipy's
    t.ppf(0.975, df) for the quantiles)."""
    assert t95(1) == pytest.approx(12.706) and t95(2) == pytest.approx(4.303) and t95(4.7) == pytest.approx(2.776)
    assert math.isnan(t95(0)) and 1.96 < t95(100) < 2.0
    mean, half = mean_ci([0.5, 0.6, 0.7])
    assert mean == pytest.approx(0.6) and half == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert math.isnan(mean_ci([0.5])[1]) and mean_ci([0.5, None])[0] == 0.5
    # equal variances and sizes: Welch's df is 2 (n - 1) = 4
    d, half = diff_ci([0.7, 0.8, 0.9], [0.5, 0.6, 0.7])
    assert d == pytest.approx(0.2) and half == pytest.approx(2.776 * math.sqrt(2 * 0.01 / 3))


@pytest.mark.launches
def test_compare_table_gives_intervals_and_differences(tmp_path):
    runs = tmp_path / "runs"
    for seed in (1, 2, 3):
        write_run(runs, "grpo_vanilla", seed, 0.1 + 0.01 * seed)
        write_run(runs, "grpo_aent", seed, 0.5 + 0.01 * seed)
    out = tmp_path / "compare"
    proc = run_compare("--runs", str(runs / "*"), "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (out / "compare.md").read_text().splitlines()
    assert lines[0] == "| method | seeds | eval/acc | entropy/full |"
    assert lines[2].startswith("| grpo_vanilla | 3 | ") and " ± " in lines[2]
    diff = next(line for line in lines if line.startswith("| grpo_aent - grpo_vanilla |"))
    assert diff.split(" | ")[-1].rstrip(" |").endswith("*")  # entropy 0.4 higher, seed spread 0.01: significant
    final = json.loads((out / "compare.json").read_text())["methods"]["grpo_aent"]
    assert final["minus_baseline"]["entropy/full"][0] == pytest.approx(0.4, abs=0.01)


@pytest.mark.launches
def test_compare_shows_each_held_out_set(tmp_path):
    """Runs evaluated on several sets (eval/<set>/acc, eval/acc their mean): the interval table has a column per set."""
    runs = tmp_path / "runs"
    for method, seed, acc in (("grpo_vanilla", 1, 0.4), ("grpo_vanilla", 2, 0.5), ("grpo_aent", 1, 0.6)):
        path = write_run(runs, method, seed, 0.2)
        with open(os.path.join(path, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": 40, "eval/acc": acc, "eval/gsm8k/acc": acc + 0.1, "eval/amc23/acc": acc - 0.1}))
    out = tmp_path / "compare"
    proc = run_compare("--runs", str(runs / "*"), "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = next(
        line for line in (out / "compare.md").read_text().splitlines() if line.startswith("| method | seeds |")
    )
    assert header.split(" | ")[2:5] == ["eval/acc", "eval/amc23/acc", "eval/gsm8k/acc"], header
    summary = json.loads((out / "compare.json").read_text())["methods"]
    assert summary["grpo_vanilla"]["final"]["eval/gsm8k/acc"][0] == pytest.approx(0.55)


def test_testbed_runs_any_method_file_with_its_flags():
    """testbed.sh: a grpo_<name>.py runs with its own flags; METHOD_FLAGS_<name> replaces them or names a variant
    (the script, then its flags); a name that is neither stops it in one line."""
    script = os.path.join(ROOT, "benchmarks", "reproduce", "testbed.sh")
    env = {**os.environ, "DRY_RUN": "1", "SEEDS": "1", "METHOD_FLAGS_grpo_vanilla": "--clip-eps-high 0.28"}
    env |= {
        "METHODS": "grpo_vanilla grpo_entadv grpo_entadv_k3",
        "METHOD_FLAGS_grpo_entadv_k3": "grpo_entadv --entadv-kappa 3",
    }
    proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    vanilla, entadv, variant, compare = [shlex.split(line) for line in proc.stdout.splitlines()]
    for c, name, own in (
        (vanilla, "grpo_vanilla", ["--clip-eps-high", "0.28"]),
        (entadv, "grpo_entadv", ["--entadv-alpha", "0.4", "--entadv-kappa", "2"]),
        (variant, "grpo_entadv_k3", ["--entadv-kappa", "3"]),
    ):
        i = next(i for i, t in enumerate(c) if t.startswith("grpo_") and t.endswith(".py"))
        assert c[-4 - len(own) :] == [*own, "--exp-name", name, "--seed", "1"], c
        module = importlib.import_module(c[i][: -len(".py")])
        module.validate_args(tyro.cli(module.Args, args=c[i + 1 :]), world_size=1)
    assert variant[variant.index("--nproc_per_node") + 4] == "grpo_entadv.py"
    assert compare[1:3] == ["-m", "benchmarks.compare"]
    proc = subprocess.run(["bash", script], env={**env, "METHODS": "grpo_nothing"}, capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        'unknown method grpo_nothing: no grpo_nothing.py (a variant: METHOD_FLAGS_grpo_nothing="<script> <flags>")'
    ]


def test_run_windows_averages_each_metric_over_its_logged_steps():
    from benchmarks.run_windows import windows

    rows = [{"step": s, "a": float(s), **({"b": 10.0 * s} if s % 2 else {})} for s in range(1, 8)]
    rows.append({"step": 0, "eval/acc": 0.5})  # an evaluation row: no metric asked for, not a step of its own
    out = windows(rows, ["a", "b"], window=3)
    assert [(first, last) for first, last, _ in out] == [(1, 3), (4, 6), (7, 7)]
    assert out[0][2] == {"a": 2.0, "b": 20.0} and out[1][2] == {"a": 5.0, "b": 50.0} and out[2][2]["b"] == 70.0


def test_runs_that_do_not_belong_together_are_named():
    """The mixes a new user's runs/ holds (issue 72): vanilla's seed 1 three times, one of them on the fork testbed,
    and AEnt's 20 steps against vanilla's 200: each named in its own line; distinct seeds on one setting: none."""

    def run(method, seed, dataset="testbed/train.jsonl", steps=200):
        rows = [{"step": s} for s in range(1, steps + 1)]
        settings = {"dataset": dataset, "model_name_or_path": "testbed/model", "total_steps": steps}
        return {"path": f"{method}_{seed}", "method": method, "seed": seed, "rows": rows, "settings": settings}

    from benchmarks.compare import mixes

    vanilla = [run("grpo_vanilla", 1), run("grpo_vanilla", 1), run("grpo_vanilla", 1, "testbed/fork/train.jsonl")]
    problems = mixes({"grpo_vanilla": vanilla, "grpo_aent": [run("grpo_aent", 1, steps=20)]}, "grpo_vanilla")
    assert "grpo_vanilla: seed 1 run more than once (3 runs)" in problems
    assert any(p.startswith("grpo_vanilla: its runs differ in dataset") for p in problems), problems
    assert any(p.startswith("grpo_aent against grpo_vanilla: total_steps [20] vs [200]") for p in problems), problems
    assert any(p.startswith("grpo_aent against grpo_vanilla: steps [20] vs [200]") for p in problems), problems
    fine = {"grpo_vanilla": [run("grpo_vanilla", s) for s in (1, 2, 3)], "grpo_aent": [run("grpo_aent", 1)]}
    assert mixes(fine, "grpo_vanilla") == []
    unknown = {"grpo_vanilla": [{"seed": 1, "rows": [{"step": 5}]}], "x": [{"seed": 2, "rows": [{"step": 5}]}]}
    assert mixes(unknown, "grpo_vanilla") == []  # no args.json: nothing to tell, nothing refused


@pytest.mark.launches
def test_compare_refuses_repeated_seeds_unless_told(tmp_path):
    """One line naming the mix, not a table of 3 'seeds' that are one; with --allow-mixed a warning line and the
    table's seeds column counts distinct seeds."""
    runs = tmp_path / "runs"
    for stamp in ("1700000001", "1700000002"):
        path = write_run(runs, "grpo_vanilla", 1, 0.1)
        os.rename(path, path.replace("1700000000", stamp))
    proc = run_compare("--runs", str(runs / "*"), "--output-dir", str(tmp_path / "out"))
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith(
        "error: these runs do not belong together: grpo_vanilla: seed 1 run more than once (2 runs)"
    ), proc.stderr[-2000:]
    proc = run_compare("--runs", str(runs / "*"), "--output-dir", str(tmp_path / "out"), "--allow-mixed")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: pooled anyway (--allow-mixed): grpo_vanilla: seed 1 run more than once" in proc.stdout
    assert "| grpo_vanilla | 1 (2 runs) |" in (tmp_path / "out" / "compare.md").read_text()
