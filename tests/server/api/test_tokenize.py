"""server/api/tokenize.py: prompts up to INLINE_CHARS (a chat-sized system prompt) are tokenized on
the event loop, longer text in a worker thread, and both give what `tokenizer.encode` gives; a
prompt encoded lately is remembered, within the memo's bounds.
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


@pytest.fixture(autouse=True)
def _forget():
    tokenize._memos.clear()  # each test starts with nothing remembered
    yield


class Counting:
    """A tokenizer that counts the texts it is asked to encode (one by one or as a batch)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.texts = tokenizer, []

    def encode(self, text, add_special_tokens=True):
        self.texts.append(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def __call__(self, texts, add_special_tokens=True):
        self.texts.extend(texts)
        return self.tokenizer(texts, add_special_tokens=add_special_tokens)


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


def test_a_prompt_encoded_again_is_remembered(tokenizer, monkeypatch):
    tok = Counting(tokenizer)
    short, long = _text(3000), _text(tokenize.INLINE_CHARS + 100)
    first, threads = _encode(tok, [short, long], monkeypatch)
    assert first == [tokenizer.encode(short), tokenizer.encode(long)] and threads == 1
    assert tok.texts == [short, long]
    first[0].append(-1)  # what a caller does with its ids is its own
    again, threads = _encode(tok, [long, short], monkeypatch)
    assert again == [tokenizer.encode(long), tokenizer.encode(short)] and threads == 0
    assert tok.texts == [short, long]  # nothing encoded the second time
    other = _text(500)
    mixed, _ = _encode(tok, [short, other, long], monkeypatch)
    assert mixed == [tokenizer.encode(t) for t in (short, other, long)] and tok.texts[2:] == [other]
    # without special tokens is another prompt (POST /tokenize may ask for it)
    bare = asyncio.run(tokenize.encode(tok, [short], add_special_tokens=False))
    assert bare == [tokenizer.encode(short, add_special_tokens=False)] and tok.texts[3:] == [short]


def test_the_memo_keeps_the_latest_within_its_bounds(monkeypatch):
    monkeypatch.setattr(tokenize, "MEMO_PROMPTS", 3)
    monkeypatch.setattr(tokenize, "MEMO_IDS", 10)
    memo = tokenize.IdsMemo()
    for key, n in (("a", 2), ("b", 2), ("c", 2)):
        memo.put(key, list(range(n)))
    assert memo.get("a") == [0, 1]  # "a" is now the newest
    memo.put("d", [7])  # four prompts: the oldest, "b", goes
    assert memo.get("b") is None and memo.get("a") == [0, 1] and memo.get("d") == [7]
    memo.put("e", list(range(6)))  # c, a, d, e: 2 + 2 + 1 + 6 ids > 10, so the oldest, "c", goes
    assert list(memo.ids) == ["a", "d", "e"] and memo.total == 9
    memo.put("f", list(range(11)))  # more than the memo holds at all: not kept, nothing evicted
    assert memo.get("f") is None and list(memo.ids) == ["a", "d", "e"]
    memo.put("d", [8])  # kept as first given
    assert memo.get("d") == [7]


def test_fastokens_encodes_inline_and_a_failure_falls_back_to_the_tokenizer(tokenizer, monkeypatch, caplog):
    assert tokenize.use_backend(tokenizer, "auto") == "fastokens"
    try:
        long = _text(tokenize.INLINE_CHARS * 4)  # past the tokenizer's inline bound, within fastokens'
        ids, threads = _encode(tokenizer, [long], monkeypatch)
        assert ids == [tokenizer.encode(long)] and threads == 0
        huge = [_text(tokenize.FAST_INLINE_CHARS // 2 + 1), _text(tokenize.FAST_INLINE_CHARS // 2 + 3)]
        ids, threads = _encode(tokenizer, huge, monkeypatch)
        assert ids == [tokenizer.encode(t) for t in huge] and threads == 1

        class Failing:
            def encode(self, texts, special):
                raise RuntimeError("match limit exceeded")

        monkeypatch.setitem(tokenize._fast, tokenizer, Failing())
        text = _text(777)
        ids, _ = _encode(tokenizer, [text], monkeypatch)
        assert ids == [tokenizer.encode(text)] and "fastokens failed on a prompt" in caplog.text
    finally:
        assert tokenize.use_backend(tokenizer, "hf") == "hf"
