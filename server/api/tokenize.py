"""Tokenizing prompts on the HTTP side without stalling the event loop.

A 65,536-character prompt takes ~55 ms to tokenize on a small CPU, and a /v1/completions body may
carry up to MAX_CHOICES prompts: on the event loop, every other client (and /health) would wait
for it (issue 23: /health took 3.6-5.7 s beside one such body). So text goes to a worker thread
(the tokenizers library releases the GIL while it works), as a batch. Short text stays inline:
below INLINE_CHARS, tokenizing costs less than the hand-off (measured on a 2-core CPU: ~0.2 ms
for 500 characters, ~0.35 ms more for `asyncio.to_thread`), so the common single short prompt is
not slowed. Decoding (POST /detokenize, and token strings for POST /tokenize: server/api/tokens.py)
follows the same rule by id count.
"""

from __future__ import annotations

import asyncio

INLINE_CHARS = 512
# Ids decoded inline: 2,000 decode in ~0.3 ms on a 2-core CPU (token strings in ~0.55 ms), about
# what the hand-off to a thread costs; a 1 MiB body can carry some 200,000 of them.
INLINE_IDS = 2048


def _encode_batch(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    # tokenizer(texts) encodes as tokenizer.encode(text) does, in one call.
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


async def encode(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """The token ids of each text, as `tokenizer.encode(text, add_special_tokens=...)` gives them
    (with them by default, as every prompt route wants; POST /tokenize may ask for none)."""
    if sum(map(len, texts)) <= INLINE_CHARS:
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    return await asyncio.to_thread(_encode_batch, tokenizer, texts, add_special_tokens)


async def decode(tokenizer, ids: list[int]) -> str:
    """`tokenizer.decode(ids)`; every id must be in the tokenizer's vocabulary (the caller checks)."""
    if len(ids) <= INLINE_IDS:
        return tokenizer.decode(ids)
    return await asyncio.to_thread(tokenizer.decode, ids)


async def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Each id's token as the vocabulary spells it (`convert_ids_to_tokens`: 'Ġfox', not ' fox')."""
    if len(ids) <= INLINE_IDS:
        return tokenizer.convert_ids_to_tokens(ids)
    return await asyncio.to_thread(tokenizer.convert_ids_to_tokens, ids)
