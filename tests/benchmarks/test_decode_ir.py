"""benchmarks/kernels/decode_ir.py: the paged decode kernel compiled for sm_90 without a GPU (in a
process of its own: this one runs kernels under the interpreter)."""

import os
import re
import subprocess
import sys


def test_fp8_loop_reads_v_a_byte_at_a_time():
    """What the docstring says of the fp8 loop: Triton fuses the fp8 -> fp16 cast into the dot
    operands' shared-memory reads, V's a byte at a time (no ldmatrix.trans, 8-byte copies), and the
    copies stay as deep in flight as the 16-bit loop's (5 stages, head_dim 64)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels.decode_ir", "--head-dims", "64", "--no-sweep"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    pat = (r"^  (16-bit|fp8) +BLOCK_N \d+ w\d st5 .*?wait (\d+); loop \d+ instr/tile, "
           r"ld.shared.b8 (\d+), ldmatrix \d+ \((\d+) .trans\), cvt \d+; copies \{([^}]*)\}")
    got = {m[0]: m[1:] for m in re.findall(pat, r.stdout, re.M)}
    assert set(got) == {"16-bit", "fp8"}, r.stdout
    (w16, b16, trans16, _), (w8, b8, trans8, copies8) = got["16-bit"], got["fp8"]
    assert w16 == w8 == "3", r.stdout  # 5 stages: the copies of the next tile stay in flight
    assert int(b16) == 0 and int(trans16) > 0, r.stdout  # a 16-bit V: ldmatrix.trans
    assert int(b8) > 0 and int(trans8) == 0 and "8: " in copies8, r.stdout


def test_new_kv_tail_keeps_the_plain_loop():
    """decode_config NEW_KV_TAIL: with the step's token added after the loop, the engine's launch
    (the fused K/V write) compiles the loop of the launch without the write, instruction for
    instruction, where the default's where() makes it longer (16 bits, head_dim 64)."""
    code = ("from benchmarks.kernels.sm90_ir import real_compiler; real_compiler('test')\n"
            "from benchmarks.kernels.decode_ir import compile_launch, describe\n"
            "cfg = dict(BLOCK_N=32, num_warps=4, num_stages=3, num_splits=1)\n"
            "for nk, tail in ((False, False), (True, False), (True, True)):\n"
            "    print(describe(compile_launch(64, False, cfg, new_kv=nk, tail=tail), 4)['instructions'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    plain, fused, tail = map(int, r.stdout.split())
    assert tail == plain < fused, r.stdout
