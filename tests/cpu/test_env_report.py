"""``python -m flashmask``: the environment report, without kernels and with a stand-in for them."""
import subprocess
import sys
import types

import torch

import flashmask
from flashmask import _cuda, env_report
from tests import ROOT


def test_module_runs_and_says_what_runs_here():
    out = subprocess.run([sys.executable, "-m", "flashmask"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith(f"flashmask {flashmask.__version__} at ")
    assert f"torch {torch.__version__} (CUDA {torch.version.cuda})" in text
    assert "transformers " in text
    if not torch.cuda.is_available():
        assert "GPU: none visible" in text
    if not _cuda.available():
        # Without the kernels the report gives the same reason a fallback warning gives.
        assert "CUDA kernels: not available" in text and _cuda.unavailable_reason() in text
        assert "reference path" in text


def test_environment_variables_that_change_calls_are_shown(monkeypatch):
    monkeypatch.setenv("FLASHMASK_ARCH", "80")
    monkeypatch.delenv("FLASHMASK_MASK_CACHE", raising=False)
    assert "environment: FLASHMASK_ARCH=80" in env_report.report()
    monkeypatch.delenv("FLASHMASK_ARCH")
    assert "environment:" not in env_report.report()


def _fake_kernels(monkeypatch, cc, gpus=1):
    """A build of (64, 64), (192, 192) and (192, 128) for sm80 and sm90, on `gpus` GPUs of compute
    capability cc, whose registry knows no deterministic backward at (192, 128)."""
    calls = []

    def selected_arch(d, dtype, cc_, arch, slot, dv):
        calls.append((d, dtype, cc_, arch, slot, dv))
        if (d, dv, slot) == (192, 128, "bwd_deterministic"):
            raise RuntimeError("flashmask: no kernel for this call\nsecond line")
        return 90 if cc_ >= 90 else 80

    fake = types.SimpleNamespace(__file__="/site/flashmask/_C.so", selected_arch=selected_arch,
                                 has_code_for=lambda cc_: cc_ // 10 == 8 or cc_ == 90)
    monkeypatch.setattr(_cuda, "_C", fake)
    monkeypatch.setattr(_cuda, "_CUDA_TARGETS", ("sm_80", "sm_90a"))
    monkeypatch.setattr(_cuda, "compiled_head_dim_pairs", lambda: ((64, 64), (192, 128), (192, 192)))
    monkeypatch.setattr(_cuda, "compiled_dtypes", lambda: (torch.float16, torch.bfloat16))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: divmod(cc, 10))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"Fake GPU {i}")
    return calls


def test_the_kernel_family_of_each_call_on_each_gpu(monkeypatch):
    calls = _fake_kernels(monkeypatch, cc=90, gpus=2)
    text = env_report.report()
    assert "GPU 0: Fake GPU 0, compute capability 9.0" in text and "GPU 1: Fake GPU 1" in text
    assert "CUDA kernels: built (/site/flashmask/_C.so)" in text
    assert "dtypes: float16, bfloat16; head dims (q/k, v): 64, (192, 128), 192; device code: sm_80, sm_90a" in text
    # bf16 is the dtype of the table when built; the registry is asked with arch 0, as a call does.
    assert {c[1] for c in calls} == {"bfloat16"} and {c[3] for c in calls} == {0} and {c[2] for c in calls} == {90}
    for gpu in (0, 1):
        table = text.split(f"GPU {gpu}, bfloat16: the kernel family of each call\n")[1].split("\n\n")[0].splitlines()
        assert table[0] == "| head dims | forward | backward | deterministic backward |"
        assert table[2] == "| 64 | sm90 | sm90 | sm90 |"
        # The error a call would raise, first line only.
        assert table[3] == "| (192, 128) | sm90 | sm90 | none: flashmask: no kernel for this call |"
        assert table[4] == "| 192 | sm90 | sm90 | sm90 |"
    assert len(calls) == 2 * 3 * 3


def test_an_ampere_gpu_an_older_one_and_a_build_without_gpus(monkeypatch):
    _fake_kernels(monkeypatch, cc=80)
    assert "| 64 | sm80 | sm80 | sm80 |" in env_report.report()
    for cc, hint in ((75, "flashmask's kernels run on compute capability 8.x and 9.0"),
                     (100, "flashmask's kernels run on compute capability 8.x and 9.0")):
        calls = _fake_kernels(monkeypatch, cc=cc)
        text = env_report.report()
        assert (f"  GPU 0: this build has no device code for compute capability {cc // 10}.{cc % 10}: it carries "
                f"sm_80, sm_90a; {hint}; its calls run on the reference path") in text
        assert "| head dims |" not in text and not calls
    _fake_kernels(monkeypatch, cc=90, gpus=0)
    text = env_report.report()
    assert "GPU: none visible" in text and "CUDA kernels: built" in text
    assert "not usable here: no CUDA device is available" in text and "| head dims |" not in text


def test_device_code_reason_names_the_gpu_the_targets_and_what_to_do(monkeypatch):
    _fake_kernels(monkeypatch, cc=90)
    assert _cuda.device_code_reason(90) is None and _cuda.device_code_reason(86) is None
    assert _cuda.cuda_targets() == ("sm_80", "sm_90a")
    assert _cuda.device_code_reason(100, "B200") == (
        "this build has no device code for compute capability 10.0 (B200): it carries sm_80, sm_90a; "
        "flashmask's kernels run on compute capability 8.x and 9.0")
    monkeypatch.setattr(_cuda._C, "has_code_for", lambda cc: cc == 90)  # a build for sm_90 alone
    assert _cuda.device_code_reason(80).endswith("rebuild with FLASHMASK_ARCHS including 80")
    monkeypatch.setattr(_cuda, "_C", None)
    assert _cuda.device_code_reason(100) is None  # no build: unavailable_reason says why
