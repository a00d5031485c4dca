"""``python -m flashmask`` on a GPU with the kernels: each cell of its table is the family a call runs on."""
import pytest
import torch

from flashmask import _cuda, env_report

pytestmark = pytest.mark.skipif(not _cuda.available(), reason=f"CUDA kernels unavailable: {_cuda.unavailable_reason()}")


def test_table_matches_the_family_each_call_selects():
    text = env_report.report()
    assert "CUDA kernels: built (" in text
    dtype = torch.bfloat16 if torch.bfloat16 in _cuda.compiled_dtypes() else _cuda.compiled_dtypes()[0]
    name = str(dtype).replace("torch.", "")
    for gpu in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(gpu)
        assert f"GPU {gpu}: {torch.cuda.get_device_name(gpu)}, compute capability {major}.{minor}" in text
        table = text.split(f"GPU {gpu}, {name}: the kernel family of each call\n")[1].split("\n\n")[0].splitlines()
        rows = table[2:]
        assert len(rows) == len(_cuda.compiled_head_dim_pairs())
        for (d, dv), row in zip(_cuda.compiled_head_dim_pairs(), rows):
            q = torch.empty(1, 1, 1, d, device=f"cuda:{gpu}", dtype=dtype)
            cells = [f"sm{_cuda.selected_arch(q, slot=s, head_dim_v=dv)}" for s in ("fwd", "bwd", "bwd_deterministic")]
            assert row == f"| {d if d == dv else (d, dv)} | " + " | ".join(cells) + " |"
        if (major, minor) == (9, 0) and 90 in _cuda.compiled_archs(128, dtype):
            assert "| 128 | sm90 | sm90 | sm90 |" in rows


def test_the_build_has_code_for_this_gpu_and_names_its_targets():
    """The GPU tests run where the build has code, so no call of theirs falls back for want of it."""
    major, minor = torch.cuda.get_device_capability()
    assert _cuda._C.has_code_for(major * 10 + minor) and _cuda.device_code_reason(major * 10 + minor) is None
    assert _cuda.cuda_targets() and all(t.startswith("sm_") for t in _cuda.cuda_targets())
    # Turing has code in no build: the reason names the targets.
    assert not _cuda._C.has_code_for(75) and _cuda.cuda_targets()[0] in _cuda.device_code_reason(75)
