"""benchmarks/wandb_report.py and compare.py's wandb reader, offline: no network, no API key (saving a report and
reading a run from wandb need both, so only the pure parts and --dry-run are tested)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from benchmarks.compare import aggregate, history_to_rows, law_points, wandb_run_record
from benchmarks.metrics import (
    CLIP,
    COV,
    ENTROPY,
    EVAL,
    EVAL_SAMPLED,
    OPENING,
    REWARD,
    SAMPLING,
    SELECTION,
    THROUGHPUT,
    TIME,
)
from benchmarks.wandb_report import Args, api_filters, build_report, sections, settings_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.filterwarnings("ignore:Pydantic V1 style:DeprecationWarning")  # inside wandb_workspaces
SECTIONS = [
    "Entropy",
    "Opening",
    "Reward and accuracy",
    "Evaluation per dataset",
    "Clipping",
    "Cov selection",
    "Dynamic sampling",
    "Token selection",
    "Throughput and phase times",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No key anywhere (HOME holds no .netrc) and an unreachable server: any network call would fail."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")


def fake_run(method, seed, commit="abc1234", **config):
    return {
        "id": f"{method}__{seed}__1700000000",
        "name": f"{method}__{seed}__1700000000",
        "group": method,
        "tags": [method, f"commit:{commit}", "paper-v1"],
        "config": {
            "exp_name": method,
            "seed": seed,
            "learning_rate": 1e-6,
            "group_size": 8,
            "git_commit": commit,
            "world_size": 8,
            "versions": {"torch": "2.14.0", "vllm": "0.33.0"},
            **config,
        },
    }


RUNS = [
    fake_run("grpo_aent", 1, clamp_p=0.33),
    fake_run("grpo_aent", 2, clamp_p=0.33),
    fake_run("grpo_vanilla", 1),
    fake_run("grpo_vanilla", 2),
]


def test_report_sections_panels_grouping_and_filters():
    from wandb_workspaces import expr

    args = Args(
        entity=None,
        tags=("paper-v1", "commit:abc1234"),
        group=("grpo_aent", "grpo_vanilla"),
        run_ids=("grpo_aent__1__1700000000",),
    )
    report = build_report(args, RUNS)
    kinds = [type(b).__name__ for b in report.blocks]
    assert kinds == ["MarkdownBlock"] + ["H2", "P", "PanelGrid"] * 9
    assert [b.text for b in report.blocks if type(b).__name__ == "H2"] == SECTIONS
    grids = [b for b in report.blocks if type(b).__name__ == "PanelGrid"]
    expected = [
        list(ENTROPY),
        list(OPENING),
        [*REWARD, "eval/acc"],
        [*EVAL, *EVAL_SAMPLED],
        list(CLIP),
        list(COV),
        list(SAMPLING),
        list(SELECTION),
        [*THROUGHPUT, *TIME],
    ]
    for grid, metrics in zip(grids, expected):
        assert [p.y for p in grid.panels] == [[m] for m in metrics]  # one line plot per metric
        for p in grid.panels:  # seeds aggregated: mean line, min-max band; one spec the server accepts
            assert (p.x, p.groupby_aggfunc, p.groupby_rangefunc) == ("Step", "mean", "minmax")
            config = p._to_model().config
            assert (config.x_axis, config.group_agg, config.group_area) == ("_step", "mean", "minmax")
        [runset] = grid.runsets
        assert runset.groupby == ["config.exp_name"] and runset.project == "grpo-entropy"
        assert expr.groupby_str_to_key(runset.groupby[0]) == expr.Key(section="config", name="exp_name.value")
        leaves = expr.filters_tree_to_v2(expr.expr_to_filters(runset.filters))["filters"]
        assert [(f["key"]["name"], f["op"], f["value"]) for f in leaves] == [
            ("tags", "IN", ["paper-v1"]),
            ("tags", "IN", ["commit:abc1234"]),  # every tag required
            ("group", "IN", ["grpo_aent", "grpo_vanilla"]),
            ("name", "IN", ["grpo_aent__1__1700000000"]),
            ("jobType", "=", "train"),
        ]
    no_panel_overlap = {(p.layout.x, p.layout.y) for p in grids[-1].panels}
    assert len(no_panel_overlap) == len(grids[-1].panels)
    report._to_model()  # the whole report serialises (without an entity the run sets need no project lookup)


def test_group_by_run_group_and_eval_datasets():
    report = build_report(
        Args(group=("grpo_aent",), group_by="group", eval_datasets=("math500", "aime24"), job_type="")
    )
    grids = [b for b in report.blocks if type(b).__name__ == "PanelGrid"]
    assert [p.y[0] for p in grids[3].panels] == ["eval/math500/acc", "eval/aime24/acc"]
    assert all(g.runsets[0].groupby == ["group"] for g in grids)
    assert grids[0].runsets[0].filters == "Metric(\"Group\") in ['grpo_aent']"
    assert "read from wandb when the report is saved" in report.blocks[0].text  # no runs read: no settings


def test_panels_of_metrics_no_run_logged_are_left_out():
    """... and a new method's own metrics (a namespace no section knows) get a section of their own."""
    runs = [
        {
            **r,
            "metrics": ["entropy/full", "rollout/reward", "time/step"]
            + ["entropy/coef", "mine/b", "mine/a"] * (i == 0),
        }
        for i, r in enumerate(RUNS)
    ]
    report = build_report(Args(tags=("paper-v1",)), runs)
    assert [b.text for b in report.blocks if type(b).__name__ == "H2"] == [
        "Entropy",
        "Reward and accuracy",
        "mine/",
        "Throughput and phase times",
    ]
    grids = [b for b in report.blocks if type(b).__name__ == "PanelGrid"]
    assert [[p.y[0] for p in g.panels] for g in grids] == [
        ["entropy/full", "entropy/coef"],
        ["rollout/reward"],
        ["mine/a", "mine/b"],
        ["time/step"],
    ]


