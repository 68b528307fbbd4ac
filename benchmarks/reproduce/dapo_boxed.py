"""DAPO-Math-17k with DAPO's "Answer: $Answer" instruction taken out of each problem, as a .jsonl the scripts read.

The Cov authors (PRIME-RL/Entropy-Mechanism-of-RL, README) trained on DAPO-Math with prompts rewritten to ask for
\\boxed{} (their file is not published); open-r1/DAPO-Math-17k-Processed keeps DAPO's own user turn, whose
instruction (the last line "Answer: ...") contradicts ours (utils.data.INSTRUCTION: \\boxed{}). This keeps the problem
text between DAPO's opening instruction and its closing reminder, so that ours is the only one:

    python -m benchmarks.reproduce.dapo_boxed --output runs/data/dapo_math_17k_boxed.jsonl
"""

import argparse
import json
import os
import re

OPENING = re.compile(r"^Solve the following math problem step by step\..*?\n\n", re.S)
CLOSING = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$")


def problem_text(prompt: str) -> tuple[str, bool]:
    """The problem of a DAPO user turn without DAPO's instructions, and whether both were found (else unchanged)."""
    opening, closing = OPENING.search(prompt), CLOSING.search(prompt)
    if not (opening and closing):
        return prompt, False
    return prompt[opening.end() : closing.start()].strip(), True


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="open-r1/DAPO-Math-17k-Processed")
    parser.add_argument("--config", default="en")
    parser.add_argument("--output", required=True)
    a = parser.parse_args()
    from datasets import load_dataset

    rows, unchanged = load_dataset(a.dataset, a.config, split="train"), 0
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    with open(a.output, "w") as f:
        for row in rows:
            problem, found = problem_text(row["prompt"])
            unchanged += not found
            f.write(json.dumps({"problem": problem, "answer": row["solution"]}) + "\n")
    print(f"{len(rows)} problems -> {a.output} ({unchanged} without DAPO's instruction, kept as they were)")
