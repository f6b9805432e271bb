"""benchmarks/kernels/prefill_ir.py: the flash prefill kernel compiled for sm_90 without a GPU (in a
process of its own: this one runs kernels under the interpreter)."""

import os
import re
import subprocess
import sys


def test_asm_page_ids_keep_the_prefix_gathers_in_flight():
    """PrefillConfig.prefix_ids "asm" exists so that the prefix loop's K/V copies stay as deep in
    flight as the new-token loops' (num_stages - 1 = 2 groups), which the tl.load of the ids prevents."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels.prefill_ir", "--configs", "asm", "--pointers"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    depths = re.search(r"asm: async_wait depth per cp.async loop \(prefix first\) ([\d, ]+);", r.stdout).group(1)
    assert [int(d) for d in depths.split(", ")] == [2, 2, 2], r.stdout  # the prefix loop as deep as the others
