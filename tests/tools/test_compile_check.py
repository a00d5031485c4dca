"""tools/compile_check.py: reading ptxas's report (the compile itself needs nvcc and a CUDA torch)."""
import re
import sys

from tools import compile_check

# The shape of `nvcc -Xptxas -v` output, advisory first as ptxas prints it.
LOG = """\
ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to \
program dependence on compiler-inserted WG.DP in divergent path in the function '_Z6kernelILb1EEvv'
ptxas info    : Compiling entry function '_Z6kernelILb0EEvv' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelILb0EEvv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function '_Z6kernelILb1EEvv' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelILb1EEvv
    8 bytes stack frame, 48 bytes spill stores, 72 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers
"""


def test_parse_ptxas():
    got = compile_check.parse_ptxas(LOG)
    assert list(got) == ["_Z6kernelILb1EEvv", "_Z6kernelILb0EEvv"]
    assert got["_Z6kernelILb0EEvv"] == dict(registers=168, spill_stores=0, spill_loads=0, wgmma_serialized=False)
    assert got["_Z6kernelILb1EEvv"] == dict(registers=128, spill_stores=48, spill_loads=72, wgmma_serialized=True)


# The shape of `cuobjdump -sass`: a kernel with two traps and ptxas's call to the next instruction (no
# return), one with a call into a function left out of line (its return).
SASS = """\
\t\tFunction : _Z6kernelILb1EEvv
        /*0d90*/              @!P5 BRA 0xdb0 ;                       /* 0x0000000000 */
        /*0da0*/                   BPT.TRAP 0x1 ;                    /* 0x000000040000795c */
        /*0e00*/                   BPT.TRAP 0x1 ;                    /* 0x000000040000795c */
        /*0e10*/              @!P1 CALL.REL.NOINC 0xe20 ;            /* 0x0000001000009944 */
\t\tFunction : _Z6kernelILb0EEvv
        /*0010*/                   CALL.REL.NOINC 0x236c0 ;          /* 0x0000020000307944 */
        /*0020*/                   EXIT ;                            /* 0x000000000000794d */
        /*0030*/                   RET.REL.NODEC R24 0x0 ;           /* 0xfffffc2418dc7950 */
"""


# Two kernels' wgmma in the shape of `cuobjdump -sass`: one batch of three ending in one full wait and
# a wait that keeps one batch in flight (healthy), and three each followed by a full wait (a reload
# of a register operand between them).
WGMMA_SASS = """\
\t\tFunction : _Z4goodv
        /*1690*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;   /* 0x0 */
        /*16e0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;         /* 0x0 */
        /*1700*/                   HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR12], R88, gsb0 ; /* 0x0 */
        /*1710*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                        /* 0x0 */
        /*1720*/                   FMNMX R3, R24, R25, !PT ;                               /* 0x0 */
        /*1730*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                        /* 0x0 */
\t\tFunction : _Z3badv
        /*1690*/                   HGMMA.64x128x16.F32.BF16 R24, R128, gdesc[UR24], RZ, !UPT, gsb0 ; /* 0x0 */
        /*16c0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                        /* 0x0 */
        /*16d0*/                   LDL.64 R124, [R1+0x10] ;                                /* 0x0 */
        /*16e0*/                   HGMMA.64x128x16.F32.BF16 R24, R124, gdesc[UR24], R24, gsb0 ; /* 0x0 */
        /*1710*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                        /* 0x0 */
        /*1730*/                   HGMMA.64x128x16.F32.BF16 R24, R120, gdesc[UR24], R24, gsb0 ; /* 0x0 */
        /*17c0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                        /* 0x0 */
"""


def test_waited_wgmma():
    got = compile_check.waited_wgmma(WGMMA_SASS)
    assert got == {"_Z4goodv": (0, 3), "_Z3badv": (3, 3)}
    assert not compile_check.wgmma_waited_singly(*got["_Z4goodv"])
    assert compile_check.wgmma_waited_singly(*got["_Z3badv"])
    assert not compile_check.wgmma_waited_singly(2, 24)  # the head dim 64 forward on main
    assert not compile_check.wgmma_waited_singly(0, 0)  # a kernel with no wgmma (SM80, row kernels)
    assert compile_check.waited_wgmma("") == {}


# A warp-specialised kernel: setup, the consumers' setmaxnreg.inc and mainloop, then the producer's
# setmaxnreg.dec and its code; and a kernel without setmaxnreg.
ROLES_SASS = """\
\t\tFunction : _ZN9flashmask4sm903fwdEv
        /*0360*/                   STL [R1], R2 ;                              /* 0x0 */
        /*0570*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;    /* 0x0 */
        /*1690*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR24], RZ, !UPT, gsb0 ; /* 0x0 */
        /*11d00*/                  USETMAXREG.DEALLOC.CTAPOOL 0x18 ;           /* 0x0 */
        /*13460*/                  STL [R1+0x4], R3 ;                          /* 0x0 */
        /*13470*/                  LDL.LU R3, [R1+0x4] ;                       /* 0x0 */
        /*13480*/                  LDL R5, [R1+0x8] ;                          /* 0x0 */
\t\tFunction : _ZN9flashmask4sm803fwdEv
        /*0100*/                   LDL R5, [R1+0x8] ;                          /* 0x0 */
        /*0200*/                   LDS R5, [R1+0x8] ;                          /* 0x0 */
"""


