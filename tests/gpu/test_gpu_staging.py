"""The step inputs' pinned mirrors on a GPU (skipped without CUDA): a mirror is not refilled while
the upload that reads it still waits behind slow device work (server/worker/inputs.py Staging)."""

from __future__ import annotations

import pytest
import torch

from server.worker.inputs import Staging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_each_upload_carries_the_values_packed_for_it():
    # The host packs six steps while the device spins ~10 ms ahead of each copy, as start-up's
    # warm-up steps did behind an 8B model's int4 GEMMs: without the wait, step 0's copy ran after
    # step 2 had refilled its mirror, and step 0 read step 2's arrays.
    st = Staging(4096, torch.device("cuda"))
    seen = []
    for step in range(6):
        st.next_host()[:] = step
        torch.cuda._sleep(20_000_000)
        st.upload()
        seen.append(st.dev.clone())
    torch.cuda.synchronize()
    assert [sorted(set(s.tolist())) for s in seen] == [[step] for step in range(6)]
