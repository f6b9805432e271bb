#!/usr/bin/env python3
"""Build the training corpus of the embedded model from the Python standard library.

The corpus is the English prose that ships with the running interpreter: the
docstrings of every module, class and function in the standard library
(``sysconfig.get_paths()['stdlib']``), blocks of ``#`` comments, and the
language-reference help topics stored in ``pydoc_data/topics.py`` (the text
``help('topic')`` prints); the last two can be switched off.
That text is covered by the PSF License Agreement (Python Software Foundation
License Version 2), a permissive licence.

The output is deterministic for a given interpreter: files are visited in sorted
order, docstrings in source order, and duplicates (after whitespace
normalisation) are dropped, keeping the first occurrence. Documents are written
to a UTF-8 text file separated by a line holding only ``<|endoftext|>``.

    python tools/embedded/build_corpus.py --out .corpus/corpus.txt
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import os
import re
import sys
import sysconfig
import tokenize
import warnings
from pathlib import Path

SEPARATOR = "<|endoftext|>"

# Directory names (anywhere below the stdlib root) that are skipped entirely:
# test suites, the IDLE and turtle demos, bundled third-party wheels, generated
# data, compiled caches and anything pip installed into site-packages.
SKIP_DIRS = {
    "test", "tests", "idle_test", "idlelib", "turtledemo", "site-packages",
    "dist-packages", "__pycache__", "ensurepip", "pydoc_data", "encodings",
    "__phello__",
}
# Top-level directory prefixes skipped too (e.g. "config-3.11-x86_64-linux-gnu").
SKIP_DIR_PREFIXES = ("config-",)
# Individual modules that are mostly data or boilerplate rather than prose.
SKIP_FILES = {
    "this.py", "keyword.py", "token.py", "antigravity.py", "__hello__.py",
    "sre_constants.py", "opcode.py", "stringprep.py",
}

_PROMPT = re.compile(r"^\s*(>>>|\.\.\.)( |$)")
_WS = re.compile(r"\s+")


def clean_docstring(text: str) -> str:
    """Drop interactive (doctest) examples and trailing blank lines."""
    out: list[str] = []
    in_example = False
    for line in text.splitlines():
        if _PROMPT.match(line):
            in_example = True
            continue
        if in_example:
            # Expected output of an example runs until the next blank line.
            if line.strip():
                continue
            in_example = False
        out.append(line.rstrip())
    # Collapse runs of blank lines.
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text


def looks_like_prose(text: str, min_words: int) -> bool:
    words = text.split()
    if len(words) < min_words:
        return False
    alpha = sum(c.isalpha() for c in text)
    return alpha / max(1, len(text)) >= 0.55


def docstrings(tree: ast.AST):
    """Yield docstrings of the module, classes and functions in source order."""
    nodes = [tree]
    nodes += [
        n for n in ast.walk(tree)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc


def comment_blocks(source: str):
    """Yield blocks of consecutive full-line ``#`` comments as one paragraph."""
    block: list[str] = []
    last_row = -10
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return
    lines = source.splitlines()
    for tok in toks:
        if tok.type != tokenize.COMMENT:
            continue
        row = tok.start[0]
        line = lines[row - 1] if row - 1 < len(lines) else ""
        if line[: tok.start[1]].strip():  # trailing comment after code
            continue
        body = tok.string.lstrip("#").strip()
        if body.startswith("!") or body.lower().startswith(("-*-", "coding", "type:", "noqa", "pragma")):
            continue
        if row != last_row + 1 and block:
            yield " ".join(block)
            block = []
        if body:
            block.append(body)
        elif block:
            yield " ".join(block)
            block = []
        last_row = row
    if block:
        yield " ".join(block)


def iter_source_files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(
            d for d in dirnames
            if d not in SKIP_DIRS and not d.startswith(SKIP_DIR_PREFIXES)
            and not d.startswith((".", "_test")) and not d.startswith("test_")
        )
        for name in sorted(filenames):
            if not name.endswith(".py") or name in SKIP_FILES:
                continue
            if name.startswith(("test_", "_test")) or any(s in name for s in ("sysconfigdata",)):
                continue
            yield rel / name


