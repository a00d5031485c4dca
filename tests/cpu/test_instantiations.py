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
        assert set(inst.ARCH_HEAD_DIM_PAIRS[arch]) <= set(inst.HEAD_DIM_PAIRS)
        for name, k in kernels.items():
            assert name in inst.SLOTS
            header = os.path.join(ROOT, "csrc", k.header)
            assert os.path.exists(header), header
            # The launch template the generated unit calls is defined in that header, and takes the
            # head dim, the value head dim and the element type.
            assert re.search(rf"template <int \w+, int \w+, typename \w+>\s*void {k.function.split('::')[-1]}\(",
                             open(header).read()), (header, k.function)


def test_head_dim_pairs():
    """(192, 128), DeepSeek's MLA, is an unequal pair of both families; every pair is unequal, its
    head dims multiples of 8 up to 256."""
    assert (192, 128) in inst.HEAD_DIM_PAIRS
    assert (192, 128) in inst.ARCH_HEAD_DIM_PAIRS["sm80"]
    assert (192, 128) in inst.ARCH_HEAD_DIM_PAIRS["sm90"]
    assert set(inst.ARCH_HEAD_DIM_PAIRS) == set(inst.KERNELS)
    for d, dv in inst.HEAD_DIM_PAIRS:
        assert d != dv and d % 8 == 0 and dv % 8 == 0 and 0 < d <= 256 and 0 < dv <= 256
    assert inst.arch_head_dim_pairs("sm80") == [(d, d) for d in inst.ARCH_HEAD_DIMS["sm80"]] + \
        list(inst.ARCH_HEAD_DIM_PAIRS["sm80"])
    assert inst.arch_head_dim_pairs("sm90") == [(d, d) for d in inst.ARCH_HEAD_DIMS["sm90"]] + [(192, 128)]


def test_sm90_backward_head_dims():
    """The SM90 backward is built for the head dims KERNEL_HEAD_DIMS gives it, the forward for every
    SM90 pair; a set without a backward leaves it to the SM80 kernels (null slot in the registry)."""
    sm90 = inst.instantiations(archs=["sm90"], dtypes=["bf16"])
    assert {(i.head_dim, i.head_dim_v) for i in sm90 if i.kernel == "fwd"} == set(inst.arch_head_dim_pairs("sm90"))
    assert {i.head_dim for i in sm90 if i.kernel == "bwd_kv"} == set(inst.KERNEL_HEAD_DIMS[("sm90", "bwd_kv")])
    assert all(i.head_dim == i.head_dim_v for i in sm90 if i.kernel == "bwd_kv")


def test_names_of_equal_and_unequal_instantiations():
    """Equal head dims keep their names; a pair names both dims."""
    equal = inst.Instantiation("sm80", "fwd", 128, 128, "bf16")
    assert equal.filename == "sm80/fwd_hdim128_bf16.cu" and equal.symbol == "run_sm80_fwd_hdim128_bf16"
    pair = inst.Instantiation("sm80", "bwd_kv", 192, 128, "fp16")
    assert pair.filename == "sm80/bwd_kv_hdim192x128_fp16.cu" and pair.symbol == "run_sm80_bwd_kv_hdim192x128_fp16"
    names = [i.filename for i in inst.instantiations()]
    assert len(names) == len(set(names))


def test_selection_and_errors():
    full = inst.instantiations()
    assert len(full) == sum(len(inst.arch_head_dim_pairs(a)) if (a, k) not in inst.KERNEL_HEAD_DIMS
                            else len(inst.KERNEL_HEAD_DIMS[(a, k)])
                            for a in inst.KERNELS for k in inst.KERNELS[a]) * len(inst.DTYPES)
    one = inst.instantiations([128], ["bf16"], ["sm80"])
    assert {(i.kernel, i.head_dim, i.head_dim_v, i.dtype) for i in one} == \
        {(k, 128, 128, "bf16") for k in inst.KERNELS["sm80"]}
    # FLASHMASK_HEAD_DIMS selects a pair by its q/k head dim: 192 builds (192, 192) and (192, 128).
    mla = inst.instantiations([192], ["bf16"], ["sm80", "sm90"])
    assert {(i.arch, i.kernel, i.head_dim, i.head_dim_v) for i in mla} == \
        {("sm80", k, 192, dv) for k in inst.KERNELS["sm80"] for dv in (192, 128)} | \
        {("sm90", "fwd", 192, dv) for dv in (192, 128)}
    assert all(i.head_dim_v == i.head_dim for i in inst.instantiations([64, 128, 256]))
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
        assert f"<{i.head_dim}, {i.head_dim_v}, {inst.DTYPES[i.dtype]}>(p, stream)" in text
    registry = open(tmp_path / "kernel_registry.inc").read()
    rows = re.findall(r"\{(\d+), (\d+), (\d+), DType::(\w+), ([^}]*)\}", registry)
    table = {(int(a), int(d), int(dv), t): slots.split(", ") for a, d, dv, t, slots in rows if a != "0"}
    assert set(table) == {(80, d, d, t) for d in (64, 128) for t in ("fp16", "bf16")}
    assert table[(80, 64, 64, "bf16")] == ["&run_sm80_fwd_hdim64_bf16", "&run_sm80_bwd_kv_hdim64_bf16",
                                          "&run_sm80_bwd_dq_hdim64_bf16"]
    # A pair's row names both dims; rows sort by (arch, head dim, value head dim, dtype).
    mla = inst.instantiations([128, 192], ["bf16"], ["sm80"])
    inst.generate(str(tmp_path / "mla"), mla)
    text = open(tmp_path / "mla" / "sm80" / "fwd_hdim192x128_bf16.cu").read()
    assert "void run_sm80_fwd_hdim192x128_bf16(const AttnParams& p" in text
    assert "sm80::run_fwd<192, 128, cutlass::bfloat16_t>(p, stream)" in text
    rows = re.findall(r"\{(\d+), (\d+), (\d+), DType::(\w+), ([^}]*)\}",
                      open(tmp_path / "mla" / "kernel_registry.inc").read())
    assert [(int(a), int(d), int(dv)) for a, d, dv, _, _ in rows] == [(80, 128, 128), (80, 192, 128), (80, 192, 192),
                                                                     (0, 0, 0)]
    assert rows[1][4].split(", ") == ["&run_sm80_fwd_hdim192x128_bf16", "&run_sm80_bwd_kv_hdim192x128_bf16",
                                      "&run_sm80_bwd_dq_hdim192x128_bf16"]
    # A slot the family lacks is null (the SM90 family has no bwd_dq).
    sm90 = inst.instantiations([128], ["bf16"], ["sm90"])
    inst.generate(str(tmp_path / "sm90"), sm90)
    row = re.search(r"\{90, 128, 128, DType::bf16, ([^}]*)\}", open(tmp_path / "sm90" / "kernel_registry.inc").read())
    slots = row.group(1).split(", ")
    assert len(slots) == len(inst.SLOTS)
    assert all((slots[i] == "nullptr") == (s not in inst.KERNELS["sm90"]) for i, s in enumerate(inst.SLOTS))
    # Unchanged files are not rewritten (ninja would recompile them).
    before = os.path.getmtime(paths[0])
    os.utime(paths[0], (before - 100, before - 100))
    inst.generate(str(tmp_path), selected)
    assert os.path.getmtime(paths[0]) == before - 100
