"""Tokenizing prompts on the HTTP side without stalling the event loop.

A 65,536-character prompt takes ~55 ms to tokenize on a small CPU, and a /v1/completions body may
carry up to MAX_CHOICES prompts: on the event loop, every other client (and /health) would wait
for it (issue 23: /health took 3.6-5.7 s beside one such body). So long text goes to a worker
thread (the tokenizers library releases the GIL while it works), as a batch. Text up to
INLINE_CHARS (~2,000 tokens) stays inline: it costs the loop at most ~2 ms on a small CPU (~0.6 ms
for 2,500 characters), while the hand-off costs ~0.35 ms more and, on a loop busy streaming, the
worker thread then waits for the GIL (up to the 5 ms switch interval) before its result is seen.
Measured on a 2-core CPU beside 8 streams, a 1,500-2,800-character render took 6.7-7.3 ms at p50
through the thread against 4.1 ms inline; a prefix-aware router waits for that render on every
replica before each request (server/api/render.py). (On a 32-core host with four API processes a
replica, benchmarks/bench_scaleout.py saw no difference beyond run-to-run noise: README.) Decoding (POST /detokenize, and token strings
for POST /tokenize: server/api/tokens.py) follows the same rule by id count.
"""

from __future__ import annotations

import asyncio

INLINE_CHARS = 8192
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
