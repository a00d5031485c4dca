"""Benchmarks of the flashmask kernels (see benchmarks/README.md). Run the scripts as modules from the
checkout root: ``python -m benchmarks.bench_kernels --help``."""
