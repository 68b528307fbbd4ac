# A wandb Report comparing tracked GRPO runs by method (seeds aggregated: mean, min-max band); docs: README.md
import json
from dataclasses import dataclass
from typing import Literal

import tyro

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
    eval_metric,
    label,
    own_metrics,
)


@dataclass
class Args:
    entity: str | None = None
    """the wandb entity (team) of the project; default: your default entity"""
    project: str = "grpo-entropy"
    """the wandb project the runs were tracked in (the scripts' --wandb-project-name)"""
    tags: tuple[str, ...] = ()
    """keep runs that carry every one of these tags (e.g. a --wandb-tags value, grpo_aent, commit:<short hash>)"""
    group: tuple[str, ...] = ()
    """keep runs in any of these wandb groups (the scripts' --wandb-group; by default the script name)"""
    run_ids: tuple[str, ...] = ()
    """keep only these runs (wandb run ids: the scripts use the run name, {exp_name}__{seed}__{unix time})"""
    job_type: str = "train"
    """keep runs of this wandb job type ('' for any); the scripts' training runs are 'train'"""
    group_by: Literal["exp_name", "group"] = "exp_name"
    """one curve per value of config exp_name (the method) or of the wandb run group; seeds are aggregated"""
    eval_datasets: tuple[str, ...] = ()
    """eval/<dataset>/acc panels, one per dataset; empty: eval/acc and eval/response_length, what the scripts log"""
    title: str = "GRPO entropy control"
    """the report's title"""
    runs_json: str | None = None
    """a JSON list of runs ({id, name, group, tags, config, metrics}) to use instead of asking wandb for them"""
    dry_run: bool = False
    """build the report and print its structure; no network, no API key, nothing saved"""


def sections(eval_datasets=(), logged=()) -> list:
    """(title, why, metrics) of every report section, in order; a section per namespace of a new method's own metrics
    among `logged` (what the runs logged), before the throughput."""
    own = [
        (f"{namespace}/", f"The metrics of a method this report does not know, logged as {namespace}/...", keys)
        for namespace, keys in own_metrics(logged or ()).items()
    ]
    evals = [eval_metric(d) for d in eval_datasets] if eval_datasets else [*EVAL, *EVAL_SAMPLED]
    return [
        (
            "Entropy",
            "Full-vocabulary entropy of the sampling policy, and of its 20% highest-entropy tokens; AEnt's clamped "
            "entropy and its coefficient.",
            list(ENTROPY),
        ),
        (
            "Opening",
            "The first response token, where a response commits to its approach: the policy's entropy there, and "
            "the share of responses that open otherwise than the most frequent way (the fork testbed's rare branch).",
            list(OPENING),
        ),
        (
            "Reward and accuracy",
            "Training reward and accuracy on the rollouts; greedy accuracy on the eval set.",
            [*REWARD, EVAL[0]],
        ),
        (
            "Evaluation per dataset",
            "Greedy accuracy on each evaluation set, every --eval-every steps; with "
            "--eval-samples 16, the sampled accuracy (mean@16), pass@16 and the entropy of the samples.",
            evals,
        ),
        (
            "Clipping",
            "The share of tokens whose ratio left the clip range, by side and by the sign of the advantage: PPO "
            "silences high_pos and low_neg, CISPO keeps their gradient with a capped weight, CE-GPPO a bounded one.",
            list(CLIP),
        ),
        (
            "Cov selection",
            "KL-Cov / Clip-Cov: which tokens the covariance selection picks and what it does to them.",
            list(COV),
        ),
        (
            "Dynamic sampling",
            "--filter-groups (DAPO): generation rounds per step, groups generated, and the share dropped because "
            "every sample of the group had the same accuracy.",
            list(SAMPLING),
        ),
        (
            "Token selection",
            "--top-entropy-quantile < 1: the policy gradient only on the tokens of highest entropy (the 80/20 rule): "
            "the kept tokens' mean entropy, their share and the threshold.",
            list(SELECTION),
        ),
        *own,
        (
            "Throughput and phase times",
            "Tokens per second of wall time and seconds per phase of a step.",
            [*THROUGHPUT, *TIME],
        ),
    ]


def runset_filters(args: Args):
    """The report's run filter (wandb_workspaces expressions, ANDed): every tag, any of the groups, any of the ids."""
    from wandb_workspaces import expr

    filters = [expr.Tags().isin([tag]) for tag in args.tags]  # one clause per tag: a run must carry all of them
    if args.group:
        filters.append(expr.Metric("Group").isin(list(args.group)))
    if args.run_ids:
        filters.append(expr.Metric("ID").isin(list(args.run_ids)))
    if args.job_type:
        filters.append(expr.Metric("JobType") == args.job_type)
    return expr.And(*filters) if filters else ""


