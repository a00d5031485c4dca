"""The MLP in chunks of tokens (flashmask.checkpointing.chunk_mlp), on the CPU.

Oracle: the same transformers model (random init, float64) without chunking: logits and every
parameter gradient must agree to float64 rounding, alone and combined with per-layer (offloaded)
checkpointing and the chunked LM loss. Memory: a dispatch mode records every tensor created in
forward and backward; with chunking none may be an ``[S, intermediate]`` tensor (more rows than
a chunk with the intermediate size last), and the same check must catch the unchunked model.
"""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import flashmask.checkpointing as ckpt_mod
from flashmask.checkpointing import chunk_mlp, enable_activation_checkpointing
from flashmask.losses import causal_lm_loss

transformers = pytest.importorskip("transformers")
fm_hf = pytest.importorskip("flashmask.integrations.transformers")

HIDDEN, INTER = 32, 80  # INTER is no other dimension of these models: its tensors are the MLP's


def _model(arch, seed=0):
    kw = dict(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=256, attention_dropout=0.0)
    cfg, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    torch.manual_seed(seed)
    return cls._from_config(cfg(**kw), attn_implementation=fm_hf.ATTN_IMPLEMENTATION).double().train()


def _batch(b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (b, s), generator=g)
    cut = s * 3 // 5  # two documents per row
    pos = torch.cat([torch.arange(cut), torch.arange(s - cut)]).repeat(b, 1)
    return ids, pos