def topic_texts(root: Path):
    """Yield the help topics of ``pydoc_data/topics.py`` (the language reference
    text that ``help('topic')`` prints), one document per paragraph group."""
    path = root / "pydoc_data" / "topics.py"
    if not path.is_file():
        return
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                if not (isinstance(key, ast.Constant) and isinstance(value, ast.Constant)):
                    continue
                # Split long topics into chunks of paragraphs (~2000 chars) so
                # that de-duplication and the train/validation split work per
                # section rather than per whole chapter.
                chunk: list[str] = []
                size = 0
                for para in re.split(r"\n\s*\n", value.value):
                    para = "\n".join(l.rstrip() for l in para.strip("\n").splitlines())
                    if not para.strip():
                        continue
                    chunk.append(para)
                    size += len(para)
                    if size >= 2000:
                        yield "\n\n".join(chunk)
                        chunk, size = [], 0
                if chunk:
                    yield "\n\n".join(chunk)
            break


def build(root: Path, with_comments: bool, min_words: int, min_comment_words: int, with_topics: bool = True):
    seen: set[str] = set()
    docs: list[str] = []
    stats = {"files": 0, "parse_errors": 0, "docstrings": 0, "comments": 0, "topics": 0,
             "duplicates": 0, "rejected": 0}
    for rel in iter_source_files(root):
        path = root / rel
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            stats["parse_errors"] += 1
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(source, filename=str(rel))
        except SyntaxError:
            stats["parse_errors"] += 1
            continue
        stats["files"] += 1
        candidates = [("docstrings", clean_docstring(d), min_words) for d in docstrings(tree)]
        if with_comments:
            candidates += [("comments", c, min_comment_words) for c in comment_blocks(source)]
        for kind, text, mw in candidates:
            if not text or not looks_like_prose(text, mw):
                stats["rejected"] += 1
                continue
            key = hashlib.sha1(_WS.sub(" ", text).strip().lower().encode()).hexdigest()
            if key in seen:
                stats["duplicates"] += 1
                continue
            seen.add(key)
            docs.append(text)
            stats[kind] += 1
    if with_topics:
        for text in topic_texts(root):
            text = clean_docstring(text)
            if not text or not looks_like_prose(text, min_words):
                stats["rejected"] += 1
                continue
            key = hashlib.sha1(_WS.sub(" ", text).strip().lower().encode()).hexdigest()
            if key in seen:
                stats["duplicates"] += 1
                continue
            seen.add(key)
            docs.append(text)
            stats["topics"] += 1
    return docs, stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".corpus/corpus.txt", help="output text file")
    ap.add_argument("--stdlib", default=None, help="stdlib root (default: sysconfig.get_paths()['stdlib'])")
    ap.add_argument("--no-comments", action="store_true", help="docstrings only")
    ap.add_argument("--no-topics", action="store_true",
                    help="leave out the language-reference help topics of pydoc_data/topics.py")
    ap.add_argument("--min-words", type=int, default=3, help="minimum words per docstring")
    ap.add_argument("--min-comment-words", type=int, default=6, help="minimum words per comment block")
    args = ap.parse_args(argv)

    root = Path(args.stdlib or sysconfig.get_paths()["stdlib"]).resolve()
    docs, stats = build(root, not args.no_comments, args.min_words, args.min_comment_words,
                        with_topics=not args.no_topics)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = f"\n{SEPARATOR}\n".join(docs) + "\n"
    out.write_text(text, encoding="utf-8")
    meta = {
        "source": "Python standard library docstrings"
        + ("" if args.no_comments else ", comment blocks")
        + ("" if args.no_topics else ", pydoc_data help topics"),
        "python_version": sys.version.split()[0],
        "implementation": sys.implementation.name,
        "license": "PSF License Agreement (Python Software Foundation License Version 2)",
        "documents": len(docs),
        "characters": len(text),
        "bytes_utf8": len(text.encode("utf-8")),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        **stats,
    }
    out.with_suffix(".meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
