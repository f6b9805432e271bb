"""Prompt log-probabilities, computed in the prefill pass that reads the prompt.

A sequence that asks for them (`prompt_logprobs = k`) has every prompt position's hidden state put
through the LM head while its chunk runs: position p gives log P(prompt[p + 1] | prompt[:p + 1]),
with the top k alternatives. Positions whose next token is not a prompt token (the last one, which
is sampled instead, and a recomputed output after preemption) are skipped. The logits go through
the head `SLICE` positions at a time, so a long chunk never holds [chunk, vocab] fp32 at once
(8192 positions of a 152k vocabulary would be 5 GB); 128 rows stay within what start-up profiles
for the sampler (max_num_seqs rows of logits), which the KV cache is sized around.

Such steps run eagerly (the captured graphs keep only the sampled rows' hidden states), and such
sequences take no prefix-cache hits at admission (the scheduler asks the block manager not to
reuse): a cached prefix would have no hidden states to score.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from server.worker.logits import to_device
from server.worker.sampler import log_softmax, top_logprobs

SLICE = 128


@dataclass(slots=True)
class PromptScores:
    """Log-probabilities of prompt tokens [first + 1, first + 1 + n) of one sequence."""

    seq: object  # the engine's Sequence (the worker's SeqState)
    first: int  # position p of the first row: it scores prompt token p + 1
    packed: torch.Tensor  # [n, 1 + 2k] fp32: the token's logprob, top-k ids, top-k logprobs (host)
    k: int


def wants_scores(chunk) -> bool:
    """Does this prefill chunk hold positions whose next prompt token is to be scored?"""
    seq = chunk.seq
    return seq.params.prompt_logprobs is not None and chunk.start < len(seq.prompt_token_ids) - 1


def _scored(prefills: list):
    """(chunk, its first row in the step, positions m it scores) of each chunk that scores."""
    offset = 0
    for chunk in prefills:
        if wants_scores(chunk):  # positions whose next token is a prompt token
            yield chunk, offset, min(chunk.start + chunk.num_tokens, len(chunk.seq.prompt_token_ids) - 1) - chunk.start
        offset += chunk.num_tokens


def head_slices(prefills: list) -> list[tuple[int, int]]:
    """The rows of the step's hidden states score_chunks puts through the LM head, call by call:
    the other ranks of a tensor-parallel group make the same calls (the head gathers over them)."""
    return [(offset + a, offset + min(m, a + SLICE)) for _, offset, m in _scored(prefills) for a in range(0, m, SLICE)]


def score_chunks(lm_head, hidden: torch.Tensor, prefills: list, vocab_size: int, pinned: bool,
                 invariant: bool = False) -> list[PromptScores]:
    """hidden: the step's hidden states, prefill chunks first (in `prefills` order)."""
    out = []
    for chunk, offset, m in _scored(prefills):
        seq, lo = chunk.seq, chunk.start
        prompt = seq.prompt_token_ids
        k = seq.params.prompt_logprobs
        targets = to_device(prompt[lo + 1 : lo + 1 + m], torch.long, hidden.device)
        parts = []
        for a in range(0, m, SLICE):
            b = min(m, a + SLICE)
            logprobs = log_softmax(lm_head(hidden[offset + a : offset + b])[:, :vocab_size].float(), invariant)
            chosen = logprobs.gather(1, targets[a:b, None])
            top_v, top_i = top_logprobs(logprobs, max(k, 1), invariant)
            parts.append(torch.cat([chosen, top_i.float(), top_v], dim=1))
        packed = torch.cat(parts)
        host = torch.empty(packed.shape, pin_memory=pinned)
        host.copy_(packed, non_blocking=pinned)
        out.append(PromptScores(seq, lo, host, max(k, 1)))
    return out


@dataclass(slots=True)
class ScoredPrompt:
    """What a step scored of one sequence's prompt, on the host: row j is prompt token first + 1 + j's
    id and log-probability, then its top alternatives' (as many as the request asked for). Two arrays,
    not a list a token: a 12.5k-token prompt with 20 alternatives was 262k tuples built on the
    engine's thread (issue 44); the API process expands them (server/engine/outputs.py PromptLogprobs)."""

    seq: object  # the engine's Sequence (the worker's SeqState)
    first: int  # position p of the first row: it scores prompt token p + 1
    token_ids: np.ndarray  # int32 [n, 1 + want]
    logprobs: np.ndarray  # float32 [n, 1 + want]


def unpack(scores: PromptScores) -> ScoredPrompt:
    """The host copy of a chunk's scores as arrays (once the copy has landed)."""
    k, want = scores.k, scores.seq.params.prompt_logprobs or 0
    packed = scores.packed.numpy()
    n, first = packed.shape[0], scores.first
    token_ids = np.empty((n, 1 + want), np.int32)
    token_ids[:, 0] = scores.seq.prompt_token_ids[first + 1 : first + 1 + n]
    token_ids[:, 1:] = packed[:, 1 : 1 + want]  # ids below 2**24: exact in fp32
    logprobs = np.concatenate([packed[:, :1], packed[:, 1 + k : 1 + k + want]], axis=1)
    return ScoredPrompt(scores.seq, first, token_ids, logprobs)
