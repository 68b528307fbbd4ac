"""utils.reward: boxed-answer extraction, math-verify grading on real data, and bounded time on pathological input."""

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, with or without `python -m`

from utils.data import load_problems  # noqa: E402
from utils.reward import TIMEOUT_S, batch_grade, grade, has_boxed, last_boxed, math_reward  # noqa: E402

DATA = ROOT / "benchmarks" / "data"
SLACK_S = 0.5


def read_jsonl(name):
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def nested_frac(depth):
    text = "1"
    for _ in range(depth):
        text = f"\\frac{{{text}}}{{2}}"
    return text


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
    rewards, statuses = batch_grade(["\\boxed{2}", "2", "\\boxed{3}"], ["2", "2", "2"])
    assert rewards == [1.0, 0.0, 0.0] and statuses == ["ok", "no_box", "ok"]


def test_math500_solutions_grade_correct():
    """Each worked MATH-500 solution grades 1.0 against its reference answer; shifted answers grade 0.0."""
    solutions = [row["solution"] for row in read_jsonl("math500.jsonl")]
    answers = [p["answer"] for p in load_problems(str(DATA / "math500.jsonl"))]
    rewards, statuses = batch_grade(solutions, answers)
    assert sum(rewards) / len(rewards) >= 0.99, [a for a, r in zip(answers, rewards) if r < 1]
    assert statuses.count("timeout") + statuses.count("error") == 0
    wrong, _ = batch_grade(solutions, answers[1:] + answers[:1])
    assert sum(wrong) / len(wrong) <= 0.02


def test_gsm8k_worked_answers_grade_correct():
    """Each GSM8K worked answer, its final number boxed, grades 1.0 against the loaded answer ("1,000" included)."""
    texts = [row["answer"] for row in read_jsonl("gsm8k.jsonl")]
    responses = [t.split("####")[0] + f"\\boxed{{{t.split('####')[-1].strip()}}}" for t in texts]
    answers = [p["answer"] for p in load_problems(str(DATA / "gsm8k.jsonl"))]
    rewards, _ = batch_grade(responses, answers)
    assert sum(rewards) / len(rewards) >= 0.99
    wrong, _ = batch_grade(responses, answers[1:] + answers[:1])
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
    assert math_reward("\\boxed{2}", "2") == 1.0  # grading still works after an interrupted one


def test_pathological_other_thread():
    """Outside the main thread grading goes through a subprocess, killed if it overruns: it still returns in time."""
    results = []
    cases = PATHOLOGICAL[:1] + [("\\boxed{2}", "2")]
    thread = threading.Thread(target=lambda: results.extend(_grade_timed([("\\boxed{1}", "1")] + cases)))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    warmup, tower, plain = results  # the first call also starts the worker
    assert warmup[:2] == (1.0, "ok") and plain[:2] == (1.0, "ok")
    assert tower[0] == 0.0 and tower[2] < TIMEOUT_S + SLACK_S + 0.5, tower


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


def test_first_grade_in_a_fresh_process_does_not_pay_the_import_against_its_budget():
    """math-verify's import (~1 s) happens before the timer is armed: a correct first answer is not a timeout."""
    code = "from utils.reward import grade; print(grade('so \\\\boxed{2}', '2', timeout=0.3))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "(1.0, 'ok')", out.stderr[-2000:]
