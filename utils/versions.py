"""The oldest torch, transformers and DeepSpeed the code was checked against (README: First GPU run). Standard library
only, so that benchmarks/checks/gpu_smoke.py can check before it imports them."""

import importlib.metadata
import re

MINIMUM_VERSIONS = {"torch": (2, 11), "transformers": (5, 17), "deepspeed": (0, 19, 8)}
"""DeepSpeed before 0.19.8 (0.19.3 and 0.19.6 measured, tests/test_zero3_bf16.py) leaves the output head's share of the
tied embedding's gradient undivided by the accumulation steps when the head runs outside the engine's forward, as
utils/logprobs.py runs it: a wrong gradient whenever a rank accumulates two micro-batches (DeepSpeed #8224's class)."""


def too_old() -> str | None:
    """One line naming the first of MINIMUM_VERSIONS installed in an older release, or None."""
    for name, least in MINIMUM_VERSIONS.items():
        try:
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # its import fails with its own line
            continue
        if tuple(int(x) for x in re.findall(r"\d+", found)[: len(least)]) < least:
            return f"{name} {found} is older than {'.'.join(map(str, least))}, the oldest the code is checked against"
    return None
