"""Tests across two or more GPUs (NCCL); they skip cleanly with fewer."""