def test_api_filters_match_the_report_filter():
    args = Args(tags=("a", "b"), group=("g",), run_ids=("r1", "r2"))
    assert api_filters(args) == {
        "$and": [
            {"tags": {"$in": ["a"]}},
            {"tags": {"$in": ["b"]}},
            {"group": {"$in": ["g"]}},
            {"name": {"$in": ["r1", "r2"]}},
            {"jobType": "train"},
        ]
    }


def test_settings_block_states_commits_seeds_and_settings():
    text = settings_markdown(Args(tags=("paper-v1",)), RUNS)
    assert "4 runs, 2 methods, git commit `abc1234`." in text and "compare with care" not in text
    rows = [line for line in text.splitlines() if line.startswith("| grpo_")]
    assert rows[0].startswith("| grpo_vanilla | 2 | 1, 2 | abc1234 | 8 |")  # the baseline first
    assert rows[1].startswith("| grpo_aent | 2 | 1, 2 | abc1234 | 8 |")
    assert "group_size = 8\nlearning_rate = 1e-06\n" in text  # shared settings
    assert "| clamp_p | - | 0.33 |" in text  # a setting one method has
    runs = RUNS[:3] + [fake_run("grpo_vanilla", 2, commit="def5678-dirty")]
    runs[0] = {**runs[0], "config": {k: v for k, v in runs[0]["config"].items() if k != "git_commit"}}
    text = settings_markdown(Args(tags=("paper-v1",)), runs)
    assert "git commits `abc1234`, `def5678-dirty`." in text and "compare with care" in text  # a tag stands in


@pytest.mark.launches
def test_dry_run_prints_the_structure_offline():
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.wandb_report", "--entity", "team", "--tags", "paper-v1", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert [line[len("section: ") :] for line in out.splitlines() if line.startswith("section: ")] == SECTIONS
    assert "grouped by: config.exp_name" in out and "Metric(\"Tags\") in ['paper-v1']" in out
    assert "LinePlot entropy/full vs Step: mean over the group, band minmax" in out
    assert out.strip().endswith("dry run: nothing saved")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.wandb_report", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: ")


