"""zstd from stdin to stdout through the zstandard wheel carried beside the parts, for a machine
without the zstd tool (benchmarks/peers/fetch/unpack_vllm.sh uses it only then):

  cat PARTS | python3 benchmarks/peers/fetch/unzstd.py .vllm/zstandard-*.whl | tar -x -C /tmp
"""

import sys
import tempfile
import zipfile

if __name__ == "__main__":
    where = tempfile.mkdtemp(prefix="zstandard-")
    zipfile.ZipFile(sys.argv[1]).extractall(where)  # a compiled module cannot be imported from the zip
    sys.path.insert(0, where)
    import zstandard

    zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)
