"""The one list of kernel instantiations (csrc/instantiations.py) and the files it generates."""
import importlib.util
import os
import re

import pytest

from tests import ROOT


def _module():
    spec = importlib.util.spec_from_file_location("fm_inst", os.path.join(ROOT, "csrc", "instantiations.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


inst = _module()


def test_every_listed_kernel_has_its_launch_header():
    for arch, kernels in inst.KERNELS.items():
        assert set(inst.ARCH_HEAD_DIMS[arch]) <= set(inst.HEAD_DIMS)
        for name, k in kernels.items():
            assert name in inst.SLOTS
            header = os.path.join(ROOT, "csrc", k.header)
            assert os.path.exists(header), header
            # The launch template the generated unit calls is defined in that header.
            assert re.search(rf"void {k.function.split('::')[-1]}\(", open(header).read()), (header, k.function)


def test_selection_and_errors():
    full = inst.instantiations()
    assert len(full) == sum(len(inst.KERNELS[a]) * len(inst.ARCH_HEAD_DIMS[a]) for a in inst.KERNELS) * len(inst.DTYPES)
    one = inst.instantiations([128], ["bf16"], ["sm80"])
    assert {(i.kernel, i.head_dim, i.dtype) for i in one} == {(k, 128, "bf16") for k in inst.KERNELS["sm80"]}
    with pytest.raises(ValueError, match="unknown head dims"):
        inst.instantiations([100], ["bf16"], ["sm80"])
    with pytest.raises(ValueError, match="fp8"):
        inst.instantiations([128], ["fp8"], ["sm80"])
    assert inst.arch_families(["80"]) == ["sm80"]
    assert inst.arch_families(["80", "90"]) == ["sm80", "sm90"]
    assert inst.arch_families(["90a"]) == ["sm80", "sm90"]


def test_generated_units_and_registry(tmp_path):
    selected = inst.instantiations([64, 128], ["fp16", "bf16"], ["sm80"])
    paths = inst.generate(str(tmp_path), selected)
    assert len(paths) == len(selected) == len(set(paths))
    for i, path in zip(selected, paths):
        text = open(path).read()
        assert f"void {i.symbol}(const {inst.KERNELS[i.arch][i.kernel].params}& p" in text
        assert f"<{i.head_dim}, {inst.DTYPES[i.dtype]}>(p, stream)" in text
    registry = open(tmp_path / "kernel_registry.inc").read()
    rows = re.findall(r"\{(\d+), (\d+), DType::(\w+), ([^}]*)\}", registry)
    table = {(int(a), int(d), t): slots.split(", ") for a, d, t, slots in rows if a != "0"}
    assert set(table) == {(80, d, t) for d in (64, 128) for t in ("fp16", "bf16")}
    assert table[(80, 64, "bf16")] == ["&run_sm80_fwd_hdim64_bf16", "&run_sm80_bwd_kv_hdim64_bf16",
                                      "&run_sm80_bwd_dq_hdim64_bf16"]
    # A slot the family lacks is null (the SM90 family has no bwd_dq).
    sm90 = inst.instantiations([128], ["bf16"], ["sm90"])
    inst.generate(str(tmp_path / "sm90"), sm90)
    row = re.search(r"\{90, 128, DType::bf16, ([^}]*)\}", open(tmp_path / "sm90" / "kernel_registry.inc").read())
    slots = row.group(1).split(", ")
    assert len(slots) == len(inst.SLOTS)
    assert all((slots[i] == "nullptr") == (s not in inst.KERNELS["sm90"]) for i, s in enumerate(inst.SLOTS))
    # Unchanged files are not rewritten (ninja would recompile them).
    before = os.path.getmtime(paths[0])
    os.utime(paths[0], (before - 100, before - 100))
    inst.generate(str(tmp_path), selected)
    assert os.path.getmtime(paths[0]) == before - 100
