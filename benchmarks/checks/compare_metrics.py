"""Whether two runs logged the same metrics: every key of every metrics.jsonl row, except wall times, equal to a
relative tolerance. Prints the largest relative difference and where; exit 1 if any exceeds --rtol.

    python -m benchmarks.checks.compare_metrics runs/a/metrics.jsonl runs/b/metrics.jsonl [--rtol 1e-6] [--allow-new]

--allow-new: metrics that only b logs (a change that adds metrics) are listed, not an error.
"""

import argparse
import json
import math
import sys

SKIPPED = ("time/", "charts/tokens_per_second")  # wall-clock measurements differ run to run


def rows(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def largest_difference(a: list, b: list, allow_new: bool = False, new: set | None = None):
    """(relative difference, step, key, value a, value b) of the worst pair; a ValueError if the rows or keys differ
    (with `allow_new`, keys only b has are added to `new` instead)."""
    if [r["step"] for r in a] != [r["step"] for r in b]:
        raise ValueError(f"different steps logged: {len(a)} rows against {len(b)}")
    worst = (0.0, None, None, None, None)
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith(SKIPPED)}
        other = {k for k in y if not k.startswith(SKIPPED)}
        if allow_new and keys <= other and new is not None:
            new |= other - keys
        elif keys != other:
            raise ValueError(f"step {x['step']}: different metrics: {sorted(keys ^ other)}")
        for k in keys:
            u, v = x[k], y[k]
            if isinstance(u, float) and math.isnan(u) and isinstance(v, float) and math.isnan(v):
                continue
            d = abs(u - v) / max(abs(u), abs(v), 1e-12)
            if d > worst[0]:
                worst = (d, x["step"], k, u, v)
    return worst


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--allow-new", action="store_true", help="metrics only b logs are listed, not an error")
    args = p.parse_args()
    new = set()
    try:
        d, step, key, u, v = largest_difference(rows(args.a), rows(args.b), args.allow_new, new)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    where = f" (step {step}, {key}: {u!r} vs {v!r})" if key else ""
    added = f"; new in b: {', '.join(sorted(new))}" if new else ""
    print(f"{len(rows(args.a))} rows, largest relative difference {d:.2e}{where}{added}")
    sys.exit(0 if d <= args.rtol else 1)
