"""The one list of kernel instantiations (csrc/instantiations.py) and the files it generates."""
import os
import re

import pytest

from tests import ROOT
from tests.cxx import instantiations

inst = instantiations()
# A row of kernel_registry.inc: arch, head dim, value head dim, dtype, the slots, skips_sm90.
ROW = r"\{(\d+), (\d+), (\d+), DType::(\w+), ([^}]*), (true|false)\}"


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


def test_sm90_kernels_cover_every_sm90_pair():
    """The SM90 forward and backward are built for every SM90 pair, (192, 128) included."""
    sm90 = inst.instantiations(archs=["sm90"], dtypes=["bf16"])
    for kernel in ("fwd", "bwd_kv"):
        pairs = {(i.head_dim, i.head_dim_v) for i in sm90 if i.kernel == kernel}
        assert pairs == set(inst.arch_head_dim_pairs("sm90")), kernel


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
    assert len(full) == sum(len(inst.arch_head_dim_pairs(a)) * len(inst.KERNELS[a])
                            for a in inst.KERNELS) * len(inst.DTYPES)
    one = inst.instantiations([128], ["bf16"], ["sm80"])
    assert {(i.kernel, i.head_dim, i.head_dim_v, i.dtype) for i in one} == \
        {(k, 128, 128, "bf16") for k in inst.KERNELS["sm80"]}
    # FLASHMASK_HEAD_DIMS selects a pair by its q/k head dim: 192 builds (192, 192) and (192, 128).
    mla = inst.instantiations([192], ["bf16"], ["sm80", "sm90"])
    assert {(i.arch, i.kernel, i.head_dim, i.head_dim_v) for i in mla} == \
        {("sm80", k, 192, dv) for k in inst.KERNELS["sm80"] for dv in (192, 128)} | \
        {("sm90", k, 192, dv) for k in inst.KERNELS["sm90"] for dv in (192, 128)}
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
    rows = re.findall(ROW, registry)
    table = {(int(a), int(d), int(dv), t): slots.split(", ") for a, d, dv, t, slots, _ in rows if a != "0"}
    assert set(table) == {(80, d, d, t) for d in (64, 128) for t in ("fp16", "bf16")}
    assert table[(80, 64, 64, "bf16")] == ["&run_sm80_fwd_hdim64_bf16", "&run_sm80_bwd_kv_hdim64_bf16",
                                          "&run_sm80_bwd_dq_hdim64_bf16"]
    # A pair's row names both dims; rows sort by (arch, head dim, value head dim, dtype).
    mla = inst.instantiations([128, 192], ["bf16"], ["sm80"])
    inst.generate(str(tmp_path / "mla"), mla)
    text = open(tmp_path / "mla" / "sm80" / "fwd_hdim192x128_bf16.cu").read()
    assert "void run_sm80_fwd_hdim192x128_bf16(const AttnParams& p" in text
    assert "sm80::run_fwd<192, 128, cutlass::bfloat16_t>(p, stream)" in text
    rows = re.findall(ROW, open(tmp_path / "mla" / "kernel_registry.inc").read())
    assert [(int(a), int(d), int(dv)) for a, d, dv, *_ in rows] == [(80, 128, 128), (80, 192, 128), (80, 192, 192),
                                                                   (0, 0, 0)]
    assert rows[1][4].split(", ") == ["&run_sm80_fwd_hdim192x128_bf16", "&run_sm80_bwd_kv_hdim192x128_bf16",
                                      "&run_sm80_bwd_dq_hdim192x128_bf16"]
    # A slot the family lacks is null (the SM90 family has no bwd_dq).
    sm90 = inst.instantiations([128], ["bf16"], ["sm90"])
    inst.generate(str(tmp_path / "sm90"), sm90)
    row = re.search(r"\{90, 128, 128, DType::bf16, ([^}]*), (?:true|false)\}",
                    open(tmp_path / "sm90" / "kernel_registry.inc").read())
    slots = row.group(1).split(", ")
    assert len(slots) == len(inst.SLOTS)
    assert all((slots[i] == "nullptr") == (s not in inst.KERNELS["sm90"]) for i, s in enumerate(inst.SLOTS))
    # Unchanged files are not rewritten (ninja would recompile them).
    before = os.path.getmtime(paths[0])
    os.utime(paths[0], (before - 100, before - 100))
    inst.generate(str(tmp_path), selected)
    assert os.path.getmtime(paths[0]) == before - 100


# The SM80 head dims an SM90 kernel holds (32 rounds up to 64).
SERVED = {(d, dv) for d, dv in inst.arch_head_dim_pairs("sm80")
          if any(d <= s and dv <= sv for s, sv in inst.arch_head_dim_pairs("sm90"))}


def _skipped(archs, head_dims=inst.HEAD_DIMS):
    selected = inst.instantiations(head_dims, archs=inst.arch_families(archs))
    return selected, {i for i in selected if inst.skips_sm90(i, archs, selected)}


