#!/bin/bash
# On a GPU machine without a package index: install FlashAttention-4 for FlexAttention's FLASH
# backend (bench_kernels.py --methods ...,flex_flash) from files carried in .fa4/, then check that
# torch.compile(flex_attention) runs it. Idempotent.
#
# What works with torch 2.11: flash-attn-4 4.0.0b16 on CuTe-DSL 4.5.2. From 4.6 on, the DSL wheels
# no longer hold the Python package `cutlass.cute` that FA4 imports (4.8.1: `cutlass._mlir` only),
# and FA4 betas after b16 need DSL 4.6 or later. Prepare .fa4/ where pip can reach an index
# (the DSL wheel is 79 MB: repacked with xz it fits a 64 MiB carry next to the rest):
#   pip download --no-deps --python-version 3.12 --only-binary=:all: -d .fa4 flash-attn-4==4.0.0b16 \
#       quack-kernels==0.5.0 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 nvidia-cutlass-dsl-libs-cu13==4.5.2
#   mkdir w && (cd w && python3 -m zipfile -e ../.fa4/nvidia_cutlass_dsl_libs_cu13-4.5.2-*.whl .) \
#       && tar -cf - -C w . | xz -9 > .fa4/cu13_452.tar.xz && rm -rf w .fa4/nvidia_cutlass_dsl_libs_cu13-*.whl
#   (the CuTe/CUTLASS headers then go along as .fa4/inc.tar.xz: cutlass_library/source/include of
#   the nvidia-cutlass wheel; set CUTLASS_INCLUDE_DIR to it for the flashmask build)
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
if ! python3 -c "import flash_attn.cute.interface" 2>/dev/null; then
    t0=$(date +%s)
    rm -rf /tmp/dsl && mkdir -p /tmp/dsl && tar -xJf .fa4/cu13_452.tar.xz -C /tmp/dsl
    wheel=/tmp/nvidia_cutlass_dsl_libs_cu13-4.5.2-cp312-cp312-manylinux_2_28_x86_64.whl
    ( cd /tmp/dsl && python3 -m zipfile -c $wheel $(ls -A) )
    python3 -m pip install -q --no-index --no-deps $wheel .fa4/*.whl 2>&1 | grep -v "^WARNING" | tail -3
    echo "FlashAttention-4 installed in $(( $(date +%s) - t0 )) s"
fi
python3 - <<'P' 2>&1 | tail -8 | tee "$OUT/flex_flash_probe.txt"
import time
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
print(torch.__version__, torch.cuda.get_device_name())
flex = torch.compile(flex_attention)
for d in (64, 128):
    q, k, v = (torch.randn(1, 16, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 4096, 4096)
    try:
        t = time.time()
        o = flex(q, k, v, block_mask=bm, kernel_options={"BACKEND": "FLASH"})
        torch.cuda.synchronize()
        print(f"D={d} FLASH ok ({time.time() - t:.1f} s), max |FLASH - Triton| "
              f"{(o - flex(q, k, v, block_mask=bm)).abs().max().item():.3g}")
    except Exception as e:
        print(f"D={d} FLASH failed: {type(e).__name__}: {str(e)[:400]}")
P
