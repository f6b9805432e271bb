"""The quantized checkpoints test_quant.py and test_quant_http.py share: one random Llama and its
copy in every format of benchmarks/quant/quant_checkpoint.py, written once a session."""

import pytest


@pytest.fixture(scope="session")
def quant_src(tmp_path_factory):
    from tests.helpers import QUANT_LLAMA, make_llama_checkpoint

    return make_llama_checkpoint(tmp_path_factory.mktemp("src16"), "llama", **QUANT_LLAMA)


@pytest.fixture(scope="session")
def quantized(quant_src, tmp_path_factory):
    """format -> (checkpoint path, dequantized weights by source name)."""
    from benchmarks.quant.quant_checkpoint import FORMATS, quantize_checkpoint

    root = tmp_path_factory.mktemp("quantized")
    return {fmt: (root / fmt, quantize_checkpoint(quant_src, root / fmt, fmt)) for fmt in FORMATS}
