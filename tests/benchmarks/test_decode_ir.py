"""benchmarks/kernels/decode_ir.py: the paged decode kernel compiled for sm_90 without a GPU (in a
process of its own: this one runs kernels under the interpreter)."""

import os
import re
import subprocess
import sys


def test_opaque_v_cast_reads_v_like_a_16_bit_tile():
    """decode_config.FP8_CASTS "asm_v" exists because Triton fuses the fp8 -> fp16 cast into the dot
    operand's shared-memory reads, V's a byte at a time: through the opaque cast V's reads are the
    16-bit tile's ldmatrix.trans, its copies 16 bytes wide, the loop shorter, as deep in flight."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels.decode_ir", "--head-dims", "64", "--casts", "cast",
                        "asm_v", "--no-sweep"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    pat = (r"^  (16-bit|fp8 cast|fp8 asm_v) +BLOCK_N (\d+) w\d st5 .*?wait (\d+); loop (\d+) instr/tile, "
           r"ld.shared.b8 (\d+), ldmatrix \d+ \((\d+) .trans\), cvt \d+; copies \{([^}]*)\}")
    got = {m[0]: m[1:] for m in re.findall(pat, r.stdout, re.M)}
    assert set(got) == {"16-bit", "fp8 cast", "fp8 asm_v"}, r.stdout
    (bn16, w16, _, _, trans16, _), (_, w8, n8, b8, trans8, copies8), (bna, wa, na, ba, transa, copiesa) = (
        got["16-bit"], got["fp8 cast"], got["fp8 asm_v"])
    assert w16 == w8 == wa == "3", r.stdout  # 5 stages: the copies of the next tile stay in flight
    assert int(b8) > 0 and int(trans8) == 0 and "8: " in copies8, r.stdout  # the default: V byte by byte
    # (head_dim 64: 32-key 16-bit tiles, 64-key fp8 ones: as many ldmatrix.trans a key)
    assert int(ba) == 0 and int(transa) * int(bn16) == int(trans16) * int(bna) and "8: " not in copiesa, r.stdout
    assert int(na) < int(n8), r.stdout


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
