"""Sampling: logits warpers and the position-keyed draw (seeds/000 §0x05B, issue 51).

Contract: the warpers reproduce transformers' TemperatureLogitsWarper ->
TopKLogitsWarper -> TopPLogitsWarper -> MinPLogitsWarper chain, so "the target distribution" means
the same thing here and in ``generate(do_sample=True)``.

``sample_at(probs_V, seed, position)`` is the sampled token at output position ``position``
(0 for the first new token): the inverse CDF of the target distribution ``probs_V`` at one
uniform ``uniform(seed, position)``, a counter-based hash (SplitMix64) of the seed and the
position alone. A draft token is accepted exactly when it equals that token (the verification
walk is greedy's, with ``sample_at`` in place of the argmax). Hence:

* every token has exactly its target probability: u(seed, i) is independent of everything that
  chose the drafts at position i (they are functions of the prompt and of u at earlier
  positions), so the draw at i is an inverse-CDF sample whatever was proposed;
* a point-mass draft is accepted with its target probability, as the paper's walk accepts it;
* the text is a function of (prompt, seed, weights) alone: the same under any drafts, window,
  step boundaries, LP workers, batch, prefix cache or restart, and equal to lp's plain seeded
  decoding (``decoding.mode=ar``) token for token, wherever the rows' logits are bit for bit a
  one-row step's (lp's exact kernels; see docs/architecture.md).

The uniform is pure Python (no generator state, no device): every worker and device computes
the same u. The cumulative sum runs in float64 on the probabilities' device; on the CPU it is a
sequential sum. A CUDA cumsum may round differently, so a CUDA run and a CPU run of the same
seed can pick different tokens where u falls within rounding of a boundary (both exact samples);
runs on one device type agree. Only the token id leaves the device (no vocabulary row).
"""

from __future__ import annotations

import torch

def warp(logits_V: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Float32 logits [..., V] -> sampling probabilities [..., V]."""
    scores = logits_V.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k and top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        floor = min_p * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < floor, float("-inf"))  # the top token always stays
    return torch.softmax(scores, dim=-1)


_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """u(seed, position) in [0, 1), 53 random bits, a function of its two integers alone
    (any int64 seed; the position a non-negative int).

    >>> uniform(1234, 0) == uniform(1234, 0), uniform(1234, 0) != uniform(1234, 1)
    (True, True)
    """
    assert position >= 0, position
    z = _splitmix64(_splitmix64(seed & _M64) ^ position)
    return (z >> 11) * 2.0**-53


def sample_at(probs_V: torch.Tensor, seed: int, position: int) -> int:
    """The token at output position ``position`` under ``seed``: the first token whose
    cumulative probability exceeds u(seed, position) times the total (a zero-probability token
    is never chosen: the cumulative sum does not rise there). ``probs_V`` is not modified."""
    cdf_V = probs_V.detach().to(torch.float64).cumsum(-1)
    x = cdf_V[-1:] * uniform(seed, position)
    token = int(torch.searchsorted(cdf_V, x, right=True).item())
    if token >= cdf_V.shape[-1]:  # u * total rounded up to the total: the last token that has mass
        token = int(torch.nonzero(probs_V > 0)[-1].item())
    return token