def test_sm80_kernels_skip_sm90_where_the_sm90_kernels_serve():
    """A build for sm_80 and sm_90 leaves the sm_90 code out of exactly the SM80 kernels (fwd,
    bwd_kv and bwd_dq, both dtypes) at the head dims an SM90 kernel holds: every one."""
    assert SERVED == {(32, 32), (64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)}
    for archs in (["80", "90"], ["80", "90a"], ["86", "90"], ["80", "90", "100"]):
        _, skipped = _skipped(archs)
        assert skipped == {inst.Instantiation("sm80", k, d, dv, t) for k in ("fwd", "bwd_kv", "bwd_dq")
                           for d, dv in SERVED for t in inst.DTYPES}, archs
    # Nothing where the build has no older arch (sm_90 alone: the SM80 kernels' only way onto a
    # Hopper GPU) or no sm_90 code at all.
    for archs in (["90"], ["90a"], ["80"], ["80", "86"], ["90", "100"]):
        assert _skipped(archs)[1] == set(), archs


def test_skips_sm90_follows_the_selected_head_dims(tmp_path):
    """FLASHMASK_HEAD_DIMS=32 has no SM90 kernel to leave head dim 32 to: its SM80 kernels keep
    their sm_90 code. With 64 built as well, 32 rounds up to the SM90 head dim 64."""
    assert _skipped(["80", "90"], [32])[1] == set()
    _, skipped = _skipped(["80", "90"], [32, 64])
    assert {(i.kernel, i.head_dim) for i in skipped} == {(k, d) for k in ("fwd", "bwd_kv", "bwd_dq")
                                                         for d in (32, 64)}
    _, skipped = _skipped(["80", "90"], [192])
    assert {(i.head_dim, i.head_dim_v) for i in skipped} == {(192, 192), (192, 128)}
    # A dtype the SM90 kernels are not built for keeps the SM80 ones; a forward skips only for an
    # SM90 forward, a backward only for an SM90 backward.
    sm90_bf16 = inst.instantiations([128], ["bf16"], ["sm90"])
    for kernel in ("fwd", "bwd_kv"):
        sm80_fp16 = inst.Instantiation("sm80", kernel, 128, 128, "fp16")
        assert not inst.skips_sm90(sm80_fp16, ["80", "90"], sm90_bf16 + [sm80_fp16])
    sm80_bf16 = [inst.Instantiation("sm80", k, 128, 128, "bf16") for k in ("fwd", "bwd_kv")]
    sm90_fwd = [i for i in sm90_bf16 if i.kernel == "fwd"]
    assert [inst.skips_sm90(i, ["80", "90"], sm90_fwd + sm80_bf16) for i in sm80_bf16] == [True, False]
    with pytest.raises(ValueError, match="forward and backward together"):
        inst.generate(str(tmp_path), sm90_fwd + sm80_bf16, ["80", "90"])


def test_generated_units_and_registry_carry_skips_sm90(tmp_path):
    """The units skips_sm90 picks, and only those, define the macro before their launch header; the
    registry row of their set says skips_sm90 (true), every other row false."""
    archs = ["80", "90"]
    selected, skipped = _skipped(archs)
    paths = inst.generate(str(tmp_path), selected, archs)
    macro = f"#define {inst.SKIP_SM90_MACRO}\n"
    for i, path in zip(selected, paths):
        text = open(path).read()
        assert (macro in text) == (i in skipped), i
        if i in skipped:
            assert text.index(macro) < text.index("#include")
    for header in ("sm80/fwd_kernel.h", "sm80/bwd_kv_kernel.h", "sm80/bwd_dq_kernel.h", "sm80/dq_accum.h"):
        src = open(os.path.join(ROOT, "csrc", header)).read()
        assert f"defined({inst.SKIP_SM90_MACRO}) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900" in src, header
    rows = re.findall(ROW, open(tmp_path / "kernel_registry.inc").read())
    flags = {(int(a), int(d), int(dv), t): flag == "true" for a, d, dv, t, _, flag in rows}
    assert flags.pop((0, 0, 0, "fp16")) is False  # the sentinel
    assert {key for key, flag in flags.items() if flag} == {(80, d, dv, t) for d, dv in SERVED for t in inst.DTYPES}
    # A build for sm_90 alone (and the default of generate) keeps every sm_90 body.
    for archs, out in ((["90"], "sm90_only"), ((), "no_archs")):
        paths = inst.generate(str(tmp_path / out), selected, archs)
        assert not any(macro in open(p).read() for p in paths)
        rows = re.findall(ROW, open(tmp_path / out / "kernel_registry.inc").read())
        assert rows and all(flag == "false" for *_, flag in rows)


def test_device_code_targets_of_a_build(tmp_path):
    """setup.py's -gencode targets ("90" -> "90a") and the registry's list of them, which tells the
    binding which GPUs the build has code for; a table generated without archs lists none."""
    assert inst.gencode_targets(["80", "90"]) == ["80", "90a"]
    assert inst.gencode_targets(["86", "90a"]) == ["86", "90a"]
    selected = inst.instantiations([64], ["bf16"], ["sm80", "sm90"])
    for archs, listed in ((["80", "90"], "{80, false}, {90, true}, "), (["90"], "{90, true}, "), ([], "")):
        inst.generate(str(tmp_path / "".join(archs)), selected, archs)
        text = (tmp_path / "".join(archs) / "kernel_registry.inc").read_text()
        assert f"const CudaTarget kCudaTargets[] = {{{listed}{{0, false}}}};" in text, archs
