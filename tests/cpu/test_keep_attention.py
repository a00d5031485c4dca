"""Activation checkpointing that keeps the attention outputs (flashmask.checkpointing, keep_attention).

The CUDA kernels are replaced by their CPU stand-ins (tests/cpu_kernels.py: the reference forward,
the backward from the saved LSE), reached the way a GPU run reaches the kernels: the transformers
backend -> flashmask_attention -> the custom op (under a dispatch mode, as selective checkpointing
is) or the eager path. Oracle: the same model without checkpointing (logits and every gradient),
and the stand-ins' call log (the forward kernel runs once per layer and step, not twice).
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import flashmask.attention
from flashmask.checkpointing import (
    ATTENTION_OPS,
    chunk_mlp,
    enable_activation_checkpointing,
    keep_attention_context,
    keep_attention_policy,
)
from tests import cpu_kernels

transformers = pytest.importorskip("transformers")
fm_hf = pytest.importorskip("flashmask.integrations.transformers")

LAYERS = 3


@pytest.fixture
def stand_in_kernels():
    with cpu_kernels.in_place_of_the_kernels() as calls:
        yield calls


def _model(seed=0):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=128, attention_dropout=0.0)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=fm_hf.ATTN_IMPLEMENTATION).double()


def _step(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 40), generator=g)
    pos = torch.cat([torch.arange(25), torch.arange(15)]).repeat(2, 1)  # two documents a row
    logits = model(input_ids=ids, position_ids=pos).logits
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    assert sorted(got[1]) == sorted(want[1])
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_transformers_model_runs_the_attention_once_a_layer(stand_in_kernels, keep, offload):
    ref = _model().train()
    want = _step(ref)
    assert stand_in_kernels.count("fwd") == LAYERS  # the stand-ins are what runs
    model = enable_activation_checkpointing(copy.deepcopy(ref), offload=offload, keep_attention=keep)
    stand_in_kernels.clear()
    _assert_same(_step(model), want)
    # the recompute of each layer runs its attention again unless it was kept
    assert stand_in_kernels.count("fwd") == LAYERS * (1 if keep else 2)
    assert stand_in_kernels.count("bwd") == LAYERS


def test_with_chunked_mlps_inside_the_layer_checkpoints(stand_in_kernels):
    ref = _model(seed=1).train()
    want = _step(ref, seed=1)
    model = chunk_mlp(enable_activation_checkpointing(copy.deepcopy(ref), keep_attention=True), 16)
    stand_in_kernels.clear()
    _assert_same(_step(model, seed=1), want)
    assert stand_in_kernels.count("fwd") == LAYERS


class _Block(torch.nn.Module):
    """x -> proj -> attention (the kernels' path) -> out, for the ``layers=`` path of any model."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)
        return x + self.out(flashmask.flashmask_attention(q, k, v, causal=True).flatten(2))


@pytest.mark.parametrize("offload", [False, True])
def test_layers_of_any_model(stand_in_kernels, offload):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(_Block(), _Block()).double().train()
    x = torch.randn(2, 24, 16, dtype=torch.float64)

    def step(model):
        y = model(x.clone().requires_grad_())
        y.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return y.detach(), grads

    want = step(ref)
    model = copy.deepcopy(ref)
    enable_activation_checkpointing(model, offload=offload, layers=list(model), keep_attention=True, min_bytes=0)
    stand_in_kernels.clear()
    _assert_same(step(model), want)
    assert stand_in_kernels.count("fwd") == 2


def test_policy_and_extra_ops(stand_in_kernels):
    assert keep_attention_policy(None, ATTENTION_OPS[0]).name == "MUST_SAVE"
    assert keep_attention_policy(None, torch.ops.aten.mm.default).name == "PREFER_RECOMPUTE"
    seen = []

    class _Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def f(x):
        return torch.sin(x @ w).sum()

    mms = []
    for extra in ((), (torch.ops.aten.mm.default,)):
        y = checkpoint(f, torch.randn(4, 8, dtype=torch.float64), use_reentrant=False,
                       context_fn=functools.partial(keep_attention_context, extra))
        seen.clear()
        with _Count():
            y.backward()
        mms.append(seen.count(torch.ops.aten.mm.default))
    assert mms[0] == mms[1] + 1  # the recompute's x @ w, unless it was kept


@pytest.mark.parametrize("bad, error, match", [
    (5, TypeError, "extra_ops must be an iterable of ops"),
    ([torch.ops.aten.mm], ValueError, "not the packet torch.ops.aten.mm.*OpOverloadPacket"),
    (["mm"], ValueError, "got 'mm' of type str"),
])
def test_bad_extra_ops(bad, error, match):
    with pytest.raises(error, match=match):
        keep_attention_context(bad)


def test_bad_keep_attention_value():
    with pytest.raises(ValueError, match="keep_attention must be True or False, got 'yes'"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2), layers=[], keep_attention="yes")


@pytest.mark.parametrize("layers", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_under_torch_compile(stand_in_kernels, keep, layers):
    """Compiled (fullgraph, the ops' fake implementations), a checkpoint follows the policy as well:
    one ``checkpoint`` call, or two layers through ``enable_activation_checkpointing(layers=...)``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block() for _ in range(2 if layers else 1)]).double().train()
    x = torch.randn(2, 24, 16, dtype=torch.float64, requires_grad=True)
    want = model(x)
    want_grad, = torch.autograd.grad(want.square().sum(), x)
    if layers:
        enable_activation_checkpointing(model, layers=list(model), keep_attention=keep)
        fn = model
    else:
        extra = {"context_fn": keep_attention_context} if keep else {}
        fn = lambda t: checkpoint(model, t, use_reentrant=False, **extra)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    stand_in_kernels.clear()
    got = compiled(x)
    got_grad, = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    n = len(model)
    assert stand_in_kernels.count("fwd") == n * (1 if keep else 2) and stand_in_kernels.count("bwd") == n
