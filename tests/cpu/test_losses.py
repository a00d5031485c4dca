"""The chunked LM head + cross-entropy (flashmask.losses) and offloaded activation checkpointing
(flashmask.checkpointing), on the CPU.

Oracle: the plain ``cross_entropy(linear(hidden, weight, bias).float(), targets)`` with its
autograd gradients, and un-checkpointed models. Memory: a dispatch mode records every tensor
that the chunked loss creates (forward and backward); none may have ``N * V`` elements.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from flashmask.checkpointing import enable_activation_checkpointing, offload_checkpoint
from flashmask.losses import causal_lm_loss, linear_cross_entropy, linear_token_logps


def _plain(h, w, y, b=None, reduction="mean", normalizer=None):
    logits = F.linear(h, w, b)
    logits = logits.double() if h.dtype == torch.float64 else logits.float()
    loss = F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
    if normalizer is not None:
        return loss / normalizer
    return loss / (y != -100).sum().clamp_min(1) if reduction == "mean" else loss


def _data(n, hdim, v, dtype, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(v, hdim, generator=g, dtype=torch.float64) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.1).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.3] = -100
    return h, w, b, y


@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "normalizer"])
def test_values_and_gradients_match_the_plain_loss_float64(chunk, bias, reduction):
    h, w, b, y = _data(37, 12, 50, torch.float64, seed=chunk + 3 * bias, bias=bias)
    kw = {"normalizer": 100.0} if reduction == "normalizer" else {"reduction": reduction}
    loss = linear_cross_entropy(h, w, y, b, chunk_size=chunk, **kw)
    params = [t for t in (h, w, b) if t is not None]
    got = torch.autograd.grad(loss * 1.7, params)  # a non-unit upstream gradient
    ref = _plain(h, w, y, b, reduction=reduction if reduction != "normalizer" else "sum",
                 normalizer=kw.get("normalizer"))
    want = torch.autograd.grad(ref * 1.7, params)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for g1, g2 in zip(got, want):
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_bfloat16_matches_the_plain_loss():
    h, w, _, y = _data(64, 32, 300, torch.bfloat16, seed=5)
    loss = linear_cross_entropy(h, w, y, chunk_size=16)
    gh, gw = torch.autograd.grad(loss, (h, w))
    ref = _plain(h, w, y)
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert loss.dtype == torch.float32 and gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)
    # the plain loss rounds d logits to bf16 once per GEMM, as we do; d weight is summed in fp32 here
    torch.testing.assert_close(gh.float(), rh.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw.float(), rw.float(), rtol=2e-2, atol=2e-3)


def test_all_targets_ignored_gives_zero_loss_and_gradients():
    h, w, _, y = _data(10, 8, 20, torch.float32, seed=1)
    y[:] = -100
    loss = linear_cross_entropy(h, w, y, chunk_size=3)
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0 and not gh.any() and not gw.any()


def test_no_grad_and_frozen_head():
    h, w, _, y = _data(10, 8, 20, torch.float64, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y, chunk_size=4), _plain(h, w, y))
    w2 = w.detach()
    loss = linear_cross_entropy(h, w2, y, chunk_size=4)
    (gh,) = torch.autograd.grad(loss, (h,))
    (rh,) = torch.autograd.grad(_plain(h, w2, y), (h,))
    torch.testing.assert_close(gh, rh)


class _Sizes(TorchDispatchMode):
    """Records the element count of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_n_by_vocab_is_ever_created():
    n, hdim, v, chunk = 512, 16, 1000, 64
    h, w, _, y = _data(n, hdim, v, torch.float32, seed=3)
    with _Sizes() as rec:
        loss = linear_cross_entropy(h, w, y, chunk_size=chunk)
        loss.backward()
    assert rec.largest <= chunk * v, f"a tensor of {rec.largest} elements (chunk x V = {chunk * v})"
    with _Sizes() as plain:  # the check would catch the plain loss
        _plain(h, w, y).backward()
    assert plain.largest >= n * v


def test_causal_lm_loss_matches_transformers_shift():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, 30, bias=False).double()
    labels = torch.randint(0, 30, (2, 9), generator=g)
    labels[0, :3] = -100
    got = causal_lm_loss(hidden, head, labels, chunk_size=5)
    logits = head(hidden)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 30), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(got, want)
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    torch.testing.assert_close(causal_lm_loss(hidden, head, shift_labels=shifted, num_items_in_batch=40),
                               F.cross_entropy(logits.reshape(-1, 30), shifted.reshape(-1), ignore_index=-100,
                                               reduction="sum") / 40)
    with pytest.raises(ValueError, match="exactly one"):
        causal_lm_loss(hidden, head)
    with pytest.raises(ValueError, match="do not match"):
        causal_lm_loss(hidden, head, labels[:, :5])


