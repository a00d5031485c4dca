"""A quick forward timing while iterating on the kernel (the full benchmark is in benchmarks/)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashmask

torch.manual_seed(0)
for s in (8192, 32768):
    b, h, d = 1, 16, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        pairs = s * s / (2 if causal else 1)
        flops = 4 * b * h * d * pairs
        ms = do_bench(lambda: flashmask.flashmask_attention(q, k, v, causal=causal, backend="cuda"), warmup=50, rep=300, return_mode="median")
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms_fa = do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), warmup=50, rep=300, return_mode="median")
        print(f"S={s} causal={causal}: flashmask {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s | sdpa-flash {ms_fa:.3f} ms {flops / ms_fa / 1e9:.0f} TFLOP/s")
        # doc mask: 8 docs causal, window 1024
        import masks
        for name, (mask, c) in {
            "causal_doc8": (masks.from_cu_seqlens(torch.arange(0, s + 1, s // 8, device="cuda"), causal=True), True),
            "sliding1024": (masks.window_to_startend((1023, 0), s, s, True, device="cuda"), True),
        }.items():
            if causal is False:
                continue
            from masks.format import to_dense
            pairs_m = sum(to_dense(mask, True, rows=slice(r, r + 4096)).sum().item() for r in range(0, s, 4096))
            ms_m = do_bench(lambda: flashmask.flashmask_attention(q, k, v, mask, causal=True, backend="cuda"), warmup=50, rep=300, return_mode="median")
            print(f"   {name}: density {pairs_m / s / s:.3f} {ms_m:.3f} ms {4 * h * d * pairs_m / ms_m / 1e9:.0f} TFLOP/s")
