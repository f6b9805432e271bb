"""Reasoning parsers (`--reasoning-parser`, vLLM's names): the reasoning a model writes between think
tags, split from its answer into `reasoning_content` (and vLLM's newer `reasoning`), streamed too.
Both read `<think>...</think>` (think.py); they differ in where a reply starts when the prompt does
not say: Qwen3 thinks only if it opens a block, DeepSeek-R1 (whose template opens it) always does."""

from __future__ import annotations

from server.api.reasoning.think import ThinkFormat, ThinkSplitter

REASONING_PARSERS = {  # --reasoning-parser's choices
    "qwen3": ThinkFormat("qwen3", "<think>", "</think>", default="maybe"),
    "deepseek_r1": ThinkFormat("deepseek_r1", "<think>", "</think>", default="reasoning"),
}

__all__ = ["REASONING_PARSERS", "ThinkFormat", "ThinkSplitter"]
