import os

# Kernels run under Triton's interpreter wherever there is no GPU (CI, laptops). It has to be set
# before triton is first imported, so it lives at the root of the test tree.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import interpreter_dot, interpreter_speedup

    interpreter_speedup.install()  # helper calls inside interpreted kernels skip a redundant re-patch
    interpreter_dot.install()  # tl.dot sums every row of a tile alike, whatever numpy's BLAS does

import pytest


from tests.helpers import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("small-gpt2"), n_layer=3, n_head=6, n_embd=96,
                           n_positions=512, vocab_size=700, seed=1)
