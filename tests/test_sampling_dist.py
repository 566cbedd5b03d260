"""Sampled lookahead decoding draws from the same distribution as transformers' sampling.

A tiny random model with a 12-token vocabulary and a prompt built from its own greedy
continuation: the prompt pool then proposes likely candidates, so the exact verifier
accepts multi-token runs often. The first 3 generated tokens of independent draws
(LookaheadDecoder with seed=i for draw i) are compared with ``generate(do_sample=True)``
samples by two-sample chi-square tests (joint and per position). Every draw is seeded,
so the outcome is deterministic.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from lp.config import DecodingConfig
from lp.decoding import LookaheadDecoder
from lp.model import ModelRunner
from tests.helpers import hf_greedy, make_tiny_model

VOCAB = 12
NEW = 3
ALPHA = 1e-3  # per statistic; 5 statistics per comparison


def small_vocab_model():
    model = make_tiny_model("llama", vocab=VOCAB, initializer_range=0.3)
    seed_prompt = [1, 2, 3, 4, 5]
    prompt = seed_prompt + hf_greedy(model, seed_prompt, 20)
    return model, ModelRunner(model), prompt


@pytest.fixture(scope="module")
def small_vocab():
    return small_vocab_model()


def hf_samples(model, prompt, n, seed=1234, **kw) -> np.ndarray:
    torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    kw.setdefault("top_k", 0)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            num_return_sequences=n,
            max_new_tokens=NEW,
            **kw,
        )
    return out[:, len(prompt) :].numpy()


def lookahead_samples(runner, prompt, n, first_seed=0, drafts=None, tq_curve=None, **kw):
    hist = Counter()
    outs = []
    for i in range(first_seed, first_seed + n):
        cfg = DecodingConfig(W=3, N=4, G=5, prompt_pool=True, max_new_tokens=NEW, do_sample=True, seed=i,
                             **(drafts or {}), **kw)
        res = LookaheadDecoder(runner, cfg, tq_curve=tq_curve).generate(prompt)
        outs.append(res.output_ids)
        for k, c in enumerate(res.stats.accept_hist):
            hist[k] += c
    return np.array(outs), hist


def two_sample(a: np.ndarray, b: np.ndarray, min_expected: float = 5.0):
    """Chi-square test of homogeneity of the rows of a and b (as tuples); rare cells pooled."""
    ka, kb = Counter(map(tuple, a.tolist())), Counter(map(tuple, b.tolist()))
    keys = sorted(set(ka) | set(kb))
    counts = np.array([[ka[k] for k in keys], [kb[k] for k in keys]], dtype=np.float64)
    tv = 0.5 * np.abs(counts[0] / counts[0].sum() - counts[1] / counts[1].sum()).sum()
    big = counts.sum(0) / 2 >= min_expected
    table = counts[:, big]
    rest = counts[:, ~big].sum(1, keepdims=True)
    if rest.sum() > 0:
        table = np.concatenate([table, rest], axis=1)
    if table.shape[1] < 2:
        return 1.0, 0, tv  # a single outcome on both sides
    _, p, dof, _ = stats.chi2_contingency(table, correction=False)
    return p, dof, tv


def compare(a, b) -> dict:
    return {
        "t1": two_sample(a[:, :1], b[:, :1]),
        "t2": two_sample(a[:, 1:2], b[:, 1:2]),
        "t3": two_sample(a[:, 2:3], b[:, 2:3]),
        "t1t2": two_sample(a[:, :2], b[:, :2]),
        "t1t2t3": two_sample(a, b),
    }


def _fmt(res):
    return {k: (f"p={p:.3g}", f"dof={d}", f"tv={tv:.3f}") for k, (p, d, tv) in res.items()}


@pytest.mark.parametrize(
    "n,kw",
    [
        (5000, dict(temperature=1.0)),
        (2000, dict(temperature=0.8, top_k=4)),
        (2000, dict(top_p=0.9)),
        (2000, dict(temperature=0.7, top_k=6, top_p=0.95)),
    ],
    ids=["plain", "temp-topk", "topp", "temp-topk-topp"],
)
def test_sampled_lookahead_matches_generate(small_vocab, n, kw):
    model, runner, prompt = small_vocab
    a, hist = lookahead_samples(runner, prompt, n, **kw)
    b = hf_samples(model, prompt, n, **kw)
    assert a.shape == b.shape == (n, NEW)
    # the verifier was exercised: many draws published >= 2 tokens in one step
    assert hist[2] + hist[3] > 0.15 * n, dict(hist)
    assert hist[3] > 0.05 * n, dict(hist)
    res = compare(a, b)
    assert all(p > ALPHA for p, _, _ in res.values()), _fmt(res)


TREE = dict(drafts="suffix", draft_budget="all", max_draft_len=6, max_draft_rows=10, window_policy="with_candidates")


# a cost curve on which every draft node pays and 3..15 rows cost more than 16: steps are
# padded with filler chains up to max_draft_rows (lp.budget.envelope)
PADDED = [(1, 1.0), (2, 1.0), (3, 5.0), (16, 1.0)]


@pytest.mark.parametrize("kw,curve", [(dict(temperature=1.0), None), (dict(temperature=0.8, top_k=4), PADDED)],
                         ids=["plain", "temp-topk-padded"])
def test_sampled_tree_drafts_match_generate(small_vocab, kw, curve):
    """Suffix-matched drafts of several lengths, merged into a token tree (and, on the padded
    curve, filler chains beside them): the exact verifier at every trie node leaves the
    distribution unchanged."""
    model, runner, prompt = small_vocab
    n = 2000
    drafts = TREE if curve is None else dict(TREE, draft_budget="auto")
    a, hist = lookahead_samples(runner, prompt, n, drafts=drafts, tq_curve=curve, **kw)
    b = hf_samples(model, prompt, n, **kw)
    assert hist[2] + hist[3] > 0.15 * n, dict(hist)
    res = compare(a, b)
    assert all(p > ALPHA for p, _, _ in res.values()), _fmt(res)


def test_sampled_lookahead_seed_determinism(small_vocab):
    _, runner, prompt = small_vocab
    a, _ = lookahead_samples(runner, prompt, 20, first_seed=100)
    b, _ = lookahead_samples(runner, prompt, 20, first_seed=100)
    assert np.array_equal(a, b)
    assert len({tuple(r) for r in a.tolist()}) > 1, "different seeds should give different draws"


def test_negative_control_wrong_temperature_is_rejected(small_vocab):
    """The same test rejects a sampler with the wrong temperature: it has power."""
    model, runner, prompt = small_vocab
    a, _ = lookahead_samples(runner, prompt, 2000, temperature=1.3)
    b = hf_samples(model, prompt, 2000, temperature=1.0)
    res = compare(a, b)
    assert min(p for p, _, _ in res.values()) < 1e-6, _fmt(res)


def test_power_against_a_five_percent_shift(small_vocab):
    """Two plain-sampling sets, one with 5% of its draws moved to the second most likely
    first token (a total-variation shift of 0.05 * (1 - p)), are told apart at the size
    used for the main comparison."""
    model, _, prompt = small_vocab
    n = 5000
    a = hf_samples(model, prompt, n, seed=1)
    b = hf_samples(model, prompt, n, seed=2)
    assert all(p > ALPHA for p, _, _ in compare(a, b).values()), "two plain samples must agree"
    second = Counter(a[:, 0].tolist()).most_common(2)[1][0]
    shifted = a.copy()
    shifted[: n // 20, 0] = second  # rows are i.i.d., so this is the mixture 0.95 p + 0.05 delta
    res = compare(shifted, b)
    assert res["t1"][2] >= 0.035, _fmt(res)
    assert min(p for p, _, _ in res.values()) < ALPHA, _fmt(res)