def test_local_memory_by_role():
    got = compile_check.local_memory_by_role(ROLES_SASS)
    assert got == {"_ZN9flashmask4sm903fwdEv": (1, 3), "_ZN9flashmask4sm803fwdEv": (1, 0)}
    assert compile_check.local_memory_by_role("") == {}


def test_count_per_kernel():
    assert compile_check.count_per_kernel(SASS, "BPT.TRAP") == {"_Z6kernelILb1EEvv": 2, "_Z6kernelILb0EEvv": 0}
    assert compile_check.count_per_kernel(SASS, "RET.REL") == {"_Z6kernelILb1EEvv": 0, "_Z6kernelILb0EEvv": 1}
    assert compile_check.count_per_kernel("", "BPT.TRAP") == {}


def test_nvcc_command():
    cmd = compile_check.nvcc_command("u.cu", "u.o", "sm90", ["/inc"], ["A=2"], ("-O3",), "-std=c++20")
    assert cmd[:3] == ["nvcc", "-O3", "-std=c++20"]
    assert "arch=compute_90a,code=sm_90a" in cmd and "-I/inc" in cmd and "-DA=2" in cmd
    assert cmd[-4:] == ["-c", "u.cu", "-o", "u.o"]
    assert "arch=compute_80,code=sm_80" in compile_check.nvcc_command("u.cu", "u.o", "sm80", [], [], ())
    assert "arch=compute_90a,code=sm_90a" in compile_check.nvcc_command("u.cu", "u.o", "sm80", [], [], (),
                                                                        target="90a")


def test_generated_unit_follows_the_build_archs(tmp_path):
    """An SM80 unit is written as the build for --archs writes it: without sm_90 code where the SM90
    kernels serve its head dims in a build for sm_80 and sm_90, with it for sm_90 alone."""
    macro = f"#define {compile_check.inst.SKIP_SM90_MACRO}"
    kv128 = compile_check.inst.Instantiation("sm80", "bwd_kv", 128, 128, "bf16")
    kv256 = compile_check.inst.Instantiation("sm80", "bwd_kv", 256, 256, "bf16")
    assert macro in open(compile_check.generated_unit(str(tmp_path / "a"), kv128, ["80", "90"])).read()
    assert macro not in open(compile_check.generated_unit(str(tmp_path / "b"), kv128, ["90"])).read()
    assert macro in open(compile_check.generated_unit(str(tmp_path / "c"), kv256, ["80", "90"])).read()
    assert macro not in open(compile_check.generated_unit(str(tmp_path / "c90"), kv256, ["90"])).read()
    # An instantiation no build lists is still written (the SM90 forward at head dim 32).
    path = compile_check.generated_unit(str(tmp_path / "d"), compile_check.inst.Instantiation(
        "sm90", "fwd", 32, 32, "bf16"), ["80", "90"])
    assert path.endswith("sm90/fwd_hdim32_bf16.cu")


def test_cxx_standard_is_torchs():
    assert re.fullmatch(r"-std=c\+\+\d\d", compile_check.cxx_standard())


def test_unknown_kernel_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["compile_check.py", "--arch", "sm90", "--kernel", "bwd_dq"])
    try:
        compile_check.main()
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("an unknown kernel must be refused")
    assert "sm90 has no kernel 'bwd_dq'" in capsys.readouterr().err


def test_missing_source_is_refused(monkeypatch, capsys, tmp_path):
    missing = str(tmp_path / "nothing.cu")
    monkeypatch.setattr(sys, "argv", ["compile_check.py", "--source", missing])
    try:
        compile_check.main()
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("a missing source file must be refused")
    assert "no such file" in capsys.readouterr().err


# An extension's SASS: an attention kernel (namespace flashmask::sm90) with a trap, an out-of-line
# function and its wgmma each waited for, and a row kernel whose out-of-line division is expected.
EXTENSION_SASS = """\
\t\tFunction : _ZN9flashmask4sm904attnEPfi
        /*0050*/                   BPT.TRAP 0x1 ;                       /* 0x0 */
        /*00b0*/                   CALL.REL.NOINC 0xe0 ;                /* 0x0 */
        /*0100*/                   RET.REL.NODEC R4 0x0 ;               /* 0x0 */
        /*1690*/                   HGMMA.64x128x16.F32.BF16 R24, R128, gdesc[UR24], RZ, !UPT, gsb0 ; /* 0x0 */
        /*16c0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                        /* 0x0 */
\t\tFunction : _ZN9flashmask4rowsEPf
        /*0070*/                   CALL.REL.NOINC 0xa0 ;                /* 0x0 */
        /*00d0*/                   RET.REL.NODEC R4 0x0 ;               /* 0x0 */
"""


