"""The oldest torch and transformers the code was checked against (README: First GPU run). Standard library only, so
that benchmarks/gpu_smoke.py can check before it imports either."""

import importlib.metadata
import re

MINIMUM_VERSIONS = {"torch": (2, 11), "transformers": (5, 17)}


def too_old() -> str | None:
    """One line naming the first of MINIMUM_VERSIONS installed in an older release, or None."""
    for name, least in MINIMUM_VERSIONS.items():
        found = importlib.metadata.version(name)
        if tuple(int(x) for x in re.findall(r"\d+", found)[:2]) < least:
            return f"{name} {found} is older than {'.'.join(map(str, least))}, the oldest the code is checked against"
    return None
