"""Sampling: logits warpers and the exact multi-candidate verifier (seeds/000 §0x05B).

Contract: the warpers reproduce transformers' TemperatureLogitsWarper ->
TopKLogitsWarper -> TopPLogitsWarper -> MinPLogitsWarper chain, so "the target distribution" means
the same thing here and in ``generate(do_sample=True)``.

``verify_node`` tests each *distinct* candidate token as a point mass, in order:
accept token c with probability residual(c); on rejection zero c's mass and
renormalize; if every candidate is rejected, sample the residual. Every token
then comes out with exactly its target probability, whatever the candidate list,
as long as the list was fixed before the draw and the draw uses fresh randomness.

Randomness is keyed by (seed, step, depth): each node on the walk gets its own
generator. Workers of Lookahead Parallelism therefore reach the same decision
without exchanging random state, and one process and K workers sample the same
tokens for the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def node_generator(seed: int, step: int, depth: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + step * 1_009 + depth) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen


def verify_node(probs_V: torch.Tensor, candidates: Sequence[int], gen: torch.Generator) -> int:
    """Exact sample at one position given point-mass proposals ``candidates``.

    Runs on ``probs_V``'s device: the vocabulary row never leaves it (on CUDA only one number a
    tested candidate, the residual's sum and the drawn token id come back, not V floats a node).
    The acceptance draws ``u`` come from ``gen`` (a CPU generator) everywhere; the final draw from
    the residual takes ``gen`` on the CPU (the same draws as ever) and, on another device, a
    generator there seeded with ``gen``'s key (``device_generator``)."""
    residual = probs_V.detach().to(torch.float64, copy=True)
    tested: set[int] = set()
    for token in candidates:
        if token in tested:
            continue
        tested.add(token)
        u = torch.rand((), generator=gen, dtype=torch.float64).item()
        p = residual[token].item()
        if u < p:
            return token
        residual[token] = 0.0
        total = residual.sum()
        if total <= 0:  # only reachable through rounding: p was ~1 and still rejected
            residual[token] = 1.0
            return token
        residual /= total
    return int(torch.multinomial(residual, 1, generator=device_generator(gen, residual.device)).item())


def device_generator(gen: torch.Generator, device: torch.device) -> torch.Generator:
    """``gen`` itself on its own device (the CPU); elsewhere a generator on ``device`` seeded with
    ``gen``'s key: the same (seed, step, depth) gives the same draw on every worker of that device
    type, and a CPU run's draws stay those of ``gen`` (a device's stream differs from the CPU's,
    as its softmax's rounding does: both exact samples of the target)."""
    if device.type == gen.device.type:
        return gen
    return torch.Generator(device=device).manual_seed(gen.initial_seed())
