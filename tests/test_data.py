"""utils.data.load_problems: the vendored eval sets, schema detection, answer normalisation and one-line errors."""

import json
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, with or without `python -m`

from utils.data import load_problems, normalize_answer  # noqa: E402

DATA = ROOT / "benchmarks" / "data"

EXPECTED = {  # file: (rows, {index: answer} spot checks)
    "aime24": (30, {0: "204", 1: "113"}),
    "amc23": (40, {0: "27", 15: "-1"}),
    "math500": (500, {0: "\\left( 3, \\frac{\\pi}{2} \\right)", 1: "p - q", 4: "\\text{Evelyn}"}),
    "minerva_math": (272, {0: "1.6", 1: "4.5e33"}),
    "olympiadbench": (675, {0: "2", 1: "\\frac{1}{2 n+2}", 2: "2^{1009}"}),
    "gsm8k": (1319, {0: "18", 2: "70000"}),
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("name", EXPECTED)
def test_vendored_sets_load(name):
    rows, spot = EXPECTED[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no row of these sets is skipped
        problems = load_problems(str(DATA / f"{name}.jsonl"))
    assert len(problems) == rows
    assert all(p["problem"].strip() and p["answer"] and "####" not in p["answer"] for p in problems)
    assert [p["index"] for p in problems] == list(range(rows))
    for index, answer in spot.items():
        assert problems[index]["answer"] == answer


def test_normalize_answer():
    assert normalize_answer("Janet sells 9 eggs.\n#### 1,250") == "1250"
    assert normalize_answer("#### 18") == "18"
    assert normalize_answer("['2']") == "2"
    assert normalize_answer("['$1$', '$2$']") == "1, 2"
    assert normalize_answer(["$2n-2$"]) == "2n-2"
    assert normalize_answer("[0, 1]") == "[0, 1]"  # an interval, not a list
    assert normalize_answer(27.0) == "27" and normalize_answer(2.5) == "2.5"
    assert normalize_answer("so \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert normalize_answer("$69$,$84$") == "$69$,$84$"  # several answers: math-verify reads the $..$ as a set
    assert normalize_answer(None) == ""


def test_explicit_fields_jsonl_and_parquet(tmp_path):
    rows = [{"id": 1, "q": "What is 1+1?", "sol": "1+1=2\n#### 2"}, {"id": 2, "q": "What is 2+2?", "sol": "#### 4"}]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    expected = [
        {"problem": "What is 1+1?", "answer": "2", "index": 0},
        {"problem": "What is 2+2?", "answer": "4", "index": 1},
    ]
    assert load_problems(path, question_field="q", answer_field="sol") == expected
    import pandas as pd

    pd.DataFrame(rows).to_parquet(tmp_path / "x.parquet")
    assert load_problems(str(tmp_path / "x.parquet"), question_field="q", answer_field="sol") == expected
    pd.DataFrame(rows).to_csv(tmp_path / "x.csv", index=False)
    assert load_problems(str(tmp_path / "x.csv"), question_field="q", answer_field="sol") == expected


def test_saved_dataset_folder(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"question": "1+1?", "answer": "#### 2"}]).save_to_disk(str(tmp_path / "saved"))
    assert load_problems(str(tmp_path / "saved")) == [{"problem": "1+1?", "answer": "2", "index": 0}]


def test_answer_from_solution_box(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "solution": "so $x=\\boxed{\\frac{1}{2}}$."}])
    assert load_problems(path)[0]["answer"] == "\\frac{1}{2}"


def test_missing_field_names_it_and_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"id": 1, "problem": "p", "answer": "1"}])
    with pytest.raises(ValueError, match=r"no question field 'foo'; columns: id, problem, answer$"):
        load_problems(path, question_field="foo")
    with pytest.raises(ValueError, match=r"no answer field 'bar'; columns: id, problem, answer$"):
        load_problems(path, answer_field="bar")
    path = write_jsonl(tmp_path / "y.jsonl", [{"id": 1, "text": "p", "answer": "1"}])
    with pytest.raises(
        ValueError, match=r"no question field \(tried problem, question, prompt\); columns: id, text, answer"
    ):
        load_problems(path)
    path = write_jsonl(tmp_path / "z.jsonl", [{"problem": "p", "label": "1"}])
    with pytest.raises(ValueError, match=r"no answer field .*columns: problem, label"):
        load_problems(path)


