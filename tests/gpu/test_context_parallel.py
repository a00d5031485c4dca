"""Context parallelism on one process with the kernels (GPU only): a sliding window merged into the
plan (``ContextParallelPlan.windowed``) and Llama 4's chunks (``ContextParallelPlan.chunked``), both
modes, against the kernels on the whole sequence with the merged mask and against the float32
reference. More than one GPU: tests/multigpu."""
import pytest
import torch

import flashmask
from flashmask import _cuda
from flashmask import distributed as fmd
from flashmask.reference import reference_attention
from masks import from_position_ids, merge_chunks, merge_window
from masks.examples import example
from tests.attn_helpers import error_bound, low_precision_attention, max_err
from tests.gpu import cases as cuda_cases
from tests.gpu.cases import DTYPES, main_head_dim, make_qkv, pick

pytestmark = [
    pytest.mark.skipif(not _cuda.available(), reason="needs a CUDA device and the built extension"),
    pytest.mark.usefixtures("every_kernel_family"),
]


FAMILIES = ["causal_document", "causal", "share_question"]


def check_plan(plan, q, k, v, mask, causal, **whole):
    """The plan's attention (its shards of q, k, v) against the kernels on the whole sequence
    (``flashmask_attention(..., mask, **whole)``: output and gradients) and against the float32
    reference under the plan's merged mask."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    want = flashmask.flashmask_attention(*leaves, mask, causal=causal, backend=cuda_cases.BACKEND, **whole)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, dout)
    local = [plan.shard(t).detach().requires_grad_() for t in (q, k, v)]
    got = fmd.context_parallel_attention(*local, plan, backend=cuda_cases.BACKEND)
    merged = plan.startend_row_indices
    ref = reference_attention(q.float(), k.float(), v.float(), merged, causal=causal)[0]
    low = low_precision_attention(q, k, v, merged, causal)[0]
    assert max_err(got, plan.shard(ref)) <= error_bound(low, ref), "out against the reference"
    torch.testing.assert_close(got, plan.shard(want.detach()), atol=2e-2, rtol=2e-2)
    for name, g, w in zip("qkv", torch.autograd.grad(got, local, plan.shard(dout)), want_grads):
        torch.testing.assert_close(g.float(), plan.shard(w).float(), atol=5e-2, rtol=5e-2,
                                   msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", fmd.MODES)
def test_windowed_plan(mode, family):
    i = FAMILIES.index(family)
    dtype, s, window = pick(DTYPES, i), 1024, (pick([100, 255, 31], i), 0)
    mask, causal = example(family, s, batch_size=2, device="cuda")
    mask = None if family == "causal" else mask
    q, k, v = make_qkv(2, s, s, 6, 2, main_head_dim(), dtype)
    cuda_cases.skip_unless_backend_serves(q)
    plan = fmd.make_plan(mask, causal, s, mode=mode, align=8).windowed(window, batch_size=2)
    if mask is not None:
        assert torch.equal(plan.startend_row_indices, merge_window(mask, causal, window, s))
    check_plan(plan, q, k, v, mask, causal, window_size=window)


@pytest.mark.parametrize("mode", fmd.MODES)
def test_chunked_plan(mode):
    """Packed documents (restarting position ids) under 96-token chunks counted from each document's start."""
    s, chunk = 1024, 96
    pos = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in
                       ([300, 500, 224], [1024])]).cuda()
    batch = {"input_ids": torch.zeros(2, s, dtype=torch.long, device="cuda"), "position_ids": pos}
    _, plan = fmd.shard_packed_batch(batch, mode=mode, align=8)
    plan = plan.chunked(chunk, batch_size=2)
    mask = merge_chunks(from_position_ids(pos), chunk, s, pos)
    assert torch.equal(plan.startend_row_indices, mask)
    q, k, v = make_qkv(2, s, s, 6, 2, main_head_dim(), torch.bfloat16)
    cuda_cases.skip_unless_backend_serves(q)
    check_plan(plan, q, k, v, mask, True)
