"""utils.reward: boxed-answer extraction, math-verify grading on real data, and bounded time on pathological input."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, with or without `python -m`

from testbed.common import read_jsonl  # noqa: E402
from utils.data import load_problems  # noqa: E402
from utils.reward import (  # noqa: E402
    TIMEOUT_S,
    WORKER_HANG_S,
    WORKER_SLACK_S,
    default_grading_workers,
    grade,
    grade_all,
    has_boxed,
    last_boxed,
)

DATA = ROOT / "benchmarks" / "data"
SLACK_S = 0.5


def nested_frac(depth):
    text = "1"
    for _ in range(depth):
        text = f"\\frac{{{text}}}{{2}}"
    return text


def graded(responses: list, answers: list) -> tuple:
    """The rewards and the statuses of grade_all in this thread (as workers 1, the scripts' serial path)."""
    rewards, statuses = zip(*grade_all(responses, answers, 1))
    return list(rewards), list(statuses)


def test_last_boxed():
    assert last_boxed("so \\boxed{1} then \\boxed{\\frac{a}{b}}.") == "\\frac{a}{b}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert last_boxed("$\\boxed 5$") == "5"
    assert last_boxed("no answer") is None
    assert last_boxed("cut off \\boxed{\\frac{1}{2") is None
    assert has_boxed("\\boxed{3}") and not has_boxed("\\boxed{ }") and not has_boxed("3")


def test_grade_statuses():
    assert grade("The answer is \\boxed{\\frac{1}{2}}.", "0.5") == (1.0, "ok")
    assert grade("\\boxed{27}", "27.0") == (1.0, "ok")
    assert grade("\\boxed{3}", "4") == (0.0, "ok")
    assert grade("The answer is 4.", "4") == (0.0, "no_box")  # the prompt asks for \boxed{}
    assert grade(None, "4") == (0.0, "error")
    assert grade("\\boxed{1, 3, 5}", "1,3,5")[0] == 1.0 and grade("\\boxed{1}", "1,3,5")[0] == 0.0
    rewards, statuses = graded(["\\boxed{2}", "2", "\\boxed{3}"], ["2", "2", "2"])
    assert rewards == [1.0, 0.0, 0.0] and statuses == ["ok", "no_box", "ok"]


def test_math500_solutions_grade_correct():
    """Each worked MATH-500 solution grades 1.0 against its reference answer; shifted answers grade 0.0."""
    solutions = [row["solution"] for row in read_jsonl(DATA / "math500.jsonl")]
    answers = [p["answer"] for p in load_problems(str(DATA / "math500.jsonl"))]
    rewards, statuses = graded(solutions, answers)
    assert sum(rewards) / len(rewards) >= 0.99, [a for a, r in zip(answers, rewards) if r < 1]
    assert statuses.count("timeout") + statuses.count("error") == 0
    wrong, _ = graded(solutions, answers[1:] + answers[:1])
    assert sum(wrong) / len(wrong) <= 0.02


def test_gsm8k_worked_answers_grade_correct():
    """Each GSM8K worked answer, its final number boxed, grades 1.0 against the loaded answer ("1,000" included)."""
    texts = [row["answer"] for row in read_jsonl(DATA / "gsm8k.jsonl")]
    responses = [t.split("####")[0] + f"\\boxed{{{t.split('####')[-1].strip()}}}" for t in texts]
    answers = [p["answer"] for p in load_problems(str(DATA / "gsm8k.jsonl"))]
    rewards, _ = graded(responses, answers)
    assert sum(rewards) / len(rewards) >= 0.99
    wrong, _ = graded(responses, answers[1:] + answers[:1])
    assert sum(wrong) / len(wrong) <= 0.02


PATHOLOGICAL = [
    ("\\boxed{9^{9^{9^{9^9}}}}", "1"),
    ("\\boxed{1}", "9^{9^{9^{9^9}}}"),
    (f"\\boxed{{{nested_frac(300)}}}", "1"),
    ("x" * 100_000 + "\\boxed{" + "9" * 100_000 + "}", "1"),
    ("{" * 50_000 + "\\boxed{" + "{" * 50_000, "1"),
]


def _grade_timed(cases, clock=time.monotonic):
    """[(reward, status, seconds of `clock`)] for each (response, answer)."""
    out = []
    for response, answer in cases:
        start = clock()
        reward, status = grade(response, answer)
        out.append((reward, status, clock() - start))
    return out


@pytest.mark.parametrize("response,answer", PATHOLOGICAL, ids=["tower", "tower_gold", "nested_frac", "huge", "braces"])
def test_pathological_main_thread(response, answer):
    ((reward, status, seconds),) = _grade_timed([(response, answer)], time.process_time)  # the budget is CPU time
    assert reward == 0.0 and seconds < TIMEOUT_S + SLACK_S, (status, seconds)
    assert grade("\\boxed{2}", "2")[0] == 1.0  # grading still works after an interrupted one


@pytest.mark.launches
def test_pathological_other_thread():
    """Outside the main thread grading goes through a subprocess under the same CPU-time budget: it still returns."""
    results = []
    cases = PATHOLOGICAL[:1] + [("\\boxed{2}", "2")]
    thread = threading.Thread(target=lambda: results.extend(_grade_timed([("\\boxed{1}", "1")] + cases)))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    warmup, tower, plain = results  # the first call also starts the worker
    assert warmup[:2] == (1.0, "ok") and plain[:2] == (1.0, "ok")
    assert tower[:2] == (0.0, "timeout") and tower[2] < WORKER_HANG_S, tower  # ~TIMEOUT_S of wall time when idle


def test_restores_caller_alarm():
    """A caller's own SIGPROF handler and CPU-time timer survive a grade() call that times out."""
    fired = []
    previous = signal.signal(signal.SIGPROF, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_PROF, 30.0)
        assert grade("\\boxed{9^{9^{9^{9^9}}}}", "1")[1] == "timeout"
        left, _ = signal.setitimer(signal.ITIMER_PROF, 0.05)
        assert 25.0 < left < 30.0
        start = time.process_time()
        while not fired and time.process_time() - start < 2:
            pass  # burn CPU time until the caller's timer fires
        assert fired
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


@pytest.mark.launches
def test_first_grade_in_a_fresh_process_does_not_pay_the_import_against_its_budget():
    """math-verify's import (~1 s) happens before the timer is armed: a correct first answer is not a timeout."""
    code = "from utils.reward import grade; print(grade('so \\\\boxed{2}', '2', timeout=0.3))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "(1.0, 'ok')", out.stderr[-2000:]


TOWER = "\\boxed{9^{9^{9^{9^9}}}}"
MIXED = [  # (response, answer, verdict): every status, interleaved across workers
    ("so \\boxed{\\frac{1}{2}}.", "0.5", (1.0, "ok")),
    ("\\boxed{3}", "4", (0.0, "ok")),
    ("The answer is 4.", "4", (0.0, "no_box")),
    (TOWER, "1", (0.0, "timeout")),
    ("\\boxed{\\frac{}{}}", "2", (0.0, "ok")),  # unparsable answer: wrong
    ("\\boxed{3}", "", (0.0, "error")),  # unparsable gold
    ("", "1", (0.0, "no_box")),
    ("x" * 100_000 + " \\boxed{27}", "27.0", (1.0, "ok")),  # long text
    ("\\boxed{1, 3, 5}", "1,3,5", (1.0, "ok")),
]
TEXTS, ANSWERS, VERDICTS = (list(column) for column in zip(*MIXED))


def worker_pids(parent=None):
    """Live grading subprocesses (`utils/reward.py --worker`) whose parent is `parent` (default: this process)."""
    parent, pids = parent or os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            if int(ppid) == parent and state != "Z" and b"--worker" in (stat.parent / "cmdline").read_bytes():
                pids.add(int(stat.parent.name))
    return pids


@pytest.mark.launches
def test_grade_all_matches_serial_and_reuses_its_workers():
    """2 workers give serial grade()'s verdicts in order; the timeout is the worker's own timer (it is not replaced);
    a second call reuses the same processes, which did not import torch."""
    assert [grade(text, answer) for text, answer in zip(TEXTS, ANSWERS)] == VERDICTS
    assert grade_all(TEXTS, ANSWERS, workers=2) == VERDICTS
    pool = worker_pids()
    assert len(pool) == 2
    assert grade_all(TEXTS[:3] * 4, ANSWERS[:3] * 4, workers=2) == VERDICTS[:3] * 4
    assert worker_pids() == pool
    for pid in pool:
        assert "/torch/" not in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.launches
def test_grade_all_replaces_a_killed_worker():
    """A worker killed mid-answer gives "error" for that answer and is replaced (and reaped); one killed while idle is
    replaced before it is given an answer, which grades as usual."""
    grade_all(["\\boxed{1}"] * 2, ["1"] * 2, workers=2)  # warm: both workers running
    before = worker_pids()
    killer = threading.Timer(0.5, lambda: [os.kill(pid, signal.SIGKILL) for pid in before])
    killer.start()
    assert grade_all([TOWER] * 2, ["1"] * 2, workers=2) == [(0.0, "error")] * 2
    killer.join()
    assert grade_all(["\\boxed{2}"] * 4, ["2"] * 4, workers=2) == [(1.0, "ok")] * 4
    replaced = worker_pids()
    assert len(replaced) == 2 and not replaced & before
    assert not any(Path(f"/proc/{pid}").exists() for pid in before)  # reaped, not zombies
    for pid in replaced:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)  # let them die while idle
    assert grade_all(["\\boxed{2}", "\\boxed{3}"] * 2, ["2"] * 4, workers=2) == [(1.0, "ok"), (0.0, "ok")] * 2
    assert len(worker_pids()) == 2


