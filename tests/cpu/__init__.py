"""Tests that run on any machine (the reference path, masks, integrations, examples, benchmarks on the CPU)."""
