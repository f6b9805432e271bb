"""Less overhead per device-function call in Triton's CPU interpreter (TRITON_INTERPRET=1), which the
kernel and deterministic-engine tests run under on machines without a GPU (tests/conftest.py).

For every kernel launch the interpreter points triton.language's builtins (tl, tl.core, tl.math,
tl.tensor) at their interpreted versions, runs the grid, and restores them. It also does this again
on every call of a @triton.jit helper from inside the kernel (InterpretedFunction.__call__), walking
each module with inspect.getmembers, and never restores those: with the launch's patches already in
place it changes nothing. Our kernels call helpers in their inner loops, so this was ~20% of the
interpreter's time (cProfile of a deterministic engine step; test_positions_are_invariant's MQA
case went from 28 s to 20 s). Here a helper call skips the re-patch when the launch in progress
already patched every language module the helper's globals name; otherwise (another module, or no
launch in progress) the interpreter patches as it always did. What the kernels compute is unchanged.

Installed only when the interpreter has the functions this relies on; otherwise the interpreter
runs as shipped (slower, never different).
"""

from __future__ import annotations

import inspect
import threading


def install() -> bool:
    """Wrap the interpreter's patching; False (and nothing changed) if its internals differ."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    launch, patch_lang = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "_patch_lang", None)
    if launch is None or patch_lang is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    local = threading.local()  # per thread: the language modules the launch in progress has patched
    original_call = launch.__call__

    def language_modules(fn) -> set[int]:
        # the modules _patch_lang patches for `fn`: triton.language and triton.language.core, where named
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang_once(fn):
        patched = getattr(local, "patched", None)
        wanted = language_modules(fn)
        if patched is not None and wanted <= patched:
            return interpreter._LangPatchScope()  # nothing to patch: the launch did it
        scope = patch_lang(fn)
        if patched is not None:
            patched |= wanted
        return scope

    def call(self, *args, **kwargs):
        outer = getattr(local, "patched", None)
        local.patched = set()  # the launch's own _patch_lang (through patch_lang_once) fills it
        try:
            return original_call(self, *args, **kwargs)
        finally:
            local.patched = outer

    interpreter._patch_lang = patch_lang_once
    launch.__call__ = call
    return True
