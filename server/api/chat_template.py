"""Chat templates: the `--chat-template FILE` flag's reader, and rendering a conversation into the
prompt's token ids (POST /v1/chat/completions, server/api/openai_chat.py).

The template is the tokenizer's own (`chat_template` in tokenizer_config.json, or
chat_template.jinja), or the flag's file in its place. It is rendered by transformers'
`apply_chat_template` (a sandboxed Jinja environment) with `add_generation_prompt=True`, and the
text is tokenized with `add_special_tokens=False`: a template writes the special tokens it wants
(BOS included), so the tokenizer must not add them a second time. Each API process remembers the
ids of the conversations it rendered last (server/api/tokenize.py says why).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from server.api.tokenize import encode_now, memo_of


class ChatTemplateError(ValueError):
    """No template to render with, or one that failed to render (HTTP 400; the message says which)."""


def read_chat_template(path: str) -> str:
    """The text of a `--chat-template` file; a file that cannot be read or is not Jinja fails at start-up."""
    import jinja2

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read chat template {path!r}: {e}") from None
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)  # syntax only, as transformers
    except jinja2.TemplateSyntaxError as e:
        raise argparse.ArgumentTypeError(f"chat template {path!r}, line {e.lineno}: {e.message}") from None
    return text


def render_chat(tokenizer, messages: list[dict], template: str | None, tools: list[dict] | None = None,
                kwargs: dict | None = None) -> tuple[str, list[int]]:
    """The conversation rendered with `template` (None: the tokenizer's own) and the generation
    prompt, and its token ids. `tools` (OpenAI's shape) go to the template's own tool support and
    `kwargs` (chat_template_kwargs) are the template's variables. Blocking: run it off the event loop."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model's tokenizer has no chat template: start the server with "
                                "--chat-template FILE (a Jinja chat template) to use /v1/chat/completions")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False,
                                             add_generation_prompt=True, **(kwargs or {}))
    except Exception as e:  # jinja2.TemplateError (raise_exception(...) included), or what the template hit
        raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None
    return text, encode_now(tokenizer, [text], add_special_tokens=False)[0]


async def chat_prompt_ids(tokenizer, messages: list[dict], template: str | None, tools: list[dict] | None = None,
                          kwargs: dict | None = None) -> list[int]:
    """render_chat's token ids, off the event loop, or this process's memory of them."""
    # as conversation() built them: one order of keys
    text = json.dumps([messages, tools, kwargs] if tools or kwargs else messages, ensure_ascii=False)
    memo = memo_of(tokenizer, "chat")
    ids = memo.get((text, template))
    if ids is None:
        _, ids = await asyncio.to_thread(render_chat, tokenizer, messages, template, tools, kwargs)
        memo.put((text, template), ids, len(text))
    return ids
