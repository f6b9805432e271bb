"""server/api/reasoning/: where a reply starts (from the prompt's end), and reasoning split from the
answer on recorded outputs, alike in any chunks (splits inside both tags included)."""

import random

import pytest

from server.api.reasoning import REASONING_PARSERS, ThinkSplitter

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


def split(fmt, state, chunks) -> tuple[str, str]:
    s, out = ThinkSplitter(fmt, state), []
    for c in chunks:
        out += s.feed(c)
    out += s.end()
    return "".join(t for k, t in out if k == "reasoning"), "".join(t for k, t in out if k == "content")


@pytest.mark.parametrize("fmt,state,text,reasoning,content", [
    (QWEN3, "maybe", "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n", "It is 4."),
    (QWEN3, "maybe", "It is 4.", "", "It is 4."),  # no block: all answer
    (QWEN3, "maybe", "  <think>a</think>b", "a", "b"),
    (QWEN3, "reasoning", "Adding.\n</think>\n\n<tool_call>", "Adding.\n", "<tool_call>"),
    (QWEN3, "content", "<think>kept</think> as text", "", "<think>kept</think> as text"),  # the template closed it
    (R1, "reasoning", "<think>\nHmm.</think>Answer", "\nHmm.", "Answer"),  # a start tag written anyway is dropped
    (R1, "reasoning", "Cut off while thinking", "Cut off while thinking", ""),
    (R1, "maybe", "Answer only", "", "Answer only"),
    (QWEN3, "reasoning", "a < b and </thin is not the end</think>ok", "a < b and </thin is not the end", "ok"),
])
def test_recorded_replies_split_alike_in_any_chunks(fmt, state, text, reasoning, content):
    rnd = random.Random(len(text))
    chunkings = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(10):
        cuts = sorted(rnd.sample(range(1, len(text)), min(4, len(text) - 1)))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for chunks in chunkings:
        assert split(fmt, state, chunks) == (reasoning, content), chunks


def test_state_from_the_prompt():
    assert QWEN3.state("<|im_start|>assistant\n<think>\n") == "reasoning"  # the template opened it
    assert QWEN3.state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"  # enable_thinking false
    assert QWEN3.state("<think>old</think> turn<|im_start|>assistant\n") == "maybe"
    assert R1.state("<｜Assistant｜>") == "reasoning"  # R1 thinks, whether or not its template wrote the tag
    assert [QWEN3.grammar_mode(s) for s in ("reasoning", "content", "maybe")] == ["enabled", "disabled", "auto"]
