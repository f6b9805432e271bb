"""benchmarks/peers/fetch/fatbin.py on a hand-made ELF: what a Hopper loads stays byte for byte, the rest is
zeros, and nothing moves (offsets, sizes and headers are what the loader reads)."""

import struct

from benchmarks.peers.fetch.fatbin import KIND_ELF, KIND_PTX, fatbins, main, needed, strip

ENTRY_HEADER = 64


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    head = bytearray(ENTRY_HEADER)
    struct.pack_into("<HHIQ", head, 0, kind, 0x0101, ENTRY_HEADER, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def elf_with(section_data: bytes, name: bytes = b".nv_fatbin") -> bytes:
    """An ELF64 file of three sections: null, `name` holding section_data, and the name table."""
    strtab = b"\0" + name + b"\0.shstrtab\0"
    data_off = 64
    str_off = data_off + len(section_data)
    sh_off = (str_off + len(strtab) + 7) // 8 * 8
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", header, 0x28, sh_off)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)
    sections = [bytes(64),
                struct.pack("<IIQQQQIIQQ", 1, 1, 0, 0, data_off, len(section_data), 0, 0, 8, 0),
                struct.pack("<IIQQQQIIQQ", 1 + len(name) + 1, 3, 0, 0, str_off, len(strtab), 0, 0, 1, 0)]
    pad = bytes(sh_off - str_off - len(strtab))
    return bytes(header) + section_data + strtab + pad + b"".join(sections)


def test_keeps_what_sm90_loads_and_blanks_the_rest(tmp_path):
    p = {name: bytes([i + 1]) * (40 + i) for i, name in enumerate(
        ["a80", "a90", "a90a", "a100", "ptx90", "b80", "bptx80", "bptx86", "b120", "c100", "cptx100"])}
    section = (fatbin(entry(KIND_ELF, 80, p["a80"]), entry(KIND_ELF, 90, p["a90"]), entry(KIND_ELF, 90, p["a90a"]),
                      entry(KIND_ELF, 100, p["a100"]), entry(KIND_PTX, 90, p["ptx90"]))
               + bytes(8)  # fat binaries are 8-byte aligned: the reader steps over padding
               + fatbin(entry(KIND_ELF, 80, p["b80"]), entry(KIND_PTX, 80, p["bptx80"]),
                        entry(KIND_PTX, 86, p["bptx86"]), entry(KIND_ELF, 120, p["b120"]))
               + fatbin(entry(KIND_ELF, 100, p["c100"]), entry(KIND_PTX, 100, p["cptx100"])))
    image = bytearray(elf_with(section))
    before = bytes(image)
    stats = strip(image, 90)
    assert len(image) == len(before) and stats.fatbins == 3
    # sm_90 SASS where there is some (both variants), else the highest PTX up to 9.0, else nothing
    assert stats.kept == [(KIND_ELF, 90), (KIND_ELF, 90), (KIND_PTX, 86)] and stats.without_sass == 2
    for name, payload in p.items():
        at = before.index(payload)
        assert image[at:at + len(payload)] == (payload if name in ("a90", "a90a", "bptx86") else bytes(len(payload)))
    assert stats.blanked_bytes == sum(len(v) for k, v in p.items() if k not in ("a90", "a90a", "bptx86"))
    # every header as it was: the same entries are found again, at the same places
    assert [[(e.kind, e.arch, e.offset, e.size) for e in fb] for fb in fatbins(image, 64, len(section))] == \
           [[(e.kind, e.arch, e.offset, e.size) for e in fb] for fb in fatbins(before, 64, len(section))]
    lib = tmp_path / "lib.so"
    lib.write_bytes(before)
    assert main([str(lib)]) == 0 and lib.read_bytes() == bytes(image)


def test_a_library_without_gpu_code_is_left_alone():
    image = bytearray(elf_with(b"\1" * 32, name=b".text"))
    before = bytes(image)
    assert strip(image).fatbins == 0 and bytes(image) == before
    assert needed([], 90) == []
