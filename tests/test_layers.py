"""The layer rules of docs/architecture.md, enforced: import-linter's contracts (pyproject.toml), no
import cycle anywhere in the project's packages, and no model family's names above models/."""

import re
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "models", "kernels", "kvcache")


def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    p = subprocess.run([str(lint) if lint.exists() else "lint-imports", "--no-cache"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]
                counter[0] += 1
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(edges.get(nxt, ())))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return out


def test_no_import_cycles():
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i.split(".")[0] in PACKAGES}
             for m in graph.modules if m.split(".")[0] in PACKAGES}
    # A package's __init__ re-exporting its own modules is not a cycle between modules.
    for m, deps in edges.items():
        edges[m] = {d for d in deps if not (m.startswith(d + ".") or d.startswith(m + "."))}
    assert _cycles(edges) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# GPT-2's module paths (its config names come from transformers below, with every other family's).
GPT2_MODULES = ["wte", "wpe", "c_attn", "c_proj", "c_fc", "ln_f", "ln_1", "ln_2"]


def family_names() -> set[str]:
    """Names that belong to one model family: its model_type, its class, and the config attributes
    transformers maps the common names onto (GPT-2: n_embd, n_head, n_layer, n_positions, ...)."""
    from transformers import AutoConfig

    from models import MODEL_FAMILIES, model_class

    names = set(GPT2_MODULES)
    for model_type in MODEL_FAMILIES:
        names |= {model_type, model_class(model_type).__name__,
                  *AutoConfig.for_model(model_type).attribute_map.values()}
    return names


def test_family_names_cover_gpt2():
    assert {"gpt2", "GPT2LMHeadModel", "n_embd", "n_head", "n_layer", "n_positions"} <= family_names()


def _pattern(names: set[str]) -> re.Pattern:
    return re.compile(r"\b(" + "|".join(sorted(map(re.escape, names))) + r")\b|\.h\[")


def test_no_model_family_names_above_models():
    from server.api.reasoning import REASONING_PARSERS
    from server.api.tools import TOOL_PARSERS

    pattern = _pattern(family_names())
    # The tool-call and reasoning formats go by vLLM's flag values, some of which a family's
    # model_type shares (mistral, qwen3): those packages name formats, which any model may write.
    formats = (ROOT / "server/api/tools", ROOT / "server/api/reasoning")
    format_pattern = _pattern(family_names() - set(TOOL_PARSERS) - set(REASONING_PARSERS))
    hits = []
    for pkg in ("server", "kvcache", "kernels"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            where = format_pattern if path.parent in formats else pattern
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if where.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == []
