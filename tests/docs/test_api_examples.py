"""The examples of README.md and docs/api.md, run against one `python -m server` (the embedded
model on the CPU, its defaults): each `console` block's commands answer as shown, each `python`
block runs and prints what the `text` block after it shows.

JSON answers are compared field by field: ids and timestamps by type only, floats to 1e-4; a block
whose info string says `shape` is compared by its keys and types only (an unseeded sample).
UPDATE_DOC_EXAMPLES=1 writes the answers into the files instead of comparing them."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

from benchmarks.shared.common import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "api.md"]
URL = "http://127.0.0.1:8000"
VOLATILE = {"id", "created"}
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```\n", re.S | re.M)
UPDATE = os.environ.get("UPDATE_DOC_EXAMPLES") == "1"


@pytest.fixture(scope="module")
def server():
    # the engine on the server's thread: one process to start instead of two, the same answers
    with ServerProcess.python_server(["--device", "cpu", "--no-engine-process"]) as s:
        yield s.wait_healthy(120).url


def commands(body: str) -> list[tuple[str, str]]:
    """A console block's (command, shown output) pairs: `$ ` starts a command, a trailing `\\`
    continues it, and the lines up to the next `$ ` are its output."""
    out, cmd, shown, cont = [], None, [], False
    for line in body.splitlines():
        if cont or (line.startswith("$ ") and not cont):
            if not cont:
                if cmd is not None:
                    out.append((cmd, "\n".join(shown).strip()))
                cmd, shown = line[2:], []
            else:
                cmd += "\n" + line
            cont = line.endswith("\\")
        else:
            shown.append(line)
    if cmd is not None:
        out.append((cmd, "\n".join(shown).strip()))
    return out


def _json(line: str):
    body = line[len("data: "):] if line.startswith("data: ") else line
    try:
        return json.loads(body)
    except ValueError:
        return None


def same(shown, got, shape: bool, key: str = "") -> bool:
    """`got` answers as `shown` does (see the module's docstring)."""
    if isinstance(shown, dict):
        return isinstance(got, dict) and shown.keys() == got.keys() and all(
            same(shown[k], got[k], shape, k) for k in shown)
    if isinstance(shown, list):
        if shape:
            return isinstance(got, list) and (not shown or not got or same(shown[0], got[0], shape, key))
        return isinstance(got, list) and len(shown) == len(got) and all(same(a, b, shape, key) for a, b in zip(shown, got))
    if shape or key in VOLATILE:
        return type(shown) is type(got) or (isinstance(shown, (int, float)) and isinstance(got, (int, float)))
    if isinstance(shown, float) or isinstance(got, float):
        return isinstance(got, (int, float)) and math.isclose(shown, got, rel_tol=1e-4, abs_tol=1e-6)
    return shown == got


def _stream(lines: list[str]) -> list[str]:
    """A /generate event stream as one event (text and ids joined, the last event's other fields):
    how tokens group into events depends on timing (a client that falls behind gets them in one)."""
    events = [_json(x) for x in lines if x != "data: [DONE]"]
    merged = dict(events[-1], text="".join(e["text"] for e in events),
                  token_ids=[i for e in events for i in e["token_ids"]])
    return [json.dumps(merged), *(x for x in lines if x == "data: [DONE]")]


def answers_as_shown(shown: str, got: str, shape: bool) -> bool:
    a, b = [x for x in shown.splitlines() if x.strip()], [x for x in got.splitlines() if x.strip()]
    if a and all(x.startswith("data: ") for x in a + b) and all("text" in (_json(x) or {}) for x in a[:-1] + b[:-1]):
        a, b = _stream(a), _stream(b)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        jx, jy = _json(x), _json(y)
        if jx is not None and jy is not None:
            if not same(jx, jy, shape):
                return False
        elif x != y:
            return False
    return True


def examples(doc: Path):
    """(kind, block start, block end, payload) per runnable block, in order."""
    text = doc.read_text()
    blocks = list(FENCE.finditer(text))
    for i, m in enumerate(blocks):
        lang, info, body = m[1], m[2], m[3]
        if lang == "console":
            yield "console", m, "shape" in info, body
        elif lang == "python":
            after = blocks[i + 1] if i + 1 < len(blocks) and blocks[i + 1][1] == "text" else None
            between = text[m.end():after.start()].strip() if after else "x"
            yield "python", m, after if not between else None, body


def run_doc(doc: Path, url: str) -> list[str]:
    """Runs the doc's examples against `url`; returns what did not answer as shown (or, with
    UPDATE_DOC_EXAMPLES=1, rewrites the shown answers and returns nothing)."""
    text, edits, failures = doc.read_text(), [], []
    namespace: dict = {}
    for kind, m, extra, body in examples(doc):
        if kind == "console":
            new = []
            for cmd, shown in commands(body):
                p = subprocess.run(["bash", "-c", cmd.replace(URL, url)], capture_output=True, text=True, timeout=60)
                got = p.stdout.strip()
                if p.returncode != 0 or not answers_as_shown(shown, got, extra):
                    failures.append(f"{doc.name}: $ {cmd}\nshown:\n{shown}\ngot (exit {p.returncode}):\n{got}{p.stderr[-500:]}")
                new.append(f"$ {cmd}\n{got}")
            edits.append((m.start(3), m.end(3), "\n\n".join(new) + "\n"))
        else:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(body.replace(URL, url), f"{doc.name}:python", "exec"), namespace)  # noqa: S102
            if extra is not None:
                if out.getvalue().strip() != extra[3].strip():
                    failures.append(f"{doc.name}: python block printed\n{out.getvalue()}\nnot\n{extra[3]}")
                edits.append((extra.start(3), extra.end(3), out.getvalue()))
    if UPDATE:
        for start, end, new in sorted(edits, reverse=True):
            text = text[:start] + new + text[end:]
        doc.write_text(text)
        return []
    return failures


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_examples_answer_as_shown(server, doc):
    assert any(kind == "console" for kind, *_ in examples(doc)), f"{doc.name} shows no example"
    failures = run_doc(doc, server)
    assert not failures, "\n\n".join(failures)


def test_the_comparison_can_fail():
    shown = '{"id":"a","created":1,"text":" yes","logprob":-0.5}'
    assert answers_as_shown(shown, '{"id":"b","created":2,"text":" yes","logprob":-0.50001}', shape=False)
    assert not answers_as_shown(shown, '{"id":"b","created":2,"text":" no","logprob":-0.5}', shape=False)
    assert answers_as_shown(shown, '{"id":"b","created":2,"text":" no","logprob":-0.9}', shape=True)
    assert not answers_as_shown(shown, '{"id":"b","created":2,"text":" no"}', shape=True)  # a key missing
    stream = ['data: {"id":"a","text":" a","token_ids":[1],"finished":false}',
              'data: {"id":"a","text":" b","token_ids":[2],"finished":true}', "data: [DONE]"]
    one = 'data: {"id":"b","text":" a b","token_ids":[1,2],"finished":true}\ndata: [DONE]'
    assert answers_as_shown("\n".join(stream), one, shape=False)  # grouped otherwise: the same stream
    assert not answers_as_shown("\n".join(stream), one.replace("[1,2]", "[1,3]"), shape=False)
    assert commands("$ curl a \\\n    -d b\n{}\n\n$ curl c\nx") == [("curl a \\\n    -d b", "{}"), ("curl c", "x")]
