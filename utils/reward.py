"""Math reward: the response's last \\boxed{} answer checked against the reference with math-verify, in bounded time."""

import contextlib
import functools
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TIMEOUT_S = 1.5
"""CPU-time budget for grading one response (seconds of the grading process's CPU time, so the verdict does not depend
on how busy the machine is; all of its threads count); pathological answers such as 9^{9^{9^{9^9}}} use it all."""
MAX_ANSWER_CHARS = 1000
"""Boxed answers longer than this are graded wrong without parsing (gold answers are far shorter)."""
WORKER_START_TIMEOUT_S = 60.0
"""How long a non-main thread waits for its grading subprocess to start (python + math-verify import)."""
WORKER_SLACK_S = 0.5
"""Extra CPU time a grading subprocess gets over TIMEOUT_S before it is killed (its own timer should fire first)."""
WORKER_HANG_S = 30.0
"""Wall time after which a grading subprocess that has not answered is killed however little CPU time it used."""

STATUSES = ("ok", "no_box", "timeout", "error")
"""grade() statuses: graded (right or wrong), no \\boxed{} answer, out of time, grader exception or unparsable gold."""


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} or \\fbox{...} in text (balanced braces), or None if there is none."""
    boxed, fbox = text.rfind("\\boxed"), text.rfind("\\fbox")
    if max(boxed, fbox) < 0:
        return None
    i = boxed + len("\\boxed") if boxed > fbox else fbox + len("\\fbox")  # just past the command name
    if text.startswith(" ", i):  # "\boxed 5" form
        return text[i + 1 :].split("$")[0].strip() or None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: the response was cut off inside the box


def has_boxed(response: str) -> bool:
    """Whether the response gives a non-empty \\boxed{} final answer (the format the prompt asks for)."""
    content = last_boxed(response)
    return bool(content and content.strip())


class GradeTimeout(BaseException):
    """Raised by our SIGPROF handler; a BaseException so math-verify's `except Exception` cannot swallow it."""


def _on_alarm(signum, frame):
    raise GradeTimeout()


@functools.cache
def _math_verify():
    """Import math-verify lazily (0.3-0.5 s), silencing its one-time 'timeout disabled' warning (we bound the time)."""
    import math_verify
    from math_verify import grader, parser

    parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str):
    """Parse a reference answer once (GRPO grades many samples against the same answer)."""
    mv = _math_verify()
    delimited = re.search(r"(?<!\\)\$", answer) or "\\boxed" in answer  # e.g. OlympiadBench's "$69$,$84$"
    text = answer if delimited else f"\\boxed{{{answer}}}"
    return mv.parse(text, [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()], parsing_timeout=None)


def _verify(content: str, answer: str) -> tuple[float, str]:
    """Grade one extracted boxed answer against the reference, without any timeout of its own."""
    mv = _math_verify()
    gold = _parse_gold(answer)
    if not gold:
        return 0.0, "error"
    pred = mv.parse(
        f"\\boxed{{{content}}}", [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()], parsing_timeout=None
    )
    return float(mv.verify(gold, pred, timeout_seconds=None)), "ok"


def _verify_with_alarm(content: str, answer: str, timeout: float) -> tuple[float, str]:
    """_verify under one CPU-time budget from a profiling interval timer (main thread only); restores any previous one.

    CPU time, not wall time: a loaded machine slows grading down but does not turn right answers into timeouts, so
    the same samples get the same rewards however busy the machine is.
    """
    _math_verify()  # the first import takes ~0.5-1.5 s: not part of any answer's budget
    start = time.process_time()
    previous_handler = signal.signal(signal.SIGPROF, _on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_PROF, max(timeout, 1e-3))  # 0 would disarm
    try:
        try:
            return _verify(content, answer)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)  # if the alarm fires just before this, it is one-shot: caught below
    except GradeTimeout:
        return 0.0, "timeout"
    except Exception:
        return 0.0, "error"
    finally:
        signal.signal(signal.SIGPROF, previous_handler if previous_handler is not None else signal.SIG_DFL)
        if previous_delay > 0:  # someone else's timer was running: re-arm it with what is left of it
            left = max(previous_delay - (time.process_time() - start), 1e-3)
            signal.setitimer(signal.ITIMER_PROF, left, previous_interval)


_local = threading.local()


