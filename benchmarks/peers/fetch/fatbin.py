"""Blank the GPU code a Hopper never loads out of a CUDA extension, so that it compresses to nothing.

  python benchmarks/peers/fetch/fatbin.py LIB.so [--arch 90]

A CUDA shared library carries its kernels in the ELF section `.nv_fatbin`: one fat binary per
translation unit, each a list of entries (the machine code, "SASS", of one architecture, or PTX to be
compiled by the driver). On a device of compute capability 9.0 the driver loads, per fat binary, the
sm_90 SASS entry, and only where there is none compiles the PTX of the highest architecture at most
9.0. This keeps exactly those entries and overwrites every other entry's payload with zeros, in
place: no offset, size or header changes, so the library loads as before. vLLM 0.26.0's
`_C_stable_libtorch.abi3.so` is 79 MB, 56 MB under zstd; blanked, 15 MB (its entries are already
zstd-compressed, so only blanking shrinks them).

Layout (the driver's, as read by cuobjdump): a fat binary is a 16-byte header (magic 0xBA55ED50,
u16 version, u16 header size, u64 size of the entries), then entries, each a header (u16 kind: 1 PTX,
2 ELF; u16; u32 header size; u64 payload size; ...; u32 architecture at offset 28) and its payload.
"""

from __future__ import annotations

import argparse
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


@dataclass
class Entry:
    kind: int
    arch: int
    offset: int  # of the payload, in the file
    size: int


@dataclass
class StripStats:
    fatbins: int = 0
    kept: list[tuple[int, int]] = field(default_factory=list)  # (kind, arch) of each entry kept
    blanked_bytes: int = 0
    without_sass: int = 0  # fat binaries with no SASS for the architecture (their PTX kept, if any)


def section(data: bytes | bytearray, name: str) -> tuple[int, int] | None:
    """(file offset, size) of an ELF64 little-endian section, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    for h in headers:
        end = data.index(b"\0", strtab + h[0])
        if data[strtab + h[0]:end].decode() == name:
            return h[4], h[5]
    return None


def fatbins(data: bytes | bytearray, start: int, size: int) -> list[list[Entry]]:
    """The entries of every fat binary in data[start:start + size] (fat binaries are 8-byte aligned)."""
    out, pos, end = [], start, start + size
    while pos + 16 <= end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        p, stop, entries = pos + header_size, pos + header_size + fat_size, []
        while p < stop:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, p)
            arch, = struct.unpack_from("<I", data, p + 28)
            entries.append(Entry(kind, arch, p + entry_header, payload))
            p += entry_header + payload
        out.append(entries)
        pos = stop
    return out


def needed(entries: list[Entry], arch: int) -> list[Entry]:
    """What a device of `arch` loads from one fat binary: its SASS for `arch`, else the PTX of the
    highest architecture at most `arch` (none: the fat binary holds nothing that device can run)."""
    sass = [e for e in entries if e.kind == KIND_ELF and e.arch == arch]
    if sass:
        return sass
    ptx = [e for e in entries if e.kind == KIND_PTX and e.arch <= arch]
    best = max((e.arch for e in ptx), default=None)
    return [e for e in ptx if e.arch == best]


def strip(data: bytearray, arch: int = 90) -> StripStats:
    """Blank, in place, every fat-binary entry of `data` (an ELF image) that `arch` does not load."""
    stats = StripStats()
    where = section(data, ".nv_fatbin")
    if where is None:
        return stats
    for entries in fatbins(data, *where):
        stats.fatbins += 1
        keep = needed(entries, arch)
        stats.without_sass += not any(e.kind == KIND_ELF for e in keep)
        for e in entries:
            if e in keep:
                stats.kept.append((e.kind, e.arch))
            else:
                data[e.offset:e.offset + e.size] = bytes(e.size)
                stats.blanked_bytes += e.size
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("libs", nargs="+")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 to keep (default 90: Hopper)")
    args = ap.parse_args(argv)
    for lib in args.libs:
        path = Path(lib)
        data = bytearray(path.read_bytes())
        stats = strip(data, args.arch)
        path.write_bytes(data)
        sass = sum(1 for k, _ in stats.kept if k == KIND_ELF)
        print(f"{path.name}: {stats.fatbins} fat binaries, kept {sass} SASS and {len(stats.kept) - sass} PTX entries "
              f"({stats.without_sass} without sm_{args.arch} SASS), blanked {stats.blanked_bytes / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
