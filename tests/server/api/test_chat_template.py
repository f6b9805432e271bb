"""server/api/chat_template.py: chat_prompt_ids gives render_chat's ids, and a conversation rendered
lately in this process is not rendered again (a router's render, then its request)."""

import asyncio

import pytest
from transformers import AutoTokenizer

from models import EMBEDDED_MODEL
from server.api import chat_template, tokenize

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


@pytest.fixture()
def tokenizer():
    tokenize._memos.clear()
    tok = AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL))
    tok.chat_template = TEMPLATE
    return tok


def test_a_conversation_rendered_again_is_remembered(tokenizer, monkeypatch):
    renders = []
    real = chat_template.render_chat

    def counting(tok, messages, template, *rest):
        renders.append(messages)
        return real(tok, messages, template, *rest)

    monkeypatch.setattr(chat_template, "render_chat", counting)
    chat = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}]
    ids = asyncio.run(chat_template.chat_prompt_ids(tokenizer, chat, None))
    assert ids == real(tokenizer, chat, None)[1] and len(renders) == 1
    ids.append(-1)  # the caller's own
    assert asyncio.run(chat_template.chat_prompt_ids(tokenizer, chat, None)) == real(tokenizer, chat, None)[1]
    assert len(renders) == 1
    # another turn, another template, or the same words with keys in another order (not what
    # conversation() builds, but another key): rendered afresh
    longer = chat + [{"role": "user", "content": "And at night?"}]
    asyncio.run(chat_template.chat_prompt_ids(tokenizer, longer, None))
    other = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert asyncio.run(chat_template.chat_prompt_ids(tokenizer, chat, other)) == real(tokenizer, chat, other)[1]
    swapped = [{"content": m["content"], "role": m["role"]} for m in chat]
    asyncio.run(chat_template.chat_prompt_ids(tokenizer, swapped, None))
    assert len(renders) == 4


def test_a_failed_render_is_not_remembered(tokenizer):
    tokenizer.chat_template = None
    with pytest.raises(chat_template.ChatTemplateError):
        asyncio.run(chat_template.chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}], None))
    assert not tokenize.memo_of(tokenizer, "chat").ids
