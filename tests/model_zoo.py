"""Small random transformers models with the attention of today's open model families, for the
model-zoo tests (tests/cpu/test_model_zoo.py, tests/gpu/test_model_zoo.py).

Each keeps its family's attention shape: the head dims (Phi-3 96, Gemma 256, GPT-OSS 64, DeepSeek-V3's
multi-head latent attention with q/k 128 + 64 and v 128), the ratio of query to key/value heads, the
pattern of sliding-window and global layers (with a window shorter than the test rows), Llama 4's
chunked and global layers (a chunk shorter than the test rows), Gemma 2's
logit soft-capping and GPT-OSS's attention sinks; everything else is tiny (hidden size 64, two
layers, a vocabulary of 128). Weights are drawn with a standard deviation of 0.2 (not the families'
0.02) so that the attention is far from uniform: the scores span several units, the soft-capping
(at 2 here) bends them, and the sinks (drawn again with a standard deviation of 1) take a visible
share of each row.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

VOCAB = 128
WINDOW = 6  # the sliding window of the families that have one, shorter than the test rows
CHUNK = 4  # Llama 4's attention chunk, shorter than the test rows
INIT_STD = 0.2

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=256,
              attention_dropout=0.0, initializer_range=INIT_STD, tie_word_embeddings=False)


def _llama3(t):
    return t.LlamaForCausalLM, t.LlamaConfig(**COMMON, intermediate_size=128, num_attention_heads=4,
                                             num_key_value_heads=1, head_dim=128,
                                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                              "factor": 8.0, "low_freq_factor": 1.0,
                                                              "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 64})


def _qwen3(t):
    return t.Qwen3ForCausalLM, t.Qwen3Config(**COMMON, intermediate_size=128, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=128)


def _mistral(t):
    return t.MistralForCausalLM, t.MistralConfig(**COMMON, intermediate_size=128, num_attention_heads=4,
                                                 num_key_value_heads=1, head_dim=128, sliding_window=WINDOW)


def _phi3(t):
    cfg = dict(COMMON, hidden_size=192)
    return t.Phi3ForCausalLM, t.Phi3Config(**cfg, intermediate_size=128, num_attention_heads=2,
                                           num_key_value_heads=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _gemma2(t):
    return t.Gemma2ForCausalLM, t.Gemma2Config(**COMMON, intermediate_size=128, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256,
                                               sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                               final_logit_softcapping=30.0,
                                               layer_types=["sliding_attention", "full_attention"])


def _gemma3(t):
    return t.Gemma3ForCausalLM, t.Gemma3TextConfig(**COMMON, intermediate_size=128, num_attention_heads=4,
                                                   num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                                                   sliding_window=WINDOW,
                                                   layer_types=["sliding_attention", "full_attention"])


def _gpt_oss(t):
    # a tiny mixture of experts (4 experts, 2 per token) as in the real model
    return t.GptOssForCausalLM, t.GptOssConfig(**COMMON, intermediate_size=64, num_attention_heads=8,
                                               num_key_value_heads=2, head_dim=64, num_local_experts=4,
                                               num_experts_per_tok=2, sliding_window=WINDOW,
                                               layer_types=["sliding_attention", "full_attention"],
                                               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                                "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                                "truncate": False,
                                                                "original_max_position_embeddings": 64})


def _deepseek_v3(t):
    # layer 0 dense, layer 1 a small mixture of experts, as in the real model
    return t.DeepseekV3ForCausalLM, t.DeepseekV3Config(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128)


def _llama4(t):
    # layer 0 chunked attention with RoPE and a mixture of experts, layer 1 global without RoPE (NoPE)
    return t.Llama4ForCausalLM, t.Llama4TextConfig(
        **COMMON, intermediate_size=32, intermediate_size_mlp=128, num_attention_heads=4, num_key_value_heads=1,
        head_dim=128, num_local_experts=2, num_experts_per_tok=1, moe_layers=[0], no_rope_layers=[1, 0],
        attention_chunk_size=CHUNK, use_qk_norm=True)


#: family -> (transformers) -> (model class, config)
FAMILIES: Dict[str, Callable] = {
    "llama3": _llama3, "qwen3": _qwen3, "mistral": _mistral, "phi3": _phi3, "gemma2": _gemma2, "gemma3": _gemma3,
    "gpt_oss": _gpt_oss, "deepseek_v3": _deepseek_v3, "llama4": _llama4,
}

#: family -> what each layer's attention gets: Dqk, Dv, Hq, Hk, the sliding window of each layer
#: (None: global), softcap (0: off), sinks
SHAPES: Dict[str, dict] = {
    "llama3": dict(dqk=128, dv=128, hq=4, hk=1, windows=(None, None), softcap=0.0, sinks=False),
    "qwen3": dict(dqk=128, dv=128, hq=4, hk=2, windows=(None, None), softcap=0.0, sinks=False),
    "mistral": dict(dqk=128, dv=128, hq=4, hk=1, windows=(WINDOW, WINDOW), softcap=0.0, sinks=False),
    "phi3": dict(dqk=96, dv=96, hq=2, hk=1, windows=(None, None), softcap=0.0, sinks=False),
    "gemma2": dict(dqk=256, dv=256, hq=4, hk=2, windows=(WINDOW, None), softcap=2.0, sinks=False),
    "gemma3": dict(dqk=256, dv=256, hq=4, hk=1, windows=(WINDOW, None), softcap=0.0, sinks=False),
    "gpt_oss": dict(dqk=64, dv=64, hq=8, hk=2, windows=(WINDOW, None), softcap=0.0, sinks=True),
    "deepseek_v3": dict(dqk=192, dv=128, hq=2, hk=2, windows=(None, None), softcap=0.0, sinks=False),
    "llama4": dict(dqk=128, dv=128, hq=4, hk=1, windows=(None, None), softcap=0.0, sinks=False),
}


def has_family(transformers, family: str) -> bool:
    try:
        FAMILIES[family](transformers)
    except AttributeError:  # this transformers lacks the model
        return False
    return True


def chunks_follow_documents(transformers) -> bool:
    """Whether this transformers counts Llama 4's chunks from each packed document's first token (as
    the document alone would see them) rather than from the row's; the backend follows the model's
    own mask either way."""
    return hasattr(transformers.masking_utils, "remap_positions_for_packed_sequence")


def set_impl(model, name: str):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # transformers 4.53
        model.config._attn_implementation = name
    assert model.config._attn_implementation == name
    return model


def make_model(transformers, family: str, attn_implementation: str, seed: int = 0, **config):
    """The family's small random model (float32, train mode), with the sinks drawn at a standard
    deviation of 1 where it has them; ``config`` overrides fields of its config (e.g. the vocabulary)."""
    cls, cfg = FAMILIES[family](transformers)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=attn_implementation)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.normal_(0.0, 1.0)
    return model.train()


def sinks_parameters(model) -> Dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if n.endswith("self_attn.sinks")}


def padded_batch(lens, side: str, seed: int, vocab: int = VOCAB) -> dict:
    """A batch of len(lens) rows padded on the `side` ("right" or "left") to the longest, with labels
    on the real tokens only. Left-padded rows have no target for their first real token: the padding
    before it would predict it, from a row that sees no key (eager's output there is a uniform
    average over every key, flashmask's and sdpa's 0)."""
    g = torch.Generator().manual_seed(seed)
    s = max(lens)
    ids = torch.randint(1, vocab, (len(lens), s), generator=g)
    am = torch.zeros(len(lens), s, dtype=torch.long)
    for i, n in enumerate(lens):
        am[i, :n] = 1
        if side == "left":
            am[i] = am[i].flip(0)
    labels = ids.masked_fill(am == 0, -100)
    if side == "left":
        labels[torch.arange(len(lens)), s - torch.tensor(lens)] = -100
    return {"input_ids": ids, "attention_mask": am, "labels": labels}


def logits_and_grads(model, name: str, batches, restore: str):
    """The logits of each batch (dicts of model inputs with labels) and the parameter gradients of
    their summed losses under attention ``name``; the model goes back to attention ``restore``."""
    set_impl(model, name)
    model.zero_grad()
    logits = []
    for b in batches:
        out = model(**b, use_cache=False)
        out.loss.backward()
        logits.append(out.logits.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    set_impl(model, restore)
    return logits, grads