@pytest.mark.parametrize("bias", [False, True])
def test_token_logps_values_and_gradients(bias):
    h, w, b, y = _data(29, 12, 40, torch.float64, seed=7 + bias, bias=bias)
    y = y.view(1, 29)
    hh = h.view(1, 29, 12)
    got = linear_token_logps(hh, w, y, b, chunk_size=8)
    logp = torch.log_softmax(F.linear(hh, w, b), -1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    want = torch.where(y != -100, logp, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn(1, 29, dtype=torch.float64)
    params = [t for t in (h, w, b) if t is not None]
    for a, c in zip(torch.autograd.grad((got * g).sum(), params), torch.autograd.grad((want * g).sum(), params)):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)
    with _Sizes() as rec:  # no [N, V] tensor in forward or backward
        (linear_token_logps(hh, w, y, b, chunk_size=8) * g).sum().backward()
    assert rec.largest <= max(8 * 40, 40 * 12) < 29 * 40  # a chunk of logits, or d weight


def test_input_errors():
    h, w, _, y = _data(6, 8, 10, torch.float32, seed=4)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, y[:5])
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, w[:, :4], y)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(TypeError, match="integer"):
        linear_cross_entropy(h, w, y.float())


# ------------------------------------------------------------------------------------------------
# activation checkpointing with offloaded checkpoints


class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x, scale=1.0):
        return x + self.b(torch.tanh(self.a(x))) * scale


def _grads(model, x):
    out = x
    for layer in model:
        out = layer(out, scale=0.5)
    (out.square().sum()).backward()
    g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out.detach(), g


def test_offload_checkpoint_frees_the_inputs_and_gives_the_same_gradients():
    torch.manual_seed(0)
    d = 16
    plain = torch.nn.Sequential(*[_Block(d) for _ in range(3)]).double()
    ckpt = torch.nn.Sequential(*[_Block(d) for _ in range(3)]).double()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(4, 32, d, dtype=torch.float64)
    want_out, want = _grads(plain, x.clone().requires_grad_())

    seen = []  # the inputs of layers 1 and 2 (outputs of 0 and 1): offloaded after the forward
    xs = x.clone().requires_grad_()
    h = xs
    for i, layer in enumerate(ckpt):
        h_in = h
        h = offload_checkpoint(layer, h_in, scale=0.5, min_bytes=0)
        if i > 0:
            seen.append(h_in)
    assert all(t.untyped_storage().nbytes() == 0 for t in seen), "the layer inputs were not offloaded"
    assert xs.untyped_storage().nbytes() == 0  # the first input too (a leaf that owns its storage)
    h.square().sum().backward()
    got = [p.grad.clone() for p in ckpt.parameters()]
    assert all(t.untyped_storage().nbytes() > 0 for t in seen), "the inputs were not restored"
    torch.testing.assert_close(h.detach(), want_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xs, x)


def test_enable_activation_checkpointing_on_plain_layers():
    torch.manual_seed(1)
    d = 8
    plain = torch.nn.Sequential(*[_Block(d) for _ in range(2)]).double()
    model = torch.nn.Sequential(*[_Block(d) for _ in range(2)]).double()
    model.load_state_dict(plain.state_dict())
    enable_activation_checkpointing(model, offload=True, layers=list(model), min_bytes=0)
    x = torch.randn(3, 5, d, dtype=torch.float64)
    _, want = _grads(plain, x.clone().requires_grad_())
    _, got = _grads(model, x.clone().requires_grad_())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_hf_model_with_offloaded_checkpoints_matches_plain(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import flashmask.integrations.transformers as fm_hf
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=128,
                                   attention_dropout=0.0)
    torch.manual_seed(0)
    a = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=fm_hf.ATTN_IMPLEMENTATION).double()
    b = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=fm_hf.ATTN_IMPLEMENTATION).double()
    b.load_state_dict(a.state_dict())
    a.train()
    b.train()
    enable_activation_checkpointing(b, offload=True, min_bytes=0)
    ids = torch.randint(0, 96, (1, 40))
    pos = torch.cat([torch.arange(25), torch.arange(15)]).view(1, 40)
    import flashmask.checkpointing as ckpt_mod
    copies = []
    init = ckpt_mod._HostCopy.__init__

    def counting_init(self, x):
        copies.append(x.shape)
        init(self, x)

    monkeypatch.setattr(ckpt_mod._HostCopy, "__init__", counting_init)
    for model in (a, b):
        hidden = model.model(input_ids=ids, position_ids=pos).last_hidden_state
        causal_lm_loss(hidden, model.lm_head, ids, chunk_size=16).backward()
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{na}: {m}")
    # the offload really ran, once per layer of the checkpointed model
    assert all(layer._gradient_checkpointing_func.func is offload_checkpoint for layer in b.model.layers)
    assert copies == [(1, 40, 64)] * 3
    # "auto" offloads only inputs above the threshold (1 MiB by default off the GPU): none here
    copies.clear()
    c = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=fm_hf.ATTN_IMPLEMENTATION).double()
    c.load_state_dict(a.state_dict())
    enable_activation_checkpointing(c.train(), offload="auto")
    hidden = c.model(input_ids=ids, position_ids=pos).last_hidden_state
    causal_lm_loss(hidden, c.lm_head, ids, chunk_size=16).backward()
    assert copies == []
    for (na, pa), (nc, pc) in zip(a.named_parameters(), c.named_parameters()):
        torch.testing.assert_close(pa.grad, pc.grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="offload"):
        enable_activation_checkpointing(c, offload="yes")