def api_filters(args: Args) -> dict:
    """The same filter for wandb.Api().runs() (its MongoDB-style query): to read the matched runs' config."""
    clauses = [{"tags": {"$in": [tag]}} for tag in args.tags]
    if args.group:
        clauses.append({"group": {"$in": list(args.group)}})
    if args.run_ids:
        clauses.append({"name": {"$in": list(args.run_ids)}})  # `name` is the run id in this query language
    if args.job_type:
        clauses.append({"jobType": args.job_type})
    return {"$and": clauses}


def settings_markdown(args: Args, runs: list | None) -> str:
    """The report's first block: what was selected and how it is drawn, then per method its runs, seeds, git commits,
    world size and versions, the settings (config) shared by all runs and those that differ. runs: dicts with id, name,
    group, tags, config; None when not read (--dry-run without --runs-json)."""
    where = [f"tags include all of {', '.join(f'`{t}`' for t in args.tags)}"] if args.tags else []
    where += [f"group in {', '.join(f'`{g}`' for g in args.group)}"] if args.group else []
    where += [f"run id in {', '.join(f'`{i}`' for i in args.run_ids)}"] if args.run_ids else []
    where += [f"job type `{args.job_type}`"] if args.job_type else []
    key = "config `exp_name` (the method)" if args.group_by == "exp_name" else "wandb run group"
    lines = [
        "## Settings",
        "",
        f"Runs of `{args.entity or '<default entity>'}/{args.project}` where {' and '.join(where)}. One curve per "
        f"{key}: the mean over its runs (seeds), the band from their min to their max.",
        "",
    ]
    if runs is None:
        lines.append("(The runs' settings and git commits are read from wandb when the report is saved.)")
        return "\n".join(lines)

    def method(run):
        return (run["config"].get("exp_name") if args.group_by == "exp_name" else run.get("group")) or "?"

    def value(v):
        return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)

    def commit(run):  # the config field, else the commit:<hash> tag (runs from before the field existed)
        tagged = [t[len("commit:") :] for t in run.get("tags", []) if t.startswith("commit:")]
        return str(run["config"].get("git_commit") or (tagged[0] if tagged else "?"))

    methods = sorted({method(r) for r in runs}, key=lambda m: (m != "grpo_vanilla", m))  # the baseline first
    by_method = {m: [r for r in runs if method(r) == m] for m in methods}
    commits = sorted({commit(r) for r in runs})
    lines += [
        f"{len(runs)} runs, {len(methods)} methods, git commit{'s' * (len(commits) > 1)} "
        f"{', '.join(f'`{c}`' for c in commits)}."
    ]
    if len(commits) > 1 or any(c.endswith("-dirty") or c == "?" for c in commits):
        lines += ["", "**Not one clean commit** (several, uncommitted changes, or unknown): compare with care."]
    lines += ["", "| method | runs | seeds | git commit | world size | versions | tags |", "|" + " --- |" * 7]
    for m, rs in by_method.items():
        seeds = sorted({r["config"].get("seed") for r in rs}, key=str)
        cells = [", ".join(map(str, seeds)), ", ".join(sorted({commit(r) for r in rs}))]
        cells += [", ".join(sorted({value(r["config"].get(k, "?")) for r in rs})) for k in ("world_size", "versions")]
        cells.append(", ".join(sorted({t for r in rs for t in r.get("tags", [])})))
        lines.append(f"| {m} | {len(rs)} | " + " | ".join(cells) + " |")
    # settings: the Args fields (and anything else in config) except what names or describes the run itself
    per_run = {"seed", "run_name", "exp_name", "git_commit", "world_size", "versions", "wandb_tags", "wandb_group"}
    keys = sorted({k for r in runs for k in r["config"] if k not in per_run and not k.startswith("_")})
    shared = [k for k in keys if len({value(r["config"].get(k)) for r in runs}) == 1]
    lines += [
        "",
        "Settings shared by all runs:",
        "",
        "```",
        *(f"{k} = {value(runs[0]['config'].get(k))}" for k in shared),
        "```",
    ]
    differing = [k for k in keys if k not in shared]
    if differing:  # one row per setting, one column per method ('-': the method's runs have no such field)
        lines += [
            "",
            "Settings that differ:",
            "",
            "| setting | " + " | ".join(methods) + " |",
            "|" + " --- |" * (len(methods) + 1),
        ]
        for k in differing:
            lines.append(
                f"| {k} | "
                + " | ".join(
                    ", ".join(sorted({value(r["config"].get(k, "-")) for r in rs})) for rs in by_method.values()
                )
                + " |"
            )
    return "\n".join(lines)


