"""The byte-level tokenizer of the built-in model presets, as a Hugging Face tokenizer.

UTF-8 bytes are ids 0-255; 256 = ``<pad>``, 257 = ``<s>`` (BOS), 258 = ``</s>`` (EOS). It is a
``PreTrainedTokenizerFast`` built locally (nothing is downloaded), so a checkpoint saves it with
``save_pretrained`` and ``--model CHECKPOINT`` loads it back with ``AutoTokenizer``, exactly as a
real model's tokenizer.

Example::

    >>> tok = byte_tokenizer()
    >>> tok("hi", add_special_tokens=False)["input_ids"], tok.bos_token_id, tok.eos_token_id
    ([104, 105], 257, 258)
"""
from __future__ import annotations

from typing import Dict

PAD, BOS, EOS = 256, 257, 258
#: Rows of the embedding table of the presets: the 259 ids rounded up to a multiple of 64.
VOCAB_SIZE = 320


def _bytes_to_unicode() -> Dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2's): printable Latin-1 bytes
    stand for themselves, the others are moved to code points 256 and up, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
    keep |= set(range(ord("®"), ord("ÿ") + 1))
    table, moved = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + moved)
            moved += 1
    return table


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` whose ids are the UTF-8 bytes (a BPE without merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab.update({"<pad>": PAD, "<s>": BOS, "</s>": EOS})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