def test_report_metrics_are_logged_by_the_scripts():
    files = [
        *glob.glob(os.path.join(ROOT, "grpo_*.py")),
        os.path.join(ROOT, "utils", "tracking.py"),
        os.path.join(ROOT, "utils", "evaluation.py"),
    ]
    source = "".join(open(p).read() for p in files)
    for _, _, metrics in sections():
        for m in metrics:  # pass@k is logged for k = 2, 4, 8, ... and --eval-samples
            assert (f'"{m}"' if not m.startswith("eval/pass@") else 'f"eval/pass@{k}"') in source, m


def test_wandb_history_becomes_metrics_jsonl_rows():
    history = [  # what scan_history() yields: every key of the run in every row, None where not logged
        {
            "_step": 1,
            "_runtime": 3.2,
            "_timestamp": 1.7e9,
            "rollout/reward": 0.5,
            "entropy/full": 1.0,
            "eval/acc": None,
        },
        {
            "_step": 2,
            "_runtime": 6.0,
            "rollout/reward": 0.6,
            "entropy/full": 0.8,
            "eval/acc": 0.3,  # training + eval
            "samples": {"_type": "table-file"},
            "flag": True,
            "bad": float("nan"),
        },
        {"_step": 3, "_runtime": 9.0, "rollout/reward": None, "entropy/full": None},  # nothing logged
        {"_runtime": 10.0, "rollout/reward": 1.0},  # no step: not a history row of ours
        {"_step": 3, "entropy/full": 0.6, "rollout/reward": 0.7, "eval/acc": 0.4},
    ]
    rows = history_to_rows(history)
    assert rows == [
        {"step": 1, "rollout/reward": 0.5, "entropy/full": 1.0},
        {"step": 2, "rollout/reward": 0.6, "entropy/full": 0.8, "eval/acc": 0.3},
        {"step": 3, "entropy/full": 0.6, "rollout/reward": 0.7, "eval/acc": 0.4},
    ]
    H, R = law_points(rows, "eval/acc", "entropy/full")  # compare.py reads them like metrics.jsonl rows
    assert H.tolist() == [0.6, 0.6] and R.tolist() == [0.3, 0.4]
    record = wandb_run_record("team/proj/grpo_aent__1__1", {"exp_name": "grpo_aent", "seed": 1}, "g", "x", history)
    assert (record["path"], record["method"], record["seed"]) == ("wandb:team/proj/grpo_aent__1__1", "grpo_aent", 1)
    steps, mean, lo, hi = aggregate([record], "rollout/reward")
    assert steps.tolist() == [1, 2, 3] and mean.tolist() == [0.5, 0.6, 0.7]
    assert wandb_run_record("p", {}, "grpo_klcov", "n", [])["method"] == "grpo_klcov"  # no exp_name: the group
    assert wandb_run_record("p", {}, None, "grpo_clipcov__3__1", [])["method"] == "grpo_clipcov"


@pytest.mark.launches
def test_compare_reads_no_wandb_run_twice_and_fails_in_one_line(tmp_path):
    """A tracked run is also a local directory named by its wandb id: that one is read from disk, not fetched."""
    run = tmp_path / "runs" / "grpo_vanilla__1__1700000000"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "rollout/reward": 0.1 * s, "entropy/full": 1 / s}) + "\n" for s in range(1, 4))
    )
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    command = [
        sys.executable,
        "-m",
        "benchmarks.compare",
        "--runs",
        str(run),
        "--output-dir",
        str(tmp_path / "out"),
        "--wandb-runs",
        "team/proj/grpo_vanilla__1__1700000000",
    ]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "team/proj/grpo_vanilla__1__1700000000: the same run is read from its local directory" in proc.stdout
    proc = subprocess.run(
        command[:-1] + ["team/proj/abc"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: cannot read wandb run team/proj/abc")
