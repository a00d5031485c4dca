"""Tests of the development tools in tools/ (no GPU needed)."""