def _verify_in_worker(content: str, answer: str, timeout: float) -> tuple[float, str]:
    """Outside the main thread signals are unavailable: grade in this thread's own subprocess, killed if it overruns."""
    worker = getattr(_local, "worker", None)
    try:
        if worker is not None and worker.poll() is not None:  # died while idle: replace it, this answer is not to blame
            _stop(worker)
            worker = None
        if worker is None:
            worker = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
            _local.worker = worker
            weakref.finalize(threading.current_thread(), _stop, worker)  # ends with its thread, or at exit
            ready = _readline(worker, WORKER_START_TIMEOUT_S)  # "ready" once math-verify is imported
            if not ready:
                raise (TimeoutError if ready is None else RuntimeError)("grading worker did not start")
        worker.stdin.write(json.dumps([content, answer, timeout]) + "\n")
        reward, status = json.loads(_read_answer(worker, timeout + WORKER_SLACK_S))
        return float(reward), status
    except Exception as e:
        if worker is not None:
            _stop(worker)
            _local.worker = None
        return 0.0, "timeout" if isinstance(e, TimeoutError) else "error"


def _read_answer(proc: subprocess.Popen, cpu_budget: float) -> str:
    """proc's next line; TimeoutError once proc has used cpu_budget more CPU seconds (wall seconds where /proc is
    missing) or WORKER_HANG_S wall seconds without answering, so a busy machine does not turn slow answers into
    timeouts; RuntimeError if proc died."""
    start, start_cpu = time.monotonic(), _cpu_seconds(proc.pid)
    while (line := _readline(proc, 0.1)) is None:  # look at its CPU time every 0.1 s
        cpu = _cpu_seconds(proc.pid)
        used = time.monotonic() - start if cpu is None or start_cpu is None else cpu - start_cpu
        if used > cpu_budget or time.monotonic() - start > WORKER_HANG_S:
            raise TimeoutError("grading worker overran its budget")
    if not line:
        raise RuntimeError("grading worker died")
    return line


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used (Linux /proc), or None where that is not available."""
    try:
        utime, stime = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]
        return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def _stop(proc: subprocess.Popen):
    """Kill a grading subprocess, reap it and close its pipes."""
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            pipe.close()


def _readline(proc: subprocess.Popen, timeout: float) -> str | None:
    """One line from proc's stdout; "" if it closed it (died), None if no line comes within timeout."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else None


def _worker_main():
    """Subprocess loop: read [content, answer, timeout] JSON lines, answer [reward, status]; exits when stdin closes."""
    out, sys.stdout = sys.stdout, sys.stderr  # stray prints from libraries must not corrupt the protocol
    _math_verify()
    print("ready", file=out, flush=True)
    for line in sys.stdin:
        content, answer, timeout = json.loads(line)
        print(json.dumps(_verify_with_alarm(content, answer, timeout)), file=out, flush=True)


def grade(response: str, answer: str, timeout: float = TIMEOUT_S) -> tuple[float, str]:
    """(reward, status): 1.0 if the last \\boxed{} answer equals `answer` per math-verify; status in STATUSES; no raise.

    In the main thread a profiling interval timer (SIGPROF) bounds the CPU time; in other threads a per-thread
    subprocess does the grading under the same timer and is killed if it overruns anyway (its first call also waits
    for it to start, about half a second).
    """
    try:
        content = last_boxed(response)
        if content is None or not content.strip():
            return 0.0, "no_box"
        if len(content) > MAX_ANSWER_CHARS:
            return 0.0, "ok"
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            return _verify_with_alarm(content, str(answer), timeout)
        return _verify_in_worker(content, str(answer), timeout)
    except Exception:
        return 0.0, "error"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k samples is right, from n samples with c right (k <= n):
    1 - C(n - c, k) / C(n, k) (Chen et al. 2021)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def default_grading_workers() -> int:
    """grade_all's worker count for one training process: the CPU cores it may run on, shared among the processes of
    this node (LOCAL_WORLD_SIZE from torchrun, LOCAL_SIZE from the deepspeed launcher), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    return max(1, cores // local_ranks)


@functools.cache
def _grading_threads(workers: int) -> ThreadPoolExecutor:
    """One long-lived thread per grading subprocess: each grades through its own (see _verify_in_worker)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="grading")


os.register_at_fork(after_in_child=_grading_threads.cache_clear)  # a forked child has none of the pool's threads


def grade_all(texts: list[str], answers: list[str], workers: int) -> list[tuple[float, str]]:
    """[grade(text, answer)] for paired texts and answers, in input order, in `workers` grading subprocesses.

    workers <= 1 grades serially in this process (grade() in the calling thread). Otherwise a pool of `workers` threads,
    made on the first call and reused, each drives its own `python utils/reward.py --worker` (a fresh interpreter that
    imports only this file and math-verify, not torch or the caller's script: safe from a multi-threaded distributed
    training process). Each answer gets the same TIMEOUT_S of CPU time from the same timer, in the subprocess; one that
    overruns or crashes is killed and replaced, its answer "timeout" or "error". The subprocesses start on first use
    (~0.5 s each, in parallel) and are killed at interpreter exit.
    """
    pairs = list(zip(texts, answers, strict=True))
    if workers <= 1:
        return [grade(text, answer) for text, answer in pairs]
    return list(_grading_threads(workers).map(lambda pair: grade(*pair), pairs))


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()
