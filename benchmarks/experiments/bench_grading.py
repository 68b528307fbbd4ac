"""Reward grading of one GRPO batch: grade() one by one in the main thread vs utils.reward.grade_all's worker pool.

The batch is real MATH-500 reference solutions, every 4th paired with another problem's answer (so graded wrong).
Each repeat grades a fresh slice of the 500 problems serially and with each pool size, in a rotating order, so no
reference answer's parse is cached from an earlier repeat (a training step grades new prompts too). It prints the
median wall time per batch, the ratio to serial, whether every verdict equals serial grading's, and each pool's
start-up cost (its first call: python + math-verify import per worker, in parallel). A 1-worker pool is measured
through one grading thread (grade() outside the main thread uses the same subprocess), since grade_all(..., 1)
grades serially by design. --hogs N runs N busy-loop processes throughout, to show that verdicts do not depend on load.

    python -m benchmarks.experiments.bench_grading --out benchmarks/results/bench_grading.txt  # 1 and 2 workers, 128
    python -m benchmarks.experiments.bench_grading --workers 4 8 --batch 256 --repeats 1 --hogs 8
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from utils.data import load_problems
from utils.reward import grade, grade_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DATA = os.path.join(ROOT, "benchmarks", "data", "math500.jsonl")


def batches(size: int, count: int) -> list[tuple[list[str], list[str]]]:
    """`count` disjoint (texts, answers) batches of MATH-500 solutions (wrapping around past 500), every 4th wrong."""
    solutions = [json.loads(line)["solution"] for line in open(DATA)]
    answers = [p["answer"] for p in load_problems(DATA)]
    out = []
    for b in range(count):
        idx = [(b * size + i) % len(solutions) for i in range(size)]
        wrong = [answers[(k + 1) % len(answers)] for k in idx]  # the next problem's answer
        out.append(([solutions[k] for k in idx], [wrong[i] if i % 4 == 3 else answers[k] for i, k in enumerate(idx)]))
    return out


def parallel_speedup(n: int) -> float:
    """How many times faster n busy-loop processes do n units of work than one process does 1 (about n on an idle
    machine with n cores): the most any n-worker pool can gain here."""
    walls = []
    for count in (1, n):
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", "sum(i * i for i in range(5_000_000))"]) for _ in range(count)]
        for proc in procs:
            proc.wait()
        walls.append(time.perf_counter() - start)
    return n * walls[0] / walls[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="pool sizes to time against serial")
    p.add_argument("--batch", type=int, default=128, help="responses per batch")
    p.add_argument("--repeats", type=int, default=3, help="batches timed per setting (median reported)")
    p.add_argument("--hogs", type=int, default=0, help="busy-loop processes running throughout (load)")
    p.add_argument("--out", default=None, help="also append the report to this file, after the command")
    args = p.parse_args()

    one_thread = ThreadPoolExecutor(1)

    def pool_of_one(texts, answers):  # grade() in a non-main thread grades in its subprocess, as grade_all's threads do
        return list(one_thread.map(grade, texts, answers))

    settings = {"serial": lambda texts, answers: grade_all(texts, answers, 1)}
    for w in args.workers:
        settings[f"pool of {w}"] = pool_of_one if w == 1 else lambda texts, answers, w=w: grade_all(texts, answers, w)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        speedups = ", ".join(f"{w} processes {parallel_speedup(w):.2f}x" for w in args.workers if w > 1)
        startup = {}
        for name, run in settings.items():  # first call: serial imports math-verify here, a pool starts its workers
            start = time.perf_counter()
            run(["\\boxed{1}"] * max(args.workers), ["1"] * max(args.workers))
            startup[name] = time.perf_counter() - start
        seconds, mismatches, statuses = {name: [] for name in settings}, dict.fromkeys(settings, 0), {}  # of serial
        for r, (texts, answers) in enumerate(batches(args.batch, args.repeats)):
            names = list(settings)[r % len(settings) :] + list(settings)[: r % len(settings)]  # rotate the order
            results = {}
            for name in names:
                start = time.perf_counter()
                results[name] = settings[name](texts, answers)
                seconds[name].append(time.perf_counter() - start)
            for name in settings:
                mismatches[name] += sum(x != y for x, y in zip(results[name], results["serial"]))
            for reward, status in results["serial"]:
                key = "right" if reward == 1 else "wrong" if status == "ok" else status
                statuses[key] = statuses.get(key, 0) + 1
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()

    serial = statistics.median(seconds["serial"])
    lines = [
        f"{args.batch} MATH-500 reference solutions per batch (every 4th against a wrong answer), {args.repeats} "
        f"batches per setting, rotating order, {len(os.sched_getaffinity(0))} cores, {args.hogs} busy-loop processes, "
        f"load average {os.getloadavg()[0]:.1f} after; parallel speed-up available for plain CPU work: {speedups}; "
        f"serial verdicts: {statuses}",
        "| setting | batch wall (s, median) | min / max | serial / setting | verdicts differing from serial | "
        "start-up, first call (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, times in seconds.items():
        median = statistics.median(times)
        lines.append(
            f"| {name} | {median:.3f} | {min(times):.3f} / {max(times):.3f} | {serial / median:.2f} | "
            f"{mismatches[name]} | {startup[name]:.2f} |"
        )
    report = "\n".join(lines)
    print(report)
    if args.out:
        command = "python " + shlex.join(["-m", "benchmarks.experiments.bench_grading", *sys.argv[1:]])
        with open(args.out, "a") as f:
            f.write(f"$ {command}\n{report}\n\n")


if __name__ == "__main__":
    main()