@pytest.mark.launches
def test_grade_all_waits_for_a_worker_that_gets_no_cpu():
    """The budget is the worker's CPU time, not wall time: a worker kept off the CPU (stopped) for longer than the
    budget still answers, as a slow machine would make it, and keeps its verdict."""
    grade_all(["\\boxed{1}"] * 2, ["1"] * 2, workers=2)  # warm
    pids = worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(TIMEOUT_S + WORKER_SLACK_S + 0.5, lambda: [os.kill(pid, signal.SIGCONT) for pid in pids])
    resume.start()
    start = time.monotonic()
    assert grade_all(["\\boxed{2}", "\\boxed{3}"], ["2", "2"], workers=2) == [(1.0, "ok"), (0.0, "ok")]
    assert time.monotonic() - start > TIMEOUT_S + WORKER_SLACK_S and worker_pids() == pids
    resume.join()


def test_grade_all_one_worker_is_serial():
    before = worker_pids()
    for workers in (1, 0):
        assert grade_all(TEXTS[4:], ANSWERS[4:], workers) == VERDICTS[4:]
    assert worker_pids() == before  # no subprocess: grade() in this (main) thread


@pytest.mark.launches
def test_grade_all_workers_end_with_the_interpreter():
    """At exit the workers are killed and reaped, and the exit does not wait on them."""
    code = "import sys; from utils.reward import grade_all; print(grade_all(['\\\\boxed{1}'] * 2, ['1'] * 2, 2))"
    code += "; sys.stdin.read()  # until the test closes it"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "[(1.0, 'ok'), (1.0, 'ok')]"
    workers = worker_pids(proc.pid)
    assert len(workers) == 2
    proc.stdin.close()
    assert proc.wait(timeout=10) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)


def test_default_grading_workers(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_grading_workers() == cores
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher's name
    assert default_grading_workers() == max(1, cores // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))  # torchrun's; more ranks than cores
    assert default_grading_workers() == 1


@pytest.mark.launches
def test_grade_all_in_a_forked_child():
    """A child forked after the pool started (its threads are not copied) makes its own pool rather than hang, and
    the parent keeps grading after the child exits."""
    code = """if True:
        import os
        from utils.reward import grade_all
        grade_all(['\\\\boxed{1}'] * 2, ['1'] * 2, 2)
        if os.fork() == 0:
            print(grade_all(['\\\\boxed{2}'] * 2, ['2'] * 2, 2), flush=True)
            raise SystemExit  # a normal exit: atexit runs in the child too
        os.wait()
        print(grade_all(['\\\\boxed{1}', '\\\\boxed{3}'], ['1', '1'], 2))
    """
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:2] == ["[(1.0, 'ok'), (1.0, 'ok')]", "[(1.0, 'ok'), (0.0, 'ok')]"], out.stderr[
        -2000:
    ]
