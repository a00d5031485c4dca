"""Tests of the CUDA kernels: one GPU and a build with the kernels; they skip cleanly elsewhere."""
