"""The developers' checks (python -m benchmarks.checks.<name>): the GPU smoke test, the offline GPU wheelhouse, the
same-metrics comparison of two checkouts."""
