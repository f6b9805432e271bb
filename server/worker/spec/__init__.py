"""Speculative decoding on the device (the host side is server/engine/spec/): the verification of
proposals as chunks whose every position samples (`verify.py`), and the draft model that proposes
(`draft.py`)."""

from server.worker.spec.draft import DraftRunner, load_draft, shared_blocks
from server.worker.spec.verify import capture_spec_graphs, verify_parts, verify_rows

__all__ = ["DraftRunner", "capture_spec_graphs", "load_draft", "shared_blocks", "verify_parts", "verify_rows"]
