"""Soak run: does a long testbed run leak memory, file descriptors, threads or processes?

Launches one method script with torch.distributed.run on the CPU testbed (the Makefile's TESTBED_ARGS, plus
checkpoints every 20 steps keeping 2 and greedy evaluation on 100 prompts every 20 steps) and, about once a second,
sums over the launcher and every descendant (vLLM engine cores, reward grading subprocesses, compile workers):
resident memory (VmRSS, and its anonymous part RssAnon: the heap, where a leak shows; PSS is not used because on a
shared machine it moves when other users' processes map the same libraries), open fds, processes and threads.
Samples are mapped
to training steps by counting the lines of the run's metrics.jsonl. This script is a child subreaper, so a descendant
orphaned mid-run stays counted, and one still alive after the launcher exits is reported as leaked.

    python -m benchmarks.experiments.soak --steps 300               # grpo_vanilla.py, 1 process, vLLM on
    python -m benchmarks.experiments.soak --script grpo_aent.py --steps 200 --nproc 2 --output runs/soak_aent

Prints a markdown table (warm-up end vs end, least-squares slopes after warm-up, PASS/FAIL per criterion) and the
processes whose RSS grew most; writes every per-process sample to <output>/soak_samples.csv.
"""

import argparse
import csv
import ctypes
import json
import os
import shlex
import subprocess
import sys
import time

from testbed.common import CPU_ENV
from testbed.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOAK_FLAGS = {"--save-every": "20", "--keep-checkpoints": "2", "--eval-every": "20", "--eval-num-prompts": "100"}
FIELDS = ["t", "step", "pid", "ppid", "name", "rss_kb", "anon_kb", "fds", "threads"]


def testbed_args() -> list:
    """TESTBED_ARGS from the Makefile (continuation lines joined), so the soak runs what `make testbed` runs."""
    text = open(os.path.join(ROOT, "Makefile")).read().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("TESTBED_ARGS :="))
    return shlex.split(line.split(":=", 1)[1])


def override(flags: list, new: dict) -> list:
    """Replace `--flag value` pairs of `flags` by `new`'s (appending the missing ones)."""
    out, i = [], 0
    while i < len(flags):
        has_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flags[i] not in new:
            out += flags[i : i + 1 + has_value]
        i += 1 + has_value
    return out + [x for kv in new.items() for x in kv]


def read_proc(pid: int) -> dict | None:
    """One process's numbers from /proc (None if it exited meanwhile)."""
    try:
        status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
        return {
            "pid": pid,
            "ppid": int(status["PPid"]),
            "name": status["Name"].strip(),
            "rss_kb": int(status.get("VmRSS", "0 kB").split()[0]),
            "anon_kb": int(status.get("RssAnon", "0 kB").split()[0]),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"]),
        }
    except (FileNotFoundError, ProcessLookupError, PermissionError, KeyError):
        return None


