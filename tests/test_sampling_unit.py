"""lp.lookahead.sampling: the position-keyed draw (an exact sample, a function of seed and
position alone) and equality of the warpers with transformers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from lp.lookahead.sampling import sample_at, uniform, warp

A, B, C, D = 0, 1, 2, 3
P_LIST = [0.2, 0.3, 0.1, 0.4]
P_FROZEN = torch.tensor(P_LIST, dtype=torch.float32)
DRAWS = 20000


def _counts(draw, probs, draws=DRAWS):
    counts = np.zeros(len(probs), dtype=np.int64)
    for i in range(draws):
        counts[draw(probs, i)] += 1
    return counts


@pytest.mark.parametrize("seed", [0, 7, -(2**63), 2**63 - 1])
def test_sample_at_matches_target_distribution_over_positions(seed):
    """One seed, positions 0..DRAWS-1: the tokens are draws of the target distribution."""
    counts = _counts(lambda p, i: sample_at(p, seed, i), P_FROZEN)
    _, p = stats.chisquare(counts, np.array(P_LIST) * DRAWS)
    assert p > 1e-3, (seed, counts.tolist())


def test_sample_at_matches_target_distribution_over_seeds():
    """One position, seeds 0..DRAWS-1 (what a fixed position sees across requests)."""
    probs = torch.tensor([0.05, 0.0, 0.6, 0.35])
    counts = _counts(lambda p, i: sample_at(p, i, 3), probs)
    assert counts[1] == 0
    _, p = stats.chisquare(counts[[0, 2, 3]], np.array([0.05, 0.6, 0.35]) * DRAWS)
    assert p > 1e-3, counts.tolist()


def test_chisquare_detects_a_wrong_sampler():
    # power check for the tests above: a draft accepted by its probability (u < p(draft)) instead
    # of by equality with the position's token, the inverse CDF otherwise, is visibly wrong
    def by_probability(p, i):
        return D if uniform(1, i) < p[D] else sample_at(p, 1, i)

    counts = _counts(by_probability, P_FROZEN)
    _, p = stats.chisquare(counts, np.array(P_LIST) * DRAWS)
    assert p < 1e-6


def test_uniform_is_keyed_by_seed_and_position_alone():
    us = [uniform(5, i) for i in range(1000)]
    assert us == [uniform(5, i) for i in range(1000)]  # no state
    assert all(0.0 <= u < 1.0 for u in us) and len(set(us)) == 1000
    assert us != [uniform(6, i) for i in range(1000)]
    assert uniform(-1, 0) == uniform(2**64 - 1, 0)  # int64 seeds by their two's complement bits
    _, p = stats.kstest(us, "uniform")
    assert p > 1e-3


def test_sample_at_is_the_inverse_cdf_and_keeps_probs():
    probs = P_FROZEN.clone()
    for i in range(200):
        u = uniform(9, i)
        expect = int(np.searchsorted(np.cumsum(P_LIST), u * sum(P_LIST), side="right"))
        assert sample_at(probs, 9, i) == expect
    assert torch.equal(probs, P_FROZEN)


def test_sample_at_point_masses_and_zero_mass():
    onehot = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert {sample_at(onehot, 0, i) for i in range(50)} == {B}
    sparse = torch.tensor([0.5, 0.0, 0.5, 0.0])  # a zero-mass token is never returned, the last one neither
    assert {sample_at(sparse, 3, i) for i in range(200)} == {A, C}
    half = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float16)
    assert sample_at(half, 1, 1) == C


def _hf_probs(logits, temperature, top_k, top_p):
    """transformers' sampling chain as generate(do_sample=True) builds it."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        procs.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    return torch.softmax(procs(ids, logits.clone()), dim=-1)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.6, 0, 1.0),
        (1.0, 5, 1.0),
        (1.0, 1, 1.0),
        (1.0, 500, 1.0),  # top_k larger than the vocabulary
        (1.0, 0, 0.9),
        (1.0, 0, 0.3),
        (1.0, 0, 0.01),  # keeps at least one token
        (0.7, 10, 0.9),
        (1.3, 3, 0.5),
        (0.5, 20, 0.95),
    ],
)
def test_warp_equals_transformers_chain(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(6, 97, generator=g) * 3
    # integer-valued rows produce exact ties at the top-k / top-p cut
    logits[4] = torch.randint(-3, 4, (97,), generator=g).float()
    logits[5] = 0.0
    ours = warp(logits, temperature, top_k, top_p)
    ref = _hf_probs(logits, temperature, top_k, top_p)
    assert ours.dtype == torch.float32 and ours.shape == logits.shape
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(ours == 0, ref == 0)
    torch.testing.assert_close(ours.sum(-1), torch.ones(6))


def test_warp_accepts_1d_and_half_precision():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    ref = _hf_probs(logits[None], 0.8, 7, 0.9)[0]
    torch.testing.assert_close(warp(logits, 0.8, 7, 0.9), ref, atol=1e-6, rtol=1e-5)
    half = warp(logits.to(torch.bfloat16), 1.0, 0, 1.0)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, torch.softmax(logits.to(torch.bfloat16).float(), -1))
