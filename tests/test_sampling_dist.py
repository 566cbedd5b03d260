"""Sampled lookahead decoding draws every token with exactly its target probability.

A tiny random model with a 12-token vocabulary and a prompt built from its own greedy
continuation (the pool and the suffix drafts then propose likely tokens, so drafts are accepted
and rejected often). The exact distribution of the first 3 new tokens is enumerated by plain
forwards (one batched forward per prefix length, transformers' own warpers;
tests.helpers.exact_next_probs). Draws of LookaheadDecoder (seed=i for draw i) are tested per
prefix: the next token's counts against the exact conditional distribution, every prefix that
enough draws share, Bonferroni over all of them (tests.helpers.conditional_fit). A verifier bug
shows in the conditionals at the nodes where drafts were tested, which a joint or marginal test
blurs.

Every configuration also runs with a planted bug (a draft accepted by its probability instead of
by equality with the position's draw, tests.helpers.probability_accept_draw) and the same test
must reject it: the test has power where it matters. Every draw is seeded, so the outcome is
deterministic.

Position-keyed draws (issue 51) also make the text a function of (prompt, seed, weights): seeded
lookahead, with the window, suffix drafts or padded draft trees, equals lp's plain seeded decoding
(``mode=ar``) token for token, and the planted bugs (the draw keyed by the step, a draft accepted
by probability) each break that equality.
"""

from __future__ import annotations

from collections import Counter

import pytest

from lp.config import DecodingConfig
from lp.engine.decoder import LookaheadDecoder
from tests.helpers import (
    SMALL_VOCAB,
    conditional_fit,
    exact_next_probs,
    fit_verdict,
    plant_draw,
    probability_accept_draw,
    step_keyed_draw,
)

VOCAB = SMALL_VOCAB  # the conftest small_vocab model's
NEW = 3
DRAWS = 1000
BUG_DRAWS = 500  # the planted bug is rejected at p < 1e-20 already at this size

POOL = dict(W=3, N=4, G=5, prompt_pool=True)  # the paper's pool, always-on window
TREE = dict(POOL, drafts="suffix", draft_budget="all", max_draft_len=6, max_draft_rows=10,
            window_policy="with_candidates")  # suffix drafts + window n-grams in one token tree
# a cost curve on which 3..15 rows cost more than 16: steps are padded with filler chains up
# to max_draft_rows (lp.drafts.budget.envelope), and verification treats the filler like any draft
PADDED = [(1, 1.0), (2, 1.0), (3, 5.0), (16, 1.0)]

CASES = {
    "pool-plain": (POOL, None, dict(temperature=1.0)),
    "pool-temp-topk-topp": (POOL, None, dict(temperature=0.7, top_k=6, top_p=0.9)),
    "tree-plain": (TREE, None, dict(temperature=1.0)),
    "tree-padded-temp-topk": (dict(TREE, draft_budget="auto"), PADDED, dict(temperature=0.8, top_k=4)),
}


def lookahead_draws(runner, prompt, n, shape, tq_curve=None, first_seed=0, **kw):
    """n draws of NEW tokens (seed = first_seed + i), and the accepted-length histogram."""
    hist, outs = Counter(), []
    for i in range(first_seed, first_seed + n):
        cfg = DecodingConfig(max_new_tokens=NEW, do_sample=True, seed=i, **shape, **kw)
        res = LookaheadDecoder(runner, cfg, tq_curve=tq_curve).generate(prompt)
        outs.append(res.output_ids)
        hist.update({k: c for k, c in enumerate(res.stats.accept_hist)})
    return outs, hist


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_lookahead_has_exact_conditionals(small_vocab, case, monkeypatch):
    model, runner, prompt = small_vocab
    shape, curve, kw = CASES[case]
    exact = exact_next_probs(model, prompt, NEW, **kw)
    draws, hist = lookahead_draws(runner, prompt, DRAWS, shape, curve, **kw)
    assert all(len(d) == NEW for d in draws)
    # the verifier was exercised: many draws published >= 2 tokens in one step
    assert hist[2] + hist[3] > 0.15 * DRAWS, dict(hist)
    ok, report = fit_verdict(conditional_fit(draws, exact))
    assert ok, f"{case}: {report}"

    # negative control: the same draws with a planted verifier bug are rejected
    plant_draw(probability_accept_draw, monkeypatch.setattr)
    bad, _ = lookahead_draws(runner, prompt, BUG_DRAWS, shape, curve, **kw)
    ok, report = fit_verdict(conditional_fit(bad, exact))
    assert not ok, f"{case}: the planted verifier bug went unnoticed: {report}"


def test_sampled_lookahead_seed_determinism(small_vocab):
    _, runner, prompt = small_vocab
    a, _ = lookahead_draws(runner, prompt, 20, POOL, first_seed=100)
    b, _ = lookahead_draws(runner, prompt, 20, POOL, first_seed=100)
    assert a == b
    assert len({tuple(r) for r in a}) > 1, "different seeds should give different draws"


PLAIN_PROMPTS = [[1, 2, 3, 4, 5], [9, 4, 5, 8, 9, 10, 8, 9, 11, 5, 5, 4, 1, 2, 10]]
EQUAL_SHAPES = {"pool": (POOL, None), "tree": (TREE, None), "tree-padded": (dict(TREE, draft_budget="auto"), PADDED)}


def _seeded_runs(runner, prompt, shape, curve, seeds, **kw):
    return [LookaheadDecoder(runner, DecodingConfig(max_new_tokens=24, do_sample=True, seed=s, **shape, **kw),
                             tq_curve=curve).generate(list(prompt)) for s in seeds]


@pytest.mark.parametrize("shape", list(EQUAL_SHAPES))
def test_seeded_lookahead_equals_plain_seeded_decoding(small_vocab, shape, monkeypatch):
    """Token for token lp's one-token seeded decoding (mode=ar), whatever the drafts; the draw keyed
    by the step and a draft accepted by probability each break it."""
    _, runner, prompt = small_vocab
    lay, curve = EQUAL_SHAPES[shape]
    seeds = range(6)
    for p in [prompt, *PLAIN_PROMPTS]:
        for kw in (dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_p=0.9)):
            plain = [r.output_ids for r in _seeded_runs(runner, p, dict(mode="ar"), None, seeds, **kw)]
            runs = _seeded_runs(runner, p, lay, curve, seeds, **kw)
            assert [r.output_ids for r in runs] == plain, (shape, p, kw)
            assert sum(sum(r.stats.accept_hist[2:]) for r in runs) > 0  # drafts were accepted
    for bug in (step_keyed_draw, probability_accept_draw):
        with monkeypatch.context() as m:
            plant_draw(bug, m.setattr)
            bad = [r.output_ids for r in _seeded_runs(runner, prompt, lay, curve, seeds, temperature=1.0)]
        plain = [r.output_ids for r in _seeded_runs(runner, prompt, dict(mode="ar"), None, seeds, temperature=1.0)]
        assert bad != plain, f"the planted {bug.__name__} went unnoticed"
