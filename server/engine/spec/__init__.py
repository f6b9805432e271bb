"""Speculative decoding's host side (the device side is server/worker/spec/): proposers (`ngram.py`,
`draft.py`: a draft model or an EAGLE-3 head), the back-off policy (`policy.py`), and the bookkeeping
of a speculative step (`speculator.py`: which decodes verify proposals, which proposals stand, the KV
slots and blocks of the rest given back)."""

from server.engine.spec.policy import SpecState
from server.engine.spec.speculator import SpecCounters, Speculator, VerifySeq, accepted_prefix, make_speculator

__all__ = ["SpecCounters", "SpecState", "Speculator", "VerifySeq", "accepted_prefix", "make_speculator"]