def descendants(root: int) -> list:
    """pids of every descendant of `root` (parent links from /proc/*/stat; the comm may hold spaces or parens)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def slope(xs: list, ys: list) -> float:
    """Least-squares slope of ys on xs (0 with fewer than two distinct xs)."""
    n, mx, my = len(xs), sum(xs) / max(len(xs), 1), sum(ys) / max(len(ys), 1)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n > 1 and sxx > 0 else 0.0


def heap_report(out_dir: str, t_start: float, samples: list, a) -> None:
    """Slopes after warm-up of what heap_probe.py recorded in each rank: RSS before and after malloc_trim, malloc's
    in-use and free bytes, live tensors and gc-tracked objects (probe times mapped to steps through the samples)."""
    keys = ("rss_mb", "rss_after_trim_mb", "malloc_in_use_mb", "malloc_free_mb", "tensor_mb", "tensors", "gc_objects")
    print("\n| heap probe (rank) | " + " | ".join(keys) + " |\n| --- |" + " --- |" * len(keys))
    for rank in range(a.nproc):
        path = os.path.join(out_dir, f"heap_probe_rank{rank}.jsonl")
        rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        for r in rows:  # the step at the probe's time: the last soak sample taken before it
            r["step"] = max([s["step"] for s in samples if s["t"] <= r["time"] - t_start] or [0])
        rows = [r for r in rows if a.warmup <= r["step"] < a.steps]
        if len(rows) < 3:
            print(f"| {rank} | too few probe samples after warm-up ({len(rows)}) |")
            continue
        cells = [
            f"{rows[0][k]:.0f} -> {rows[-1][k]:.0f} "
            f"({100 * slope([r['step'] for r in rows], [r[k] for r in rows]):+.1f}/100 steps)"
            for k in keys
        ]
        print(f"| {rank} | " + " | ".join(cells) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--script", default="grpo_vanilla.py")
    p.add_argument("--nproc", type=int, default=1, choices=(1, 2))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30, help="steps excluded from the slopes")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument(
        "--output", default=None, help="directory for the run and soak_samples.csv (default runs/soak_<script>_<time>)"
    )
    p.add_argument("--extra", default="", help="more flags for the script, e.g. '--no-use-vllm'")
    p.add_argument(
        "--heap-probe",
        type=float,
        default=0,
        metavar="SECONDS",
        help="run the script under heap_probe.py, sampling every this many seconds (and trimming malloc)",
    )
    a = p.parse_args()
    from testbed.build_arithmetic import build_testbed

    tb = build_testbed(log=lambda *x: None)
    out_dir = os.path.abspath(
        a.output or os.path.join(ROOT, "runs", f"soak_{a.script.removesuffix('.py')}_{int(time.time())}")
    )
    os.makedirs(out_dir, exist_ok=True)
    flags = override(
        testbed_args(),
        {
            **SOAK_FLAGS,
            "--total-steps": str(a.steps),
            "--output-dir": out_dir,
            "--model-name-or-path": tb.model_dir,
            "--dataset": tb.train_file,
            "--eval-dataset": tb.test_file,
        },
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(a.nproc),
        "--master_port",
        str(free_port()),
        *(["-m", "benchmarks.experiments.heap_probe"] if a.heap_probe else []),
        os.path.join(ROOT, a.script),
        *flags,
        *shlex.split(a.extra),
    ]
    print(" ".join(cmd), flush=True)
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphaned descendants re-parent to us, stay in the tree
    log = open(os.path.join(out_dir, "soak_launcher.log"), "w")
    probe_env = {
        "HEAP_PROBE_OUT": os.path.join(out_dir, "heap_probe_rank{rank}.jsonl"),
        "HEAP_PROBE_INTERVAL": str(a.heap_probe),
    }
    launcher = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, **CPU_ENV, **(probe_env if a.heap_probe else {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    samples = open(os.path.join(out_dir, "soak_samples.csv"), "w", newline="")  # written as sampled: survives a kill
    writer = csv.DictWriter(samples, FIELDS)
    writer.writeheader()
    t_start, step, metrics, partial, rows, seen = time.time(), 0, None, "", [], {}
    while launcher.poll() is None:
        if metrics is None:
            found = [os.path.join(r, "metrics.jsonl") for r, _, files in os.walk(out_dir) if "metrics.jsonl" in files]
            metrics = open(found[0]) if found else None
        if metrics is not None:  # count complete lines only
            *lines, partial = (partial + metrics.read()).split("\n")
            step += sum('"rollout/reward"' in line for line in lines)
        t = round(time.time() - t_start, 2)
        for info in filter(None, map(read_proc, descendants(os.getpid()))):
            seen.setdefault(info["pid"], info["name"])
            rows.append({"t": t, "step": step, **info})
            writer.writerow(rows[-1])
        samples.flush()
        time.sleep(a.interval)
    if metrics is not None:
        step += sum('"rollout/reward"' in line for line in (partial + metrics.read()).split("\n"))
    time.sleep(2)  # give stragglers a moment to exit
    while True:  # reap orphans that exited after re-parenting to us (zombies are not leaks)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    leaked = [f"{pid} ({seen.get(pid, '?')})" for pid in descendants(os.getpid())]
    samples.close()

    # totals per sample, after warm-up (and before the final step's evaluation / save / teardown)
    totals = {}
    for r in rows:
        s = totals.setdefault(
            r["t"], {"t": r["t"], "step": r["step"], "rss": 0, "anon": 0, "fds": 0, "procs": 0, "threads": 0}
        )
        s["rss"] += r["rss_kb"] / 1024
        s["anon"] += r["anon_kb"] / 1024
        s["fds"] += r["fds"]  # noqa: E702
        s["procs"] += 1
        s["threads"] += r["threads"]  # noqa: E702
    after = [s for s in totals.values() if a.warmup <= s["step"] < a.steps]
    print(
        f"\nexit code {launcher.returncode}; {step} steps logged; {len(totals)} samples, {len(after)} after warm-up "
        f"(step >= {a.warmup}); {time.time() - t_start:.0f} s; run and samples in {out_dir}\n"
    )
    if len(after) < 10:
        sys.exit("too few samples after warm-up to judge (run more --steps)")
    first = [s for s in after if s["step"] == after[0]["step"]]
    last = [s for s in after if s["step"] == after[-1]["step"]]
    q = max(1, (a.steps - a.warmup) // 4)  # first and last quarter after warm-up, for the "no upward drift" checks
    early = [s for s in after if s["step"] < a.warmup + q]
    late = [s for s in after if s["step"] >= a.steps - q]
    hours = [s["t"] / 3600 for s in after]
    print(
        f"| {a.script}, {a.nproc} process(es) | at warm-up end (step {first[0]['step']}) | "
        f"at end (step {last[0]['step']}) "
        f"| min / max after warm-up | slope per 100 steps (2nd half) | slope per hour | criterion | verdict |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    verdicts = []
    for key, unit in (("rss", "MB"), ("anon", "MB"), ("fds", ""), ("procs", ""), ("threads", "")):
        ys = [s[key] for s in after]
        per100, per_hour = 100 * slope([s["step"] for s in after], ys), slope(hours, ys)
        half = [s for s in after if s["step"] >= (a.warmup + a.steps) / 2]  # does growth go on, or level off?
        per100_half = 100 * slope([s["step"] for s in half], [s[key] for s in half])
        base = sum(s[key] for s in first) / len(first)
        if key in ("rss", "anon"):
            ok, crit = per100 < 0.01 * base, f"slope < 1% of warm-up value ({0.01 * base:.0f} MB) / 100 steps"
        else:
            ok = abs(per100) < 1 and max(s[key] for s in late) <= max(s[key] for s in early)
            crit = "abs(slope) < 1 / 100 steps and last-quarter max <= first-quarter max"
        verdicts.append(ok)
        print(
            f"| {key} {unit} | {base:.0f} | {sum(s[key] for s in last) / len(last):.0f} | "
            f"{min(ys):.0f} / {max(ys):.0f} "
            f"| {per100:+.2f} ({per100_half:+.2f}) | {per_hour:+.1f} | {crit} | {'PASS' if ok else 'FAIL'} |"
        )
    verdicts.append(not leaked)
    print(
        f"| processes alive after exit | | {len(leaked)} | | | | 0 | "
        f"{'PASS' if not leaked else 'FAIL: ' + ', '.join(leaked)} |"
    )
    # where: per-process RSS slope after warm-up (pids alive for most of it)
    per_pid = {}
    for r in rows:
        if a.warmup <= r["step"] < a.steps:
            per_pid.setdefault((r["pid"], r["name"]), []).append((r["step"], r["rss_kb"] / 1024))
    grow = sorted(
        ((100 * slope(*zip(*v)), k, v[0][1], v[-1][1]) for k, v in per_pid.items() if len(v) > len(after) // 2),
        reverse=True,
    )
    print(
        "\nper process, after warm-up (RSS MB first -> last, slope MB / 100 steps): "
        + "; ".join(f"{name} [{pid}] {r0:.0f} -> {r1:.0f} ({g:+.2f})" for g, (pid, name), r0, r1 in grow[:5])
    )
    short_lived = len([k for k, v in per_pid.items() if len(v) <= len(after) // 2])
    print(f"short-lived processes after warm-up (spawned and gone, e.g. grading subprocesses): {short_lived}")
    if a.heap_probe:
        heap_report(out_dir, t_start, sorted(totals.values(), key=lambda s: s["t"]), a)
    print(
        f"\n{'PASS' if all(verdicts) and launcher.returncode == 0 else 'FAIL'}: exit {launcher.returncode}, "
        f"{sum(verdicts)}/{len(verdicts)} criteria"
    )
    sys.exit(0 if all(verdicts) and launcher.returncode == 0 else 1)


if __name__ == "__main__":
    main()
