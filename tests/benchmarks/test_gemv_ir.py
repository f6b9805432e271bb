"""benchmarks/kernels/gemv_ir.py: the decode GEMVs compiled for sm_90 without a GPU (in a process of
its own: this one runs kernels under the interpreter)."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")


def test_half2_loop_takes_fewer_instructions_a_weight():
    """What gemv_ir.py's docstring says: the int4 GEMV's half2 loop compiles to clearly fewer SASS
    instructions a weight than the default loop (o_proj's tiles), in f16x2 arithmetic, unspilled;
    compiled as launched with PDL (kernels/pdl.py), each opens with its L2 prefetches, the trigger
    and the wait."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels.gemv_ir", "--linears", "o_proj", "--loops", "int4",
                        "half2", "--pdl"], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr:
        pytest.skip("the NVIDIA backend cannot compile here")
    assert r.returncode == 0, r.stderr[-2000:]
    pat = r"^  o_proj .*? (int4|half2) .*?SASS \d+ = ([\d.]+) a weight; \d+ regs, (\d+) B spilled; SASS (.*)$"
    got = {m[0]: m[1:] for m in re.findall(pat, r.stdout, re.M)}
    assert set(got) == {"int4", "half2"}, r.stdout
    assert float(got["half2"][0]) < 0.7 * float(got["int4"][0]), r.stdout
    assert got["half2"][1] == "0" and "HFMA2" in got["half2"][2] and "HFMA2" not in got["int4"][2], r.stdout
    prologue = re.findall(r"^  o_proj +(int4|half2): PDL prologue: (\d+) L2 prefetches, (\d+) launch_dependents, "
                          r"(\d+) wait$", r.stdout, re.M)
    assert {p[0] for p in prologue} == {"int4", "half2"} and all(int(n) >= 1 for p in prologue for n in p[1:]), r.stdout
