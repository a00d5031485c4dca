"""Fixtures of the GPU tests; a test file takes them with ``pytest.mark.usefixtures``."""
import zlib

import pytest
import torch

from tests.gpu import cases as cuda_cases


@pytest.fixture(params=cuda_cases.KERNEL_BACKENDS)
def every_kernel_family(request, monkeypatch):
    """Runs the test against each kernel family the build has for this device (cuda_cases.BACKEND),
    so that the SM80 kernels stay tested on a Hopper GPU next to the SM90 ones."""
    monkeypatch.setattr(cuda_cases, "BACKEND", request.param)
    return request.param


@pytest.fixture
def seeded_by_test_id(request):
    """Inputs drawn from a seed of the test's id, so that a failure reproduces."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
