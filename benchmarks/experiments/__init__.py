"""The experiments behind benchmarks/results/: benchmarks, soaks, probes (python -m benchmarks.experiments.<name>)."""
