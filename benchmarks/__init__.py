"""The tools a user runs (python -m benchmarks.<name>): evaluation, comparison, tuning, reports, plots."""
