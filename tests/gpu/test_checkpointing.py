"""A checkpoint that keeps the attention output (flashmask.checkpointing) on the GPU: eager and under
torch.compile (inductor, fullgraph), the kernels' forward launches once a layer and step instead of
twice, and the gradients are those of the layers without a checkpoint (the same kernels)."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import flashmask
from flashmask import _cuda
from flashmask.checkpointing import keep_attention_context
from masks.examples import example
from tests.attn_helpers import KernelLaunches
from tests.gpu.cases import DTYPES, main_head_dim

pytestmark = pytest.mark.skipif(not _cuda.available(), reason="needs a CUDA device and the built extension")


class Layer(torch.nn.Module):
    """Projections around flashmask's kernels (backend="cuda": no silent reference path)."""

    def __init__(self, d, heads, mask):
        super().__init__()
        self.heads, self.mask = heads, mask
        self.qkv, self.out = torch.nn.Linear(d * heads, 3 * d * heads), torch.nn.Linear(d * heads, d * heads)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)
        o = flashmask.flashmask_attention(q, k, v, self.mask, causal=True, backend="cuda")
        return x + self.out(o.flatten(2))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_kept_attention_launches_once_a_layer(keep, compiled, monkeypatch):
    torch.manual_seed(0)
    d, heads, s = main_head_dim(), 4, 1000
    mask, _ = example("causal_document", s, batch_size=2, device="cuda")
    layers = torch.nn.ModuleList(Layer(d, heads, mask) for _ in range(2)).to("cuda", DTYPES[-1])
    x = torch.randn(2, s, d * heads, device="cuda", dtype=DTYPES[-1], requires_grad=True)
    extra = {"context_fn": keep_attention_context} if keep else {}

    def run(use_checkpoint):
        h = x
        for layer in layers:
            h = checkpoint(layer, h, use_reentrant=False, **extra) if use_checkpoint else layer(h)
        return h.float().square().mean()

    want = torch.autograd.grad(run(False), [x, *layers.parameters()])
    fn = torch.compile(run, fullgraph=True) if compiled else run
    launches = KernelLaunches(_cuda._C)
    monkeypatch.setattr(_cuda, "_C", launches)
    got = torch.autograd.grad(fn(True), [x, *layers.parameters()])
    assert launches.fwd_calls == len(layers) * (1 if keep else 2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * float(w.abs().max()))