def test_unreadable_sources(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_problems(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"problem": "p", "answer": \n')
    with pytest.raises(ValueError, match="cannot read dataset .*bad.jsonl"):
        load_problems(str(tmp_path / "bad.jsonl"))
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ValueError, match="unsupported file type '.txt'"):
        load_problems(str(tmp_path / "x.txt"))


def test_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl. is empty"):
        load_problems(str(tmp_path / "empty.jsonl"))
    path = write_jsonl(tmp_path / "blank.jsonl", [{"problem": " ", "answer": "1"}, {"problem": "p", "answer": ""}])
    with pytest.raises(ValueError, match="no row with a non-empty 'problem' and 'answer'"):
        load_problems(path)


def test_rows_without_problem_or_answer_are_skipped_and_counted(tmp_path):
    rows = [{"problem": "a", "answer": "1"}, {"problem": "", "answer": "2"}, {"problem": "c", "answer": None}]
    rows.append({"problem": "d", "answer": "4"})
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    with pytest.warns(UserWarning, match="skipped 2 of 4 rows"):
        problems = load_problems(path)
    assert [(p["problem"], p["answer"], p["index"]) for p in problems] == [("a", "1", 0), ("d", "4", 3)]


@pytest.mark.launches
def test_import_is_cheap():
    """Importing utils.data must not import datasets or math-verify (scripts import it before parsing args)."""
    import subprocess

    code = "import sys, utils.data; print(any(m in sys.modules for m in ('datasets', 'math_verify', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- the ecosystem's formats: verl's parquet (chat-message prompt, reward_model.ground_truth, data_source) and TRL's
# conversational rows (chat-message prompt, solution), built here in exactly those layouts ----
def chat(content, system=None):
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


def write_verl_parquet(path, rows):
    """verl's examples/data_preprocess layout: nested structs and lists, written with pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def verl_row(problem, answer, source="testbed", prompt=None):
    return {
        "data_source": source,
        "prompt": prompt if prompt is not None else chat(problem),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": 0},
    }


def test_verl_parquet_loads_without_field_flags_and_counts_malformed_rows(tmp_path):
    rows = [verl_row("What is 1 + 2?", "3", "GSM8k"), verl_row("What is 2 + 2?", "4", "AMC23")]
    rows.append(verl_row("no user turn", "5", prompt=[{"role": "system", "content": "be brief"}]))
    rows.append(verl_row("no ground truth", None))
    rows.append(verl_row("What is 3 + 3?", "6", prompt=chat("What is 3 + 3?", system="You are a careful solver.")))
    path = write_verl_parquet(tmp_path / "train.parquet", rows)
    with pytest.warns(UserWarning, match="skipped 2 of 5 rows"):
        problems = load_problems(path)
    assert [(p["problem"], p["answer"], p["data_source"], p["index"]) for p in problems] == [
        ("What is 1 + 2?", "3", "GSM8k", 0),
        ("What is 2 + 2?", "4", "AMC23", 1),
        ("What is 3 + 3?", "6", "testbed", 4),
    ]
    assert problems[2]["messages"] == chat("What is 3 + 3?", system="You are a careful solver.")  # kept as given
    named = load_problems(path, question_field="prompt", answer_field="reward_model.ground_truth")
    assert [p["answer"] for p in named] == ["3", "4", "6"]
    with pytest.raises(ValueError, match="no answer field 'rewards.ground_truth'"):
        load_problems(path, answer_field="rewards.ground_truth")


def test_verl_parquet_with_a_plain_string_prompt(tmp_path):
    path = write_verl_parquet(tmp_path / "t.parquet", [verl_row(None, "7", prompt="What is 3 + 4?")])
    assert [(p["problem"], p["answer"], "messages" in p) for p in load_problems(path)] == [
        ("What is 3 + 4?", "7", False)
    ]


def test_trl_conversational_jsonl(tmp_path):
    rows = [{"prompt": chat("What is 5 + 5?"), "solution": "10"}, {"prompt": chat("What is 1 + 1?"), "solution": "2"}]
    rows.append({"prompt": [{"role": "assistant", "content": "hi"}], "solution": "3"})  # no user turn: skipped
    with pytest.warns(UserWarning, match="skipped 1 of 3 rows"):
        problems = load_problems(write_jsonl(tmp_path / "trl.jsonl", rows))
    assert [(p["problem"], p["answer"], p["messages"]) for p in problems] == [
        ("What is 5 + 5?", "10", chat("What is 5 + 5?")),
        ("What is 1 + 1?", "2", chat("What is 1 + 1?")),
    ]


def test_verl_file_gives_the_same_prompts_as_the_plain_jsonl(testbed, tmp_path):
    """The testbed's problems as verl rows (the instruction in the user turn, as verl's preprocessing writes it):
    the same problems, answers and prompt tokens as the plain jsonl, whose instruction is appended by format_prompt."""
    from types import SimpleNamespace

    from utils.data import INSTRUCTION, load_tokenizer, tokenized_prompts

    plain = load_problems(testbed.test_file)[:50]
    path = write_verl_parquet(
        tmp_path / "test.parquet",
        [verl_row(None, p["answer"], prompt=chat(f"{p['problem']}\n{INSTRUCTION}")) for p in plain],
    )
    verl = load_problems(path)
    assert [p["answer"] for p in verl] == [p["answer"] for p in plain]
    assert [p["problem"] for p in verl] == [f"{p['problem']}\n{INSTRUCTION}" for p in plain]
    tokenizer = load_tokenizer(testbed.model_dir)
    args = SimpleNamespace(question_field=None, answer_field=None, max_prompt_length=128)
    assert tokenized_prompts(path, None, tokenizer, args) == tokenized_prompts(
        testbed.test_file, None, tokenizer, args, 50
    )


def test_eval_prompts_sets_caps_and_the_overlap_warning(testbed, tmp_path):
    """A set per file, capped per set; held-out prompts that are training prompts are counted in a warning (none
    between the shipped testbed's train and test files)."""
    from types import SimpleNamespace

    from utils.data import eval_prompts, load_tokenizer, tokenized_prompts

    tokenizer = load_tokenizer(testbed.model_dir)
    args = SimpleNamespace(
        question_field=None,
        answer_field=None,
        max_prompt_length=128,
        eval_num_prompts=10,
        rollout_ranks=0,
        world_size=1,
    )
    train = tokenized_prompts(testbed.train_file, None, tokenizer, args)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overlap: no warning
        rows = eval_prompts([testbed.test_file], tokenizer, args, train)
    assert len(rows) == 10 and {name for _, _, name in rows} == {"test"}
    twice = write_jsonl(tmp_path / "again.jsonl", load_problems(testbed.train_file)[:4])
    with pytest.warns(UserWarning, match="4 of the 14 held-out prompts are also training prompts"):
        rows = eval_prompts([testbed.test_file, twice], tokenizer, args, train)
    assert [name for _, _, name in rows].count("again") == 4
    # beside rollout ranks the trainers evaluate together: each needs a prompt (4 trainers, 3 prompts)
    few = SimpleNamespace(**{**vars(args), "eval_num_prompts": 3, "rollout_ranks": 1, "world_size": 4})
    with pytest.raises(SystemExit, match="3 held-out prompts for 4 trainers; with --rollout-ranks each trainer"):
        eval_prompts([testbed.test_file], tokenizer, few, train)


def test_dapo_prompts_lose_dapos_answer_instruction():
    """benchmarks/reproduce/dapo_boxed.py: the problem between DAPO's opening instruction and its closing reminder."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce" / "dapo_boxed.py"
    spec = importlib.util.spec_from_file_location("dapo_boxed", path)
    dapo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dapo)
    problem = "Let $x$ be a real number.\n\nFind $x^2$ if $x = 3$."
    prompt = (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
        f'{problem}\n\nRemember to put your answer on its own line after "Answer:".'
    )
    assert dapo.problem_text(prompt) == (problem, True)
    assert dapo.problem_text(problem) == (problem, False)  # no instruction: unchanged, counted
