"""The last step of benchmarks/peers/fetch/fetch_vllm.sh before packing:

  python benchmarks/peers/fetch/fetch_manifest.py STAGE MANIFEST.tsv

- `link_duplicates`: a file of STAGE/site (the flashpage server's wheels) that STAGE/vllm-site holds
  byte for byte at the same relative path becomes a hard link to it, which tar stores once (the two
  sites share pydantic, fastapi's stack, msgspec, xgrammar, ...);
- `write_manifest`: every file of STAGE as `path<TAB>bytes<TAB>sha256`, for MANIFEST.tsv beside the
  parts (the unpacked trees can be checked against it: `unpack_vllm.sh --verify`).
"""

from __future__ import annotations

import filecmp
import hashlib
import os
import sys
from pathlib import Path


def link_duplicates(site: Path, reference: Path) -> int:
    """Replace each file under `site` equal to `reference`'s file at the same relative path by a
    hard link to that file; the number replaced."""
    n = 0
    for root, _, files in os.walk(site):
        for name in files:
            a = Path(root) / name
            b = reference / a.relative_to(site)
            if b.is_file() and not a.is_symlink() and not b.is_symlink() and filecmp.cmp(a, b, shallow=False):
                a.unlink()
                os.link(b, a)
                n += 1
    return n


def write_manifest(stage: Path, out: Path) -> int:
    """`path<TAB>bytes<TAB>sha256` for every file under `stage`, sorted; the number of files."""
    lines = []
    for root, _, files in os.walk(stage):
        for name in files:
            p = Path(root) / name
            lines.append(f"{p.relative_to(stage)}\t{p.stat().st_size}\t{hashlib.sha256(p.read_bytes()).hexdigest()}")
    out.write_text("path\tbytes\tsha256\n" + "\n".join(sorted(lines)) + "\n")
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    stage, out = (Path(a) for a in (argv if argv is not None else sys.argv[1:]))
    if (stage / "site").is_dir():
        print(f"{link_duplicates(stage / 'site', stage / 'vllm-site')} files of site/ linked to vllm-site/'s")
    print(f"{write_manifest(stage, out)} files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
