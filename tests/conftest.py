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


@pytest.fixture(scope="session")
def eagle3_pair(tmp_path_factory):
    """(target, head): a 4-layer random Llama and a random EAGLE-3 head for it in the published
    layout (benchmarks/shared/checkpoint.py), reading the target's layers 0, 1 and 3 through a
    200-token draft vocabulary."""
    from benchmarks.shared.checkpoint import make_random_eagle3
    from tests.helpers import make_llama_checkpoint

    target = make_llama_checkpoint(tmp_path_factory.mktemp("eagle3-target"), num_hidden_layers=4)
    head = make_random_eagle3(tmp_path_factory.mktemp("eagle3-head"), target, draft_vocab_size=200,
                              layer_ids=[0, 1, 3], std=0.2)
    return target, head


@pytest.fixture(scope="session")
def plain_server(tiny_ckpt):
    """`python -m server` on the tiny checkpoint with 64 KV blocks and nothing else set (its URL),
    shared by the modules that only send it requests (tests/benchmarks/test_load_test.py,
    tests/server/api/test_http.py, test_openai.py and test_chat.py's `bare`): they started four
    identical servers (~7 s of CPU each), and none of them changes what the others see (every
    request is its own; outputs do not depend on what ran before, which the prefix-cache tests
    check); idle between them, it takes no CPU. Its graceful exit is still checked, once, when the
    session ends."""
    from benchmarks.shared.common import ServerProcess

    srv = ServerProcess.python_server(["--model", str(tiny_ckpt), "--num-blocks", "64"]).wait_healthy(120)
    yield srv.url
    srv.stop(30, must_exit=True)