def _fake_cuobjdump(monkeypatch, sass):
    monkeypatch.setattr(compile_check.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(compile_check, "sass_checks", lambda path: (
        compile_check.count_per_kernel(sass, "BPT.TRAP"), compile_check.count_per_kernel(sass, "RET.REL"),
        compile_check.waited_wgmma(sass), compile_check.local_memory_by_role(sass)))
    monkeypatch.setattr(compile_check, "_demangle", lambda names: names)


def test_sass_report_names_the_attention_kernels_only(monkeypatch, capsys):
    _fake_cuobjdump(monkeypatch, EXTENSION_SASS)
    assert compile_check.sass_report("ext.so") == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split() for line in out[:3]] == [["1", "traps", "_ZN9flashmask4sm904attnEPfi"],
                                                  ["1", "calls", "_ZN9flashmask4sm904attnEPfi"],
                                                  ["WAITED", "1/1", "_ZN9flashmask4sm904attnEPfi"]]
    assert out[3] == ("2 kernels: 1 with runtime traps, 1 attention kernels with out-of-line functions, "
                      "1 waiting for each wgmma on its own")
    _fake_cuobjdump(monkeypatch, EXTENSION_SASS.split("\t\tFunction : _ZN9flashmask4rows")[0].replace(
        "BPT.TRAP", "NOP").replace("RET.REL", "EXIT").replace("gsb0, 0x0", "gsb0, 0x1"))
    assert compile_check.sass_report("ext.so") == 0
    assert capsys.readouterr().out.startswith("1 kernels: 0 with runtime traps, 0 attention")
    assert compile_check.is_attention_kernel("_ZN9flashmask4sm803fwdEv")
    assert not compile_check.is_attention_kernel("_ZN9flashmask4rowsEPf")


def test_sass_of_a_missing_file_is_refused(monkeypatch, capsys, tmp_path):
    missing = str(tmp_path / "nothing.so")
    monkeypatch.setattr(sys, "argv", ["compile_check.py", "--sass", missing])
    try:
        compile_check.main()
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("a missing file must be refused")
    assert "--sass" in capsys.readouterr().err


def _cubin(sections, machine=compile_check.EM_CUDA):
    """A minimal little-endian ELF64 holding ``sections`` ({name: bytes}) and its section-name table."""
    import struct
    names = [".shstrtab", *sections]
    strtab = b"\0" + b"".join(n.encode() + b"\0" for n in names)
    body, offsets = strtab, [64]
    for data in sections.values():
        offsets.append(64 + len(body))
        body += data
    shoff = 64 + len(body)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack(
        "<HHIQQQIHHHHHH", 2, machine, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(names) + 1, 1)
    table = bytes(64)  # the null section
    for i, (n, data) in enumerate(zip(names, [strtab, *sections.values()])):
        table += struct.pack("<IIQQQQIIQQ", strtab.index(n.encode() + b"\0"), 1, 0, 0, offsets[i], len(data),
                             0, 0, 1, 0)
    return header + body + table


def test_same_code_compares_each_kernels_machine_code(tmp_path, capsys):
    """Two files whose cubins differ in one kernel's code and in their line tables: only that kernel
    is listed; a host ELF before the cubin is skipped; the same code gives exit 0."""
    host = _cubin({".text.host": b"\x90" * 8}, machine=62)
    k1, k2 = ".text._Z2k1v", ".text._Z2k2v"
    a = _cubin({k1: b"\x01" * 16, k2: b"\x02" * 16, ".nv_debug_line_sass": b"/tmp/a/csrc"})
    b = _cubin({k1: b"\x01" * 16, k2: b"\x03" * 16, ".nv_debug_line_sass": b"/work/b/csrc/x"})
    same = _cubin({k1: b"\x01" * 16, k2: b"\x02" * 16, ".nv_debug_line_sass": b"elsewhere"})
    files = {}
    for name, cubin in (("a", a), ("b", b), ("same", same)):
        files[name] = tmp_path / f"{name}.o"
        files[name].write_bytes(host + b"fatbin header" + cubin + b"tail")
    assert compile_check.kernel_code(str(files["a"])).keys() == {"_Z2k1v", "_Z2k2v"}
    assert compile_check.same_code_report(str(files["a"]), str(files["b"])) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out if "k2" in line or "k1" in line] == ["differs"]
    assert any("k2" in line for line in out) and out[-1] == "2 / 2 kernels, 1 with other machine code"
    assert compile_check.same_code_report(str(files["a"]), str(files["same"])) == 0
    (tmp_path / "none.o").write_bytes(host)
    assert compile_check.same_code_report(str(files["a"]), str(tmp_path / "none.o")) == 2


def test_same_code_names_a_missing_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["compile_check", "--same-code", str(tmp_path / "a.o"), str(tmp_path / "b.o")])
    try:
        compile_check.main()
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("a missing file must stop the tool")
    err = capsys.readouterr().err
    assert "--same-code" in err and "a.o" in err and "no such file" in err
