"""lp.lookahead.sampling: exactness of the point-mass verifier and equality of the warpers with transformers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from lp.lookahead.sampling import node_generator, verify_node, warp

A, B, C, D = 0, 1, 2, 3
P_LIST = [0.2, 0.3, 0.1, 0.4]
P_FROZEN = torch.tensor(P_LIST, dtype=torch.float32)
DRAWS = 20000


def _draw_counts(probs, candidates, draws=DRAWS, seed=0):
    counts = np.zeros(len(probs), dtype=np.int64)
    for i in range(draws):
        counts[verify_node(probs, candidates, node_generator(seed, i, 0))] += 1
    return counts


@pytest.mark.parametrize("candidates", [[A, A, B], [], [D], [C, B, A, D], [C, C, C]])
def test_verify_node_matches_target_distribution(candidates):
    counts = _draw_counts(P_FROZEN, candidates)
    expected = np.array(P_LIST) * DRAWS
    chi2, p = stats.chisquare(counts, expected)
    assert p > 1e-3, (candidates, counts.tolist(), expected.tolist(), chi2)


def test_chisquare_detects_a_wrong_sampler():
    # power check for the test above: accepting the first proposal outright is visibly wrong
    counts = np.zeros(4, dtype=np.int64)
    for i in range(DRAWS):
        gen = node_generator(1, i, 0)
        if torch.rand((), generator=gen).item() < 0.5:
            counts[A] += 1
        else:
            counts[int(torch.multinomial(P_FROZEN, 1, generator=gen))] += 1
    _, p = stats.chisquare(counts, np.array(P_LIST) * DRAWS)
    assert p < 1e-6


def test_verify_node_does_not_modify_probs():
    probs = P_FROZEN.clone()
    verify_node(probs, [A, B], node_generator(0, 0, 0))
    assert torch.equal(probs, P_FROZEN)


def test_verify_node_point_masses():
    onehot = torch.tensor([0.0, 1.0, 0.0, 0.0])
    for i in range(50):
        assert verify_node(onehot, [A, C], node_generator(0, i, 0)) == B
        assert verify_node(onehot, [B], node_generator(0, i, 0)) == B
        assert verify_node(onehot, [], node_generator(0, i, 0)) == B
    # a zero-probability candidate is never returned
    sparse = torch.tensor([0.5, 0.0, 0.5, 0.0])
    for i in range(200):
        assert verify_node(sparse, [B, D], node_generator(3, i, 1)) in (A, C)


def test_node_generator_is_keyed():
    def first(seed, step, depth):
        return torch.rand(4, generator=node_generator(seed, step, depth)).tolist()

    assert first(0, 1, 2) == first(0, 1, 2)
    assert first(0, 1, 2) != first(0, 1, 3)
    assert first(0, 1, 2) != first(0, 2, 2)
    assert first(0, 1, 2) != first(1, 1, 2)


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
