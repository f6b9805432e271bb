"""The batched sampler (runs on the logits' device).

Rows with a seed draw their randomness from their own generator, so a seeded request gives the
same tokens whatever else shares its batch. Everything else is sampled in one batched pass.
"""

from __future__ import annotations

import torch

from kernels.log_softmax import log_softmax_rows

from server.sampling_params import SamplingParams
from server.worker.logits import to_device


def log_softmax(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """Row-wise log-softmax of fp32 logits [n, V]; `invariant` (the deterministic mode): each row's
    bits independent of its place in the batch (kernels/log_softmax.py; torch's are not)."""
    return log_softmax_rows(x) if invariant else torch.log_softmax(x, dim=-1)


def softmax(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """Row-wise softmax, likewise."""
    return log_softmax_rows(x).exp() if invariant else torch.softmax(x, dim=-1)


def top_logprobs(logprobs: torch.Tensor, k: int, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, token ids) [n, k] of each row's k most likely tokens. `invariant`: equal values
    (-0.0 and +0.0 alike) in the lowest token id first. torch.topk leaves the order of ties to its
    algorithm, which follows the batch's shape; bf16 logits tie often (a random-weight
    Llama-3.2-1B's top alternative did, and a request's top_logprobs changed with the traffic around
    it). So the ranking key is one int64 per token, the value's order-preserving bits then the
    reversed id: no two are equal. (Built in place: one int64 [n, V] buffer.)"""
    if not invariant:
        return logprobs.topk(k, dim=-1)
    bits = (logprobs + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0; a fresh contiguous copy
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)  # monotone in the float
    vocab = logprobs.shape[-1]
    key.bitwise_left_shift_(32).bitwise_or_(vocab - 1 - torch.arange(vocab, device=logprobs.device))
    _, ids = key.topk(k, dim=-1)
    return logprobs.gather(-1, ids), ids


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        invariant: bool = False) -> torch.Tensor:
    """logits [n, V] fp32; top_k [n] int (0 = off); top_p [n] float. Masks dropped tokens to -inf.
    `invariant`: the nucleus's probabilities from the batch-invariant log-softmax."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    kept = sorted_logits.masked_fill(drop, float("-inf"))
    probs = softmax(kept, invariant)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    want_logprobs: bool = False, invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [n, V] fp32 -> (token ids [n] int64, log-probabilities [n, V] of the model's raw
    distribution, or None unless asked for). Everything stays on the logits' device. `invariant`
    (the deterministic mode): the sampling distribution comes from kernels/log_softmax.py, whose
    rows' bits do not depend on their place in the batch (torch's softmax's do)."""
    n = logits.shape[0]
    logprobs = log_softmax(logits, invariant) if want_logprobs else None
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]  # greedy: temperature < GREEDY_BELOW
    if not rows:
        return out, logprobs
    dev = logits.device
    idx = to_device(rows, torch.long, dev)
    # Sampled rows have temperature >= GREEDY_BELOW (the rest are greedy, above), so the division
    # below stays finite for any finite logits a model produces.
    temp = to_device([params[i].temperature for i in rows], torch.float32, dev)
    scaled = logits[idx] / temp[:, None]
    # The filter sorts every row over the whole vocabulary (milliseconds a step at 256 rows of a
    # 152k vocabulary): only when some row asks for top-k or top-p.
    if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in rows):
        top_k = to_device([params[i].top_k for i in rows], torch.long, dev)
        top_p = to_device([params[i].top_p for i in rows], torch.float32, dev)
        scaled = _filter_top_k_top_p(scaled, top_k, top_p, invariant)
    probs = softmax(scaled, invariant)
    # Exponential-race sampling (argmax of p / E, E ~ Exp(1)) equals multinomial, and lets each
    # seeded row take its noise from its own generator.
    noise = torch.empty_like(probs).exponential_()
    for j, i in enumerate(rows):
        if generators[i] is not None:
            noise[j] = torch.empty(probs.shape[1], device=dev).exponential_(generator=generators[i])
    out[idx] = (probs / noise).argmax(dim=-1)
    assert out.shape[0] == n
    return out, logprobs
