"""When the kernels are missing, the message says that they were not built, why, and how to build them."""
import importlib.util
import re
import sys
import types

import pytest
import torch

import flashmask
from flashmask import _cuda


@pytest.fixture
def not_built(monkeypatch):
    """As if the extension were absent, whatever this machine has."""
    monkeypatch.setattr(_cuda, "_C", None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashmask._C" else real(name, *a))
    _cuda._not_built_reason.cache_clear()
    yield
    _cuda._not_built_reason.cache_clear()


def _with_cuda_home(monkeypatch, home):
    fake = types.ModuleType("torch.utils.cpp_extension")
    fake.CUDA_HOME = home
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", fake)


@pytest.mark.parametrize("torch_cuda,cuda_home,why", [
    (None, None, r"torch \S+ is a CPU-only build"),
    ("12.8", None, r"no CUDA toolkit was found \(no nvcc"),
    ("12.8", "/usr/local/cuda", r"FLASHMASK_BUILD_CUDA=0, or pip's build isolation"),
])
def test_not_built_says_why_and_how(not_built, monkeypatch, torch_cuda, cuda_home, why):
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    _with_cuda_home(monkeypatch, cuda_home)
    msg = _cuda.unavailable_reason()
    assert msg.startswith("the CUDA kernels (flashmask._C) were not built: ")
    assert re.search(why, msg), msg
    assert "pip install --no-build-isolation" in msg and "FLASHMASK_BUILD_CUDA=1" in msg
    assert "partially initialized" not in msg and "cannot import name" not in msg


def test_built_but_not_loading_shows_the_error(monkeypatch):
    monkeypatch.setattr(_cuda, "_C", None)
    monkeypatch.setattr(_cuda, "_IMPORT_ERROR", ImportError("undefined symbol: _ZN3c10"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flashmask._C" else real(name, *a))
    _cuda._not_built_reason.cache_clear()
    try:
        msg = _cuda.unavailable_reason()
    finally:
        _cuda._not_built_reason.cache_clear()
    assert "were built but do not load (undefined symbol: _ZN3c10)" in msg and "--no-build-isolation" in msg


def test_backend_cuda_error_carries_the_reason(not_built, monkeypatch):
    # Past the device check (as on a GPU machine): the error is the not-built reason.
    monkeypatch.setattr(flashmask.attention._checks, "kernel_unsupported_reason", lambda q, k, v: None)
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"backend='cuda' cannot run: the CUDA kernels \(flashmask._C\) were not"):
        flashmask.flashmask_attention(q, q, q, causal=True, backend="cuda")


def test_import_failure_text_is_not_a_circular_import_message():
    if _cuda._C is not None:
        pytest.skip("the extension is built here")
    assert "partially initialized" not in str(_cuda._IMPORT_ERROR)


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_a_gpu_without_device_code_falls_back_saying_why(monkeypatch):
    """An A100 under a build for sm_90 alone: "auto" warns and takes the reference path, "cuda" raises,
    both naming the compute capability, the GPU and the build's targets; the answer is kept per GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    asked = []
    monkeypatch.setattr(_cuda, "_C", types.SimpleNamespace(has_code_for=lambda cc: asked.append(cc) or cc == 90))
    monkeypatch.setattr(_cuda, "_CUDA_TARGETS", ("sm_90a",))
    monkeypatch.setattr(_cuda, "available", lambda: True)
    monkeypatch.setattr(_cuda, "compiled_head_dim_pairs", lambda: ((64, 64),))
    monkeypatch.setattr(_cuda, "compiled_dtypes", lambda: (torch.bfloat16,))
    monkeypatch.setattr(_cuda, "_device_reasons", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100")
    monkeypatch.setattr(flashmask.attention, "_warned", set())
    reason = ("this build has no device code for compute capability 8.0 (NVIDIA A100): it carries sm_90a; "
              "rebuild with FLASHMASK_ARCHS including 80")
    with FakeTensorMode():
        q = torch.empty(1, 8, 4, 64, device="cuda", dtype=torch.bfloat16)
        with pytest.warns(UserWarning, match=re.escape(f"reference path (slow, O(Sq*Sk) memory) because {reason}")):
            assert flashmask.attention.kernel_arch(q, q, q, "auto") is None
        with pytest.raises(RuntimeError, match=re.escape(f"backend='cuda' cannot run: {reason}")):
            flashmask.attention.kernel_arch(q, q, q, "cuda")
    assert asked == [80]