# ------------------------------------------------------------------------------------------------ final logit softcap

@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_logit_softcap_matches_the_capped_plain_loss(chunk, bias):
    h, w, b, y = _data(23, 12, 40, torch.float64, seed=20 + chunk + bias, bias=bias)
    w = (w.detach() * 10).requires_grad_()  # logits of several units: a cap of 3 bends them
    capped = lambda logits: 3.0 * torch.tanh(logits / 3.0)  # noqa: E731
    got = linear_cross_entropy(h, w, y, b, chunk_size=chunk, logit_softcap=3.0)
    want = F.cross_entropy(capped(F.linear(h, w, b)), y, ignore_index=-100)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (got - _plain(h, w, y, b)).abs() > 1e-2  # the cap matters here
    params = [t for t in (h, w, b) if t is not None]
    for a, c in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)
    # the per-token log-probabilities, capped alike
    lp = linear_token_logps(h, w, y, b, chunk_size=chunk, logit_softcap=3.0)
    want_lp = torch.where(y != -100, torch.log_softmax(capped(F.linear(h, w, b)), -1).gather(
        -1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-12)
    g = torch.randn(23, dtype=torch.float64)
    for a, c in zip(torch.autograd.grad((lp * g).sum(), params), torch.autograd.grad((want_lp * g).sum(), params)):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


def test_causal_lm_loss_with_final_logit_softcap_equals_gemma2():
    transformers = pytest.importorskip("transformers")
    from flashmask.losses import final_logit_softcap

    cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    final_logit_softcapping=1.0, initializer_range=0.5,
                                    attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).double()
    assert final_logit_softcap(model) == 1.0 and final_logit_softcap(torch.nn.Linear(2, 2)) is None
    ids = torch.randint(0, 64, (2, 9))
    want = model(input_ids=ids, labels=ids).loss
    hidden = model.model(input_ids=ids).last_hidden_state
    got = causal_lm_loss(hidden, model.lm_head, ids, chunk_size=5, logit_softcap=final_logit_softcap(model))
    torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=1e-6)
    uncapped = causal_lm_loss(hidden, model.lm_head, ids, chunk_size=5)
    assert (uncapped - want).abs() > 1e-2


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), True, "3"])
def test_bad_logit_softcap_raises(bad):
    h, w, _, y = _data(6, 8, 10, torch.float32, seed=4)
    with pytest.raises(ValueError, match="logit_softcap must be None or a finite float >= 0"):
        linear_cross_entropy(h, w, y, logit_softcap=bad)
    with pytest.raises(ValueError, match="logit_softcap must be None or a finite float >= 0"):
        linear_token_logps(h, w, y, logit_softcap=bad)


def test_decoder_of_finds_the_decoder_or_raises():
    """get_decoder() where it gives a submodule; .model where it gives the causal LM itself (Llama 4 on
    transformers 5.x); a clear error where neither exists."""
    from flashmask.losses import decoder_of

    inner = torch.nn.Linear(2, 2)

    class WithDecoder(torch.nn.Module):
        def get_decoder(self):
            return inner

    class ItselfAsDecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = inner

        def get_decoder(self):
            return self

    assert decoder_of(WithDecoder()) is inner
    assert decoder_of(ItselfAsDecoder()) is inner
    with pytest.raises(ValueError, match="cannot find the decoder of Linear"):
        decoder_of(torch.nn.Linear(2, 2))
