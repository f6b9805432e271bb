"""Tokenizing prompts on the HTTP side without stalling the event loop.

A 65,536-character prompt takes ~55 ms to tokenize on a small CPU, and a /v1/completions body may
carry up to MAX_CHOICES prompts: on the event loop, every other client (and /health) would wait
for it (issue 23: /health took 3.6-5.7 s beside one such body). So text goes to a worker thread
(the tokenizers library releases the GIL while it works), as a batch. Short text stays inline:
below INLINE_CHARS, tokenizing costs less than the hand-off (measured on a 2-core CPU: ~0.2 ms
for 500 characters, ~0.35 ms more for `asyncio.to_thread`), so the common single short prompt is
not slowed.
"""

from __future__ import annotations

import asyncio

INLINE_CHARS = 512


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    # tokenizer(texts) encodes as tokenizer.encode(text) does (special tokens included), in one call.
    return [list(ids) for ids in tokenizer(texts)["input_ids"]]


async def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """The token ids of each text, as `tokenizer.encode` gives them."""
    if sum(map(len, texts)) <= INLINE_CHARS:
        return [tokenizer.encode(t) for t in texts]
    return await asyncio.to_thread(_encode_batch, tokenizer, texts)