class _Created(TorchDispatchMode):
    """Records the largest tensor an op returns, and the most rows of one whose last dim is ``INTER``."""

    def __init__(self, inter=INTER):
        super().__init__()
        self.inter, self.largest, self.inter_rows = inter, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if t.dim() and t.shape[-1] == self.inter:
                    self.inter_rows = max(self.inter_rows, t.numel() // self.inter)
        return out


def _mlp_rows(model):
    """Hooks recording the tokens of every call of every MLP's gate projection; returns (rows, remove)."""
    rows = []
    hooks = [layer.mlp.gate_proj.register_forward_hook(lambda m, i, o: rows.append(i[0].numel() // i[0].shape[-1]))
             for layer in model.model.layers]
    return rows, lambda: [h.remove() for h in hooks]


def _logits_and_grads(model, ids, pos):
    logits = model(input_ids=ids, position_ids=pos).logits
    (logits.square().mean() + F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _assert_same(got, want, rtol=1e-10, atol=1e-12):
    assert sorted(got) == sorted(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")


# chunks that divide the tokens (48 = 2 rows x 24), that do not (and cross the rows), of one
# token, and of more than all tokens (the original forward, unchanged)
@pytest.mark.parametrize("chunk", [16, 20, 7, 1, 1000])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_mlp_gives_the_logits_and_gradients_of_the_whole(arch, chunk):
    ref = _model(arch)
    model = copy.deepcopy(ref)
    assert chunk_mlp(model, chunk) is model
    ids, pos = _batch(2, 24, seed=chunk)
    want_logits, want = _logits_and_grads(ref, ids, pos)
    rows, remove = _mlp_rows(model)
    got_logits, got = _logits_and_grads(model, ids, pos)
    remove()
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-12, atol=1e-12)
    _assert_same(got, want)
    # the MLPs really ran in chunks: forward and the backward recompute of each chunk
    n_chunks = -(-48 // chunk)
    assert max(rows) == min(chunk, 48) and len(rows) == 2 * n_chunks * (2 if chunk < 48 else 1)
    assert model.state_dict().keys() == ref.state_dict().keys()  # nothing renamed or added


def test_float32_within_rounding_and_no_grad_path():
    ref = _model("llama").float()
    model = chunk_mlp(copy.deepcopy(ref), 10)
    ids, pos = _batch(1, 45, seed=3)
    want_logits, want = _logits_and_grads(ref, ids, pos)
    got_logits, got = _logits_and_grads(model, ids, pos)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    _assert_same(got, want, rtol=1e-4, atol=1e-6)
    with torch.no_grad(), _Created() as rec:  # without grad: plain chunks, no checkpoint
        out = model(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(out, want_logits, rtol=1e-5, atol=1e-5)
    assert rec.inter_rows <= max(10, HIDDEN) < 45  # HIDDEN: the weights [I, H] transposed


@pytest.mark.slow
@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("chunk_first", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_with_layer_checkpoints_and_the_chunked_loss(arch, offload, chunk_first, monkeypatch):
    s, chunk = 100, 30  # chunks 30, 30, 30, 10
    ref = _model(arch, seed=1)
    ids, pos = _batch(1, s, seed=4)

    def step(model):
        inputs = []  # the MLP inputs of the forward
        hooks = [layer.mlp.register_forward_pre_hook(lambda m, a: inputs.append(weakref.ref(a[0])))
                 for layer in model.model.layers]
        with _Created() as rec:
            hidden = model.model(input_ids=ids, position_ids=pos).last_hidden_state
            for h in hooks:
                h.remove()
            gc.collect()
            kept = sum(r() is not None for r in inputs)
            causal_lm_loss(hidden, model.lm_head, ids, chunk_size=16).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return grads, rec.inter_rows, kept

    def checkpointed(chunked):
        m = copy.deepcopy(ref)
        if chunked and chunk_first:
            chunk_mlp(m, chunk)
        enable_activation_checkpointing(m, offload=offload, min_bytes=0)
        if chunked and not chunk_first:
            chunk_mlp(m, chunk)
        return m

    copies = []
    init = ckpt_mod._HostCopy.__init__
    monkeypatch.setattr(ckpt_mod._HostCopy, "__init__", lambda self, x: (copies.append(x.shape), init(self, x))[1])
    want, plain_rows, _ = step(copy.deepcopy(ref))
    _, ckpt_rows, _ = step(checkpointed(False))
    copies.clear()
    got, rows, kept = step(checkpointed(True))
    _assert_same(got, want)
    assert copies == ([(1, s, HIDDEN)] * 2 if offload else [])  # the layer inputs went to the host
    # the chunks' checkpoints save their inputs through the layer's checkpoint, which drops them:
    # between forward and backward nothing of the MLPs stays besides the layer inputs
    assert kept == 0
    # [S, intermediate] tensors: made by the plain and the layer-checkpointed model (in the
    # recompute), never with chunking (forward, recompute of the layer, backward of the chunks)
    assert plain_rows >= s and ckpt_rows >= s
    assert rows <= max(chunk, HIDDEN) < s  # HIDDEN: down_proj's weight [H, I] and its gradient


def test_one_mlp_call_creates_no_sequence_by_intermediate_tensor():
    s, h, inter, chunk = 256, 16, 96, 32
    cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=inter, num_attention_heads=2)
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.mlp = transformers.models.llama.modeling_llama.LlamaMLP(cfg)
    x = torch.randn(1, s, h)

    def call():
        with _Created(inter) as rec:
            xs = x.clone().requires_grad_()
            holder.mlp(xs).square().sum().backward()
        grads = [xs.grad] + [p.grad.clone() for p in holder.mlp.parameters()]
        holder.mlp.zero_grad(set_to_none=True)
        return rec, grads

    whole, want = call()
    chunk_mlp(holder, chunk)
    chunked, got = call()
    assert whole.largest >= s * inter and whole.inter_rows == s  # the check catches the whole call
    assert chunked.largest <= max(s * h, inter * h, chunk * inter) < s * inter
    assert chunked.inter_rows == chunk
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunk_size_changes_on_a_second_call_and_copies_keep_it():
    model = chunk_mlp(_model("llama"), 16)
    mlp = model.model.layers[0].mlp
    inner = mlp._flashmask_mlp_forward
    chunk_mlp(model, 5)
    assert mlp._flashmask_mlp_forward is inner and mlp._flashmask_mlp_chunk_tokens == 5  # not wrapped twice
    twin = copy.deepcopy(model)
    rows, remove = _mlp_rows(twin)
    with torch.no_grad():
        twin(input_ids=torch.zeros(1, 12, dtype=torch.long))
    remove()
    assert rows == [5, 5, 2] * 2  # the copy's MLPs run their own chunks


def test_errors():
    with pytest.raises(ValueError, match="no submodule named 'mlp'"):
        chunk_mlp(torch.nn.Sequential(torch.nn.Linear(4, 4)), 8)
    model = _model("llama")
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match="chunk_tokens"):
            chunk_mlp(model, bad)

    class Pair(torch.nn.Module):  # an MLP with a second output is not supported
        def forward(self, x):
            return x, x.sum()

    holder = torch.nn.Module()
    holder.mlp = Pair()
    chunk_mlp(holder, 2)
    with pytest.raises(TypeError, match="one tensor"):
        holder.mlp(torch.randn(5, 3))


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_chunked_mixture_of_experts_equals_plain(family):
    """Mixture-of-experts blocks route per token: in chunks (GPT-OSS's gets [1, c, H] and returns its
    router scores too) the logits and every gradient are those of the whole call."""
    from tests import model_zoo

    if not model_zoo.has_family(transformers, family):
        pytest.skip(f"this transformers has no {family}")
    ref = model_zoo.make_model(transformers, family, fm_hf.ATTN_IMPLEMENTATION)
    model = chunk_mlp(copy.deepcopy(ref), 5)
    ids = torch.randint(0, model_zoo.VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    tokens = []  # per call of a router: the tokens it routes
    for name, m in model.named_modules():
        if name.endswith((".mlp.router", ".mlp.gate")):
            m.register_forward_pre_hook(lambda mod, args: tokens.append(args[0].numel() // args[0].shape[-1]))
    out = [m(input_ids=ids, labels=ids, use_cache=False) for m in (ref, model)]
    for o in out:
        o.loss.backward()
    assert tokens and max(tokens) == 5, tokens  # chunks of the 18 tokens (and their recomputation)
    torch.testing.assert_close(out[1].logits, out[0].logits, rtol=1e-5, atol=1e-5)
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
