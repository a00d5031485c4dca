"""Prompts and answers as token ids: the tokenizer's chat template when it has one, else a plain
``User: ...\nAssistant: `` format; answers end with the tokenizer's EOS token."""
from __future__ import annotations

from typing import List


def prompt_text(instruction: str) -> str:
    """The prompt format of the examples for tokenizers without a chat template."""
    return f"User: {instruction}\nAssistant: "


def encode(tok, text: str) -> List[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tok, instruction: str, use_chat_template: bool = True) -> List[int]:
    """Token ids of a user turn up to where the answer starts: the tokenizer's chat template when it
    has one (and ``use_chat_template``), else ``<bos>User: ...\\nAssistant: ``."""
    if use_chat_template and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                       add_generation_prompt=True)
        return encode(tok, text)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return bos + encode(tok, prompt_text(instruction))


def answer_ids(tok, text: str) -> List[int]:
    return encode(tok, text) + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
