"""The CPU testbeds: what a run trains on (model/, train.jsonl, test.jsonl, stats.json here and in fork/) and the
builders that made them (no part of a run): build_arithmetic.py, build_fork.py, and what they share, common.py."""
