"""The tools a user runs (python -m benchmarks.<name>): evaluation, comparison, reports, plots, the GPU smoke test."""
