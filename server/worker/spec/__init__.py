"""Speculative decoding on the device (the host side is server/engine/spec/): the verification of
proposals as chunks whose every position samples (`verify.py`), and the draft model that proposes
(`draft.py`) or the EAGLE-3 head (`eagle.py`, on the draft model's machinery); under tensor
parallelism, the draft whole on rank 0 (`parallel.py`)."""

from server.worker.spec.draft import DraftRunner, load_draft, shared_blocks
from server.worker.spec.eagle import load_eagle3
from server.worker.spec.parallel import load_proposer
from server.worker.spec.verify import capture_spec_graphs, verify_parts, verify_rows

__all__ = ["DraftRunner", "capture_spec_graphs", "load_draft", "load_eagle3", "load_proposer", "shared_blocks",
           "verify_parts", "verify_rows"]
