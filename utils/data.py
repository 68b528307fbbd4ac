"""Load math problems from the hub or local files and turn them into prompts."""

import ast
import functools
import os
import re
import warnings

import numpy as np

from .reward import last_boxed

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def format_prompt(problem: str | list, tokenizer) -> str:
    """The prompt text for one problem: a plain-text problem with the instruction appended, or a dataset's own chat
    messages as given ([{"role", "content"}], verl and TRL conversational rows), through the tokenizer's chat template
    when it has one, else a plain Q/A frame."""
    messages = problem if isinstance(problem, list) else [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(f"Question: {m['content']}" for m in messages if m["role"] == "user") + "\nAnswer:"


QUESTION_FIELDS = ("problem", "question", "prompt")
"""Columns tried, in order, for the problem (a text, or chat messages [{"role", "content"}] with a user turn)."""
ANSWER_FIELDS = ("answer", "final_answer", "reward_model.ground_truth")
"""Fields tried, in order, for the reference answer ("a.b": key b of the dict in column a, verl's layout); failing
those, the last \\boxed{} of "solution" (or the whole of a one-line solution, as in TRL's datasets)."""
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""Local file extensions and the `datasets` builder that reads them."""


def _read(source: str, split: str | None):
    """A `datasets.Dataset` from a local file, a local dataset folder, or a hub id (optionally "id:config")."""
    import datasets  # lazy: importing this module stays cheap

    source = os.path.expanduser(source)
    ext = os.path.splitext(source)[1].lower()
    if os.path.isfile(source) and ext not in FILE_FORMATS:
        raise ValueError(f"dataset {source!r}: unsupported file type {ext!r}; use one of {', '.join(FILE_FORMATS)}")
    if not os.path.exists(source) and (ext in FILE_FORMATS or source.startswith((".", "/"))):
        raise ValueError(f"dataset {source!r}: no such file")
    if os.path.isfile(source) and os.path.getsize(source) == 0:
        raise ValueError(f"dataset {source!r} is empty")
    try:
        if os.path.isfile(source):
            return datasets.load_dataset(FILE_FORMATS[ext], data_files=source, split="train")
        if any(os.path.isfile(os.path.join(source, f)) for f in ("state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(source)  # a folder written by save_to_disk
            return ds[split or "train"] if isinstance(ds, datasets.DatasetDict) else ds
        if os.path.isdir(source):  # data files or a loading script
            return datasets.load_dataset(source, split=split or "train")
        name, _, config = source.partition(":")  # e.g. "openai/gsm8k:main"
        return datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as e:
        cause = e
        while cause.__cause__ is not None:  # datasets wraps the useful error (e.g. a JSON parse error) in a generic one
            cause = cause.__cause__
        reason = (str(cause).strip().splitlines() or [""])[0]
        raise ValueError(f"cannot read dataset {source!r}: {type(cause).__name__}: {reason}") from e


def _pick_field(
    source: str, columns: list[str], kind: str, named: str | None, candidates: tuple[str, ...]
) -> str | None:
    """The field to read: the named one (whose column must exist; "a.b" names key b of column a's dicts) or the
    first candidate whose column is present (None if none is)."""
    if named is not None and named.split(".")[0] not in columns:
        raise ValueError(f"dataset {source!r} has no {kind} field {named!r}; columns: {', '.join(columns)}")
    return named or next((c for c in candidates if c.split(".")[0] in columns), None)


def _values(ds, field: str) -> list:
    """Every row's value of a field; "a.b" is key b of column a's dicts (None where a row has no such key)."""
    column, *keys = field.split(".")
    values = ds[column]
    for key in keys:
        values = [v.get(key) if isinstance(v, dict) else None for v in values]
    return values


def _problem(value) -> str | list:
    """A problem text, or chat messages with a user turn; "" for anything else (a malformed row, skipped)."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value):
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
        return messages if any(m["role"] == "user" and m["content"] for m in messages) else ""
    return ""


def normalize_answer(value) -> str:
    """The final answer in a raw answer cell: lists joined, GSM8K "#### x" -> x, last \\boxed{} kept, outer $..$ off."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():  # AMC23 stores 27.0
        value = int(value)
    if isinstance(value, str) and value.strip().startswith("["):  # OlympiadBench's "['2']"
        try:
            parsed = ast.literal_eval(value.strip())
            if isinstance(parsed, list) and all(isinstance(x, str) for x in parsed):
                value = parsed  # only lists of strings: "[0, 1]" is an interval, not a list
        except (ValueError, SyntaxError):
            pass
    if isinstance(value, (list, tuple)):
        return ", ".join(a for a in map(normalize_answer, value) if a)
    text = str(value).strip()
    if "####" in text:  # GSM8K: worked solution, then "#### 1,000"
        text = text.split("####")[-1].strip()
        if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
            text = text.replace(",", "")
    elif (boxed := last_boxed(text)) is not None:
        text = boxed.strip()
    if re.fullmatch(r"\$[^$]*\$", text):
        text = text[1:-1].strip()
    return text


def load_problems(
    source: str, split: str | None = None, question_field: str | None = None, answer_field: str | None = None
) -> list[dict]:
    """[{"problem", "answer", "index"[, "messages"][, "data_source"]}] from a local .jsonl/.json/.parquet/.csv, a saved
    dataset folder, or a hub id: plain rows, verl's (a chat-message `prompt`, `reward_model.ground_truth`,
    `data_source`) and TRL's conversational ones (a chat-message `prompt`, `solution` or `answer`).

    Fields are detected when not named (problem/question/prompt; answer/final_answer/reward_model.ground_truth/last
    \\boxed{} of solution), and answers are normalised either way (normalize_answer). A chat-message problem keeps its
    messages, used as the prompt as they are (format_prompt). `split` picks a hub or saved split (default "train"); a
    single local file is its own split. Rows with an empty problem or answer are skipped with one warning; every
    other problem is a one-line ValueError.
    """
    ds = _read(source, split)
    columns = list(ds.column_names)
    q_field = _pick_field(source, columns, "question", question_field, QUESTION_FIELDS)
    if q_field is None:
        tried = ", ".join(QUESTION_FIELDS)
        raise ValueError(f"dataset {source!r} has no question field (tried {tried}); columns: {', '.join(columns)}")
    a_field = _pick_field(source, columns, "answer", answer_field, ANSWER_FIELDS)
    if a_field is not None:
        answers = [normalize_answer(a) for a in _values(ds, a_field)]
    elif "solution" in columns:  # e.g. Minerva math: the answer lives only in the worked solution's \boxed{}
        solutions = ["\n".join(s) if isinstance(s, list) else s or "" for s in ds["solution"]]
        one_line = [s.strip() if "\n" not in s.strip() else "" for s in solutions]  # TRL's: the bare answer
        answers = [(last_boxed(s) or one).strip() for s, one in zip(solutions, one_line)]
    else:
        tried = ", ".join(ANSWER_FIELDS + ("solution",))
        raise ValueError(f"dataset {source!r} has no answer field (tried {tried}); columns: {', '.join(columns)}")
    problems = [_problem(q) for q in _values(ds, q_field)]
    sources = ds["data_source"] if "data_source" in columns else [None] * len(problems)
    rows = []
    for i, (q, a, data_source) in enumerate(zip(problems, answers, sources)):
        if q and a:
            row = {"problem": q, "answer": a, "index": i} if isinstance(q, str) else {"answer": a, "index": i}
            if isinstance(q, list):  # chat messages: the problem is the last user turn, the prompt the messages
                row["problem"], row["messages"] = next(m["content"] for m in reversed(q) if m["role"] == "user"), q
            rows.append({**row, "data_source": data_source} if data_source else row)
    if not rows:
        fields = f"{q_field!r} and {a_field or 'solution'!r}"
        raise ValueError(f"dataset {source!r} has no row with a non-empty {fields} ({len(problems)} rows)")
    if len(rows) < len(problems):
        skipped = len(problems) - len(rows)
        message = f"dataset {source!r}: skipped {skipped} of {len(problems)} rows with an empty problem or answer"
        message += " (or a malformed one: chat messages without a user turn, a dict without the answer key)"
        warnings.warn(message, stacklevel=2)
    return rows


def check_model(args) -> None:
    """Before anything loads: --model-name-or-path is a model directory or a hub id whose config loads, and the
    context (--max-prompt-length + --max-response-length) fits the model's max_position_embeddings; else one line."""
    from transformers import AutoConfig

    name = args.model_name_or_path
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        if os.path.isdir(os.path.expanduser(name)):
            raise SystemExit(f"error: --model-name-or-path {name}: not a model directory ({str(e).splitlines()[0]})")
        looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1
        why = "not a valid hub id" if looks_local else "no model of that id on the hub, or the hub cannot be reached"
        raise SystemExit(f"error: --model-name-or-path {name}: no such local directory, and {why}")
    positions = getattr(config, "max_position_embeddings", None)
    context = args.max_prompt_length + args.max_response_length
    if positions is not None and context > positions:
        raise SystemExit(
            f"error: --max-prompt-length {args.max_prompt_length} + --max-response-length {args.max_response_length} "
            f"= {context} tokens exceeds the model's max_position_embeddings ({positions})"
        )


def load_tokenizer(name_or_path: str):
    """The policy's tokenizer, padding with its end-of-sequence token when it has no pad token."""
    from transformers import AutoTokenizer  # lazy: importing this module stays cheap

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _script_problems(source: str, split: str | None, args) -> list[dict]:
    """load_problems with the script's --question-field / --answer-field; bad input is a one-line "error:" exit."""
    try:
        return load_problems(source, split, args.question_field, args.answer_field)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def _prompt_ids(problems: list, tokenizer) -> list[list[int]]:
    """Each problem's prompt token ids, in one batch call (a fast tokenizer encodes a batch in one pass: on the
    testbed's 4000 prompts 0.36 CPU-s instead of 0.65 one by one, the same ids)."""
    texts = [format_prompt(p.get("messages", p["problem"]), tokenizer) for p in problems]
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def tokenized_prompts(source: str, split: str | None, tokenizer, args, limit: int | None = None):
    """([(prompt token ids, answer)], number dropped): the first `limit` problems of a source as prompts, those longer
    than --max-prompt-length tokens dropped and counted, never truncated (args: the script's --question-field,
    --answer-field, --max-prompt-length). Bad input is a one-line "error:" exit."""
    problems = _script_problems(source, split, args)[:limit]
    rows = list(zip(_prompt_ids(problems, tokenizer), [p["answer"] for p in problems]))
    kept = [r for r in rows if len(r[0]) <= args.max_prompt_length]
    if not kept:
        raise SystemExit(f"error: {source}: every prompt is longer than --max-prompt-length {args.max_prompt_length}")
    return kept, len(rows) - len(kept)


def eval_prompts(sources, tokenizer, args, train_data=()) -> list[tuple[list[int], str, str]]:
    """(prompt token ids, answer, set name) of every held-out problem of `sources`. A set is one file (named by its
    stem) or, where its rows carry a `data_source` (verl's dev files mix GSM8k and AMC23 rows), one data source; each
    set is capped at --eval-num-prompts problems, then its prompts over --max-prompt-length dropped. Held-out prompts
    that are also training prompts (`train_data`: (prompt ids, answer) rows) are counted in a warning."""
    rows, names = [], set()
    for source in sources:
        problems = _script_problems(source, None, args)
        stem = os.path.splitext(os.path.basename(source.rstrip("/").split(":")[0]))[0]
        sets, before = {}, len(rows)
        for p in problems:
            sets.setdefault(str(p.get("data_source") or stem).replace("/", "_"), []).append(p)
        for name, members in sets.items():
            unique = name if name not in names else f"{name}_{len(names)}"  # two files of one stem: both kept
            names.add(unique)
            members = members[: args.eval_num_prompts]
            prompts = [(ids, p["answer"], unique) for ids, p in zip(_prompt_ids(members, tokenizer), members)]
            rows += [r for r in prompts if len(r[0]) <= args.max_prompt_length]
        if len(rows) == before:
            raise SystemExit(
                f"error: {source}: every prompt is longer than --max-prompt-length {args.max_prompt_length}"
            )
    trainers = args.world_size if args.rollout_ranks else 0
    if 0 < len(rows) < trainers:  # the trainers ask the rollout ranks together: one without a prompt would not ask
        raise SystemExit(
            f"error: --eval-dataset: {len(rows)} held-out prompts for {trainers} trainers; with --rollout-ranks each "
            "trainer needs one (raise --eval-num-prompts or add prompts)"
        )
    trained = {tuple(ids) for ids, _ in train_data}
    if overlap := sum(tuple(ids) in trained for ids, _, _ in rows):
        message = f"{overlap} of the {len(rows)} held-out prompts are also training prompts: not a held-out evaluation"
        warnings.warn(message, stacklevel=2)
    return rows


def stream_index(position: int, seed: int, n_prompts: int) -> int:
    """The dataset index at `position` of the prompt stream: a seeded permutation per epoch, a pure function of the
    position (so resume needs only the position, and the step's first position is all a checkpoint records)."""
    epoch, offset = divmod(position, n_prompts)
    return int(_epoch_order(seed, epoch, n_prompts)[offset])


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n_prompts: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_prompts)


def rank_slots(args, rank: int, world_size: int) -> list:
    """This rank's positions in a step's batch of P prompts: its slice of every mini-batch m, whose positions are
    [m P/M, (m+1) P/M) whatever the world size, so the optimizer sees the same samples on any layout."""
    P, M = args.num_prompts_per_step, args.num_mini_batches
    per_rank = P // (M * world_size)
    return [j for m in range(M) for j in range(m * P // M + rank * per_rank, m * P // M + (rank + 1) * per_rank)]


def step_prompt_indices(step: int, args, n_prompts: int, rank: int, world_size: int) -> list:
    """(global position in the step's batch, dataset index) of this rank's prompts at `step` when every step takes P
    prompts (without --filter-groups): the stream's positions [step P, (step + 1) P)."""
    first = step * args.num_prompts_per_step
    return [(j, stream_index(first + j, args.seed, n_prompts)) for j in rank_slots(args, rank, world_size)]