def build_report(args: Args, runs: list | None = None):
    """The wandb_workspaces Report: the settings block, then per section a heading, a line and a panel grid whose run
    set (the filter, grouped by method) feeds one line plot per metric (mean over seeds, min-max band). No network.
    runs: as settings_markdown() takes them; with their "metrics", panels of metrics no run logged are left out."""
    import wandb_workspaces.reports.v2 as wr

    groupby = ["config.exp_name"] if args.group_by == "exp_name" else ["group"]
    filters = runset_filters(args)
    logged = None  # the metrics some run logged, when known (each run's "metrics": its wandb summary keys)
    if runs and all("metrics" in r for r in runs):
        logged = {m for r in runs for m in r["metrics"]}
    blocks = [wr.MarkdownBlock(text=settings_markdown(args, runs))]
    for title, why, metrics in sections(args.eval_datasets, logged):
        metrics = [m for m in metrics if logged is None or m in logged]  # no empty panels, no empty sections
        if not metrics:
            continue
        panels = [
            wr.LinePlot(
                title=label(m),
                x="Step",
                y=[m],
                groupby_aggfunc="mean",
                groupby_rangefunc="minmax",
                layout=wr.Layout(x=8 * (i % 3), y=6 * (i // 3), w=8, h=6),
            )
            for i, m in enumerate(metrics)
        ]
        runset = wr.Runset(
            entity=args.entity or "", project=args.project, name="runs", filters=filters, groupby=groupby
        )
        blocks += [wr.H2(text=title), wr.P(text=why), wr.PanelGrid(runsets=[runset], panels=panels)]
    return wr.Report(
        entity=args.entity or "",
        project=args.project,
        title=args.title,
        width="fluid",
        blocks=blocks,
        description=f"Runs grouped by {groupby[0]}: mean over seeds, min-max band. Made by benchmarks/wandb_report.py.",
    )


def describe(report) -> str:
    """The report's structure as text (what --dry-run prints): read back from the Report object itself."""
    last_runset = None
    out = [f"report {report.title!r} in {report.entity or '<default entity>'}/{report.project}: {report.description}"]
    for block in report.blocks:
        kind = type(block).__name__
        if kind == "MarkdownBlock":
            text = block.text.splitlines()
            out += [f"markdown ({len(text)} lines):"] + [f"  | {line}" for line in text]
        elif kind == "H2":
            out.append(f"section: {block.text}")
        elif kind == "PanelGrid":
            for rs in block.runsets:
                line = f"runset {rs.name!r}: filters: {rs.filters or '(none)'}; grouped by: {', '.join(rs.groupby)}"
                out.append(f"  {line}" if line != last_runset else "  runset: the same")
                last_runset = line
            for p in block.panels:
                out.append(
                    f"  {type(p).__name__} {', '.join(p.y)} vs {p.x}: {p.groupby_aggfunc} over the group, "
                    f"band {p.groupby_rangefunc}"
                )
    return "\n".join(out)


def fetch_runs(args: Args) -> list:
    """The matched runs' id, name, group, tags, config and logged metrics (summary keys), from wandb.Api() (network
    and an API key: not tested here)."""
    import wandb

    runs = wandb.Api().runs(f"{args.entity}/{args.project}", filters=api_filters(args))
    return [
        {
            "id": r.id,
            "name": r.name,
            "group": r.group,
            "tags": list(r.tags),
            "config": dict(r.config),
            "metrics": [k for k in r.summary.keys() if not k.startswith("_")],
        }
        for r in runs
    ]


if __name__ == "__main__":
    args = tyro.cli(Args)
    if not (args.tags or args.group or args.run_ids):
        raise SystemExit("error: select the runs with --tags, --group or --run-ids")
    if not args.dry_run and not args.entity:
        try:
            import wandb

            args.entity = wandb.Api().default_entity
        except Exception as e:  # no key, no network
            raise SystemExit(f"error: cannot ask wandb for your default entity: {e}")
    if args.runs_json:
        with open(args.runs_json) as f:
            runs = json.load(f)
    elif args.dry_run:
        runs = None
    else:
        try:
            runs = fetch_runs(args)
        except Exception as e:  # no key, no network, no such project
            raise SystemExit(f"error: cannot read the runs from wandb: {e}")
    if runs is not None and not runs:
        raise SystemExit(f"error: no run of {args.entity or '<default entity>'}/{args.project} matches the filter")
    report = build_report(args, runs)
    print(describe(report))
    if args.dry_run:
        print("dry run: nothing saved")
    else:
        try:
            report.save()
        except Exception as e:
            raise SystemExit(f"error: cannot save the report to wandb: {e}")
        print(f"saved: {report.url}")
