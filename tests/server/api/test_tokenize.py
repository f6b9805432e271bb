"""server/api/tokenize.py: prompts up to INLINE_CHARS (a chat-sized system prompt) are tokenized on
the event loop, longer text in a worker thread, and both give what `tokenizer.encode` gives.
(tests/server/api/test_adversarial.py checks that long prompts never stall the loop.)"""

import asyncio

import pytest
from transformers import AutoTokenizer

from models import EMBEDDED_MODEL
from server.api import tokenize

WORDS = "the of and to in is was for on that with as by at from naïve café 東京 🙂 \n".split(" ")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL))


def _text(chars: int) -> str:
    out = []
    while sum(map(len, out)) + len(out) < chars:
        out.append(WORDS[len(out) % len(WORDS)])
    return " ".join(out)[:chars]


def _encode(tokenizer, texts, monkeypatch) -> tuple[list[list[int]], int]:
    """encode's ids, and how many times it handed work to a thread."""
    threads = []
    real = asyncio.to_thread

    async def counting(fn, *args):
        threads.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(tokenize.asyncio, "to_thread", counting)
    return asyncio.run(tokenize.encode(tokenizer, texts)), len(threads)


def test_a_system_prompt_sized_text_is_tokenized_inline(tokenizer, monkeypatch):
    # ~3,000 characters: a 512-1,024-token system prompt, what a prefix-aware router renders on
    # every replica before each request
    text = _text(3000)
    ids, threads = _encode(tokenizer, [text], monkeypatch)
    assert ids == [tokenizer.encode(text)] and threads == 0
    at_limit = _text(tokenize.INLINE_CHARS)
    assert _encode(tokenizer, [at_limit], monkeypatch) == ([tokenizer.encode(at_limit)], 0)


def test_longer_text_is_tokenized_in_a_thread(tokenizer, monkeypatch):
    texts = [_text(tokenize.INLINE_CHARS // 2 + 1), _text(tokenize.INLINE_CHARS // 2 + 7), ""]  # together past it
    ids, threads = _encode(tokenizer, texts, monkeypatch)
    assert ids == [tokenizer.encode(t) for t in texts] and threads == 1
