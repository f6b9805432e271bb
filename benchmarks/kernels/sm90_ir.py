"""A Triton kernel compiled ahead of time for sm_90 on any machine (no GPU needed), and what its IR
says about its loops: how deep the async copies stay in flight, the instructions of the hottest
loop, the registers and spills ptxas reports. Shared by prefill_ir.py and decode_ir.py; needs
triton's NVIDIA backend (its bundled ptxas), not a GPU. Run in a process without TRITON_INTERPRET
(`real_compiler()` first, before the kernel modules are imported).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter


def real_compiler(tool: str) -> None:
    """Make the kernel modules imported after this compile for the GPU, not the interpreter."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit(f"{tool} compiles for the GPU: run it in a process without TRITON_INTERPRET")
    os.environ.pop("TRITON_INTERPRET", None)


def compile_sm90(kernel, types: dict, constexprs: dict, aligned, options: dict):
    """`kernel` for sm_90 as the launcher specialises it: `types` maps each runtime argument to its
    Triton type ("*bf16", "i32", "fp32", a tensordesc), `constexprs` the rest; `aligned(name)`: whether
    the launcher sees that argument 16-aligned (pointers, integers that are multiples of 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, n in enumerate(kernel.arg_names):
        sig[n] = "constexpr" if n in constexprs else types[n]
        if n not in constexprs and aligned(n):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def loop_waits(ttgir: str) -> list[str]:
    """Each scf.for's first async_wait depth (num = copies groups left in flight), in program order."""
    out, in_loop = [], False
    for line in ttgir.splitlines():
        if "scf.for" in line:
            in_loop = True
        elif in_loop and "ttg.async_wait" in line:
            out.append(re.search(r"num = (\d+)", line).group(1))
            in_loop = False
    return out


def hot_loop(ptx: str, marker: str = "mma.sync") -> Counter:
    """PTX opcodes (with their suffixes) of the longest loop whose body holds `marker`: a label and
    the backward branch to it. Inline-assembly blocks count an opcode per statement."""
    body = _longest_loop(ptx.splitlines(), r"^(\$L__BB\d+_\d+):", r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", marker)
    ops: Counter = Counter()
    for line in body:
        for stmt in re.split(r"[;{}]", line.split("//")[0]):
            m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)", stmt)
            if m:
                ops[m.group(1)] += 1
    return ops


def _longest_loop(lines: list[str], label: str, branch: str, marker: str) -> list[str]:
    """The longest run of lines from a label (regex `label`, group 1 its name) to a backward branch to
    it (regex `branch`) that holds `marker`."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(label, line))}
    body: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(branch, line)
        if m and labels.get(m.group(1), i) < i:
            cand = lines[labels[m.group(1)] : i + 1]
            if any(marker in x for x in cand) and len(cand) > len(body):
                body = cand
    return body


def copy_widths(ptx: str) -> Counter:
    """cp.async copies by width in bytes, over the whole kernel."""
    widths = re.findall(r"cp\.async\.c[ag]\.shared\.global\S* \[[^\]]*\], \[[^\]]*\], (0x\w+)", ptx)
    return Counter(int(w, 16) for w in widths)


def ptxas_info(ptx: str) -> tuple[int, int] | None:
    """(registers, spill stores in bytes), from the first bundled ptxas that takes this PTX version
    (3.9 bundles a ptxas older than the PTX it writes for Hopper, and a newer one for Blackwell)."""
    import triton.backends.nvidia

    bin_dir = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        for exe in ("ptxas", "ptxas-blackwell"):
            if not os.path.exists(os.path.join(bin_dir, exe)):
                continue
            r = subprocess.run([os.path.join(bin_dir, exe), "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                               capture_output=True, text=True)
            used = re.search(r"Used (\d+) registers", r.stderr)
            spill = re.search(r"(\d+) bytes spill stores", r.stderr)
            if used and spill:
                return int(used.group(1)), int(spill.group(1))
    return None


def regs_text(ptx: str) -> str:
    info = ptxas_info(ptx)
    return f"{info[0]} registers, {info[1]} B spilled" if info else "registers unknown (no bundled ptxas took the PTX)"


def sass_loop(cubin: bytes, marker: str = "LDG") -> Counter:
    """SASS opcodes (without modifiers) of the longest loop of the cubin whose body holds `marker`,
    disassembled by the bundled nvdisasm: a label and the backward branch to it."""
    import triton.backends.nvidia

    exe = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        lines = subprocess.run([exe, "-c", path], capture_output=True, text=True, check=True).stdout.splitlines()
    ops: Counter = Counter()
    for line in _longest_loop(lines, r"^(\.L_x_\d+):", r"\bBRA\s+`\((\.L_x_\d+)\)", marker):
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops
