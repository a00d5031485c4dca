"""Benchmarks of the flashmask kernels (see benchmarks/README.md). Run the scripts directly:
``python benchmarks/bench_kernels.py --help``."""
