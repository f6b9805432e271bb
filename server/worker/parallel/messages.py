"""What rank 0 sends the other ranks of a tensor-parallel group, each a msgspec struct encoded as a
MessagePack array, one message per forward, in the order rank 0 runs them (their collectives must
meet in that order):

- `GraphStep`: replay the decode (or prefill, or a speculative step's verification) graph of `size`
  with the inputs rank 0 filled (the graph's exported words: server/worker/cuda_graphs.py).
- `EagerStep`: an eager forward of the step rank 0 packed (server/worker/inputs.py: the words and
  where each array lies in them, plus the host lists the attention backend reads), then the LM head
  over each of `head_slices` (prompt log-probabilities, server/worker/scoring.py) and over the rows
  that sample.
- `Stop`: leave the group and exit.

`Start` (pickled, once) is what a rank's process is started with.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from server.config import EngineConfig


class GraphStep(msgspec.Struct, tag=True, array_like=True):
    prefill: bool
    size: int  # the graph's batch size (decode) or token count (prefill)
    rows: int  # page-table rows filled, and their width
    width: int
    words: bytes  # int32
    verify: bool = False  # (prefill) the verification graphs' (server/worker/spec/verify.py)


class EagerStep(msgspec.Struct, tag=True, array_like=True):
    words: bytes  # int32: the packed arrays
    spans: dict[str, tuple[int, tuple[int, ...]]]  # name -> (offset, shape) in words
    num_prefill_tokens: int
    chunk_lens: list[int]
    chunk_prefix: list[int]
    extra: list[str]  # the attention backend's own arrays among spans
    head_slices: list[tuple[int, int]]


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


Op = GraphStep | EagerStep | Stop
encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(Op).decode


@dataclass
class Start:
    """A rank's process's start: its rank, the engine's settings, and where the group meets."""

    config: EngineConfig
    path: str  # the model directory
    rank: int
    store_port: int  # rank 0's TCPStore on 127.0.0.1
    log_level: str
    log_format: str
