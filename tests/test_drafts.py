"""Draft trees: trie layout, variable-length verification, the draft budget on literal t(Q)
curves, the tree shard plan, and suffix-drafted decoding equal to greedy generate."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

import lp.drafts.budget
import lp.drafts.select
from lp.drafts.budget import AcceptanceModel, best_k, bucket, cost, envelope, padded_rows
from lp.config import DecodingConfig
from lp.engine.decoder import LookaheadDecoder
from lp.drafts.select import Scored, node_probs, select_tree
from lp.lookahead.layout import build_layout, build_tree_layout
from lp.model.runner import ModelRunner
from lp.lookahead.shard import plan_tree_shards
from lp.drafts.suffix import DraftStore, SuffixIndex
from lp.lookahead.tree import merge_trie
from lp.lookahead.verify import greedy_walk, walk
from tests.helpers import REPETITIVE_PROMPT, hf_greedy

CPU = [(1, 0.055), (2, 0.085), (16, 0.130), (32, 0.184)]  # this CPU, fp32 SmolLM2 (lead's numbers)
FLAT = [(1, 0.010), (64, 0.010)]  # an accelerator: rows are free


def test_module_doctests():
    for mod in (lp.drafts.budget, lp.drafts.select):
        result = doctest.testmod(mod)
        assert result.attempted > 0 and result.failed == 0, (mod.__name__, result)


# ---------------------------------------------------------------------------
# trie layout


def test_trie_rows_fewer_than_chain_rows_when_prefixes_are_shared():
    cands = [(5, 6, 7), (5, 6, 8), (5, 9), (4,)]
    chain = build_layout([1], [[]], range(0), cands)
    tree = build_tree_layout([1], [], range(0), cands)
    assert chain.num_rows == 1 + 3 + 3 + 2 + 1 == 10
    assert tree.num_rows == 1 + 6  # 5, 6, 7, 8, 9, 4
    assert tree.tokens == [1, 5, 6, 7, 8, 9, 4]
    assert tree.parents == [-1, 0, 1, 2, 2, 1, 0]
    assert tree.depths == [0, 1, 2, 3, 3, 2, 1]
    assert tree.cand_rows == [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    assert tree.keep == list(range(7))


def test_trie_rows_equal_chain_rows_without_shared_prefix():
    cands = [(5, 6), (7, 8, 9), (3,)]
    chain = build_layout([1, 2], [[]], range(0), cands)
    tree = build_tree_layout([1, 2], [], range(0), cands)
    assert tree.num_rows == chain.num_rows == 2 + 6
    assert tree.tokens == chain.tokens and tree.parents == chain.parents
    np.testing.assert_array_equal(tree.local_mask(), chain.local_mask())


def test_trie_mask_is_ancestors_and_window_is_kept():
    # window: x=7, levels [[11], [21, 22]] columns 0..1; candidates share the 5
    lay = build_tree_layout([7], [[11], [21, 22]], range(0, 2), [(5, 6), (5, 8)])
    assert lay.tokens == [7, 11, 21, 22, 5, 6, 8]
    assert lay.parents == [-1, 0, 0, 1, 0, 4, 4]
    assert lay.z_rows == [2, 3]
    m = lay.local_mask()
    assert m[5].nonzero()[0].tolist() == [0, 4, 5]
    assert m[6].nonzero()[0].tolist() == [0, 4, 6]
    assert not m[4:, 1:4].any() and not m[1:4, 4:].any()  # branches never see each other


def test_tree_skeleton_cached_by_shape():
    a = build_tree_layout([1], [], range(0), [(5, 6), (5, 7)])
    b = build_tree_layout([3], [], range(0), [(8, 2), (8, 9)])
    assert a.skeleton is b.skeleton and a.tokens != b.tokens


# ---------------------------------------------------------------------------
# verification over candidates of different lengths


def test_walk_candidates_of_different_lengths():
    cands = [(5,), (5, 6, 7, 8), (5, 6), (9, 1)]
    # argmax: x -> 5, after 5 -> 6, after 5 6 -> 7, after 5 6 7 -> 2 (rejects 8)
    out = {1: 6, 2: 7, 3: 2, 4: 0}
    path = walk(cands, 5, lambda depth, c: out[depth])
    assert path.emitted == [5, 6, 7, 2] and path.winner == 1 and path.hits == 3
    # a short candidate that is fully accepted ends its path: the node's outcome is published
    path = walk([(5,), (4, 4)], 5, lambda depth, c: {1: 3}[depth])
    assert path.emitted == [5, 3] and path.winner == 0 and path.hits == 1


def test_greedy_walk_equal_lengths_unchanged():
    cands = [(5, 6), (5, 8), (9, 1)]
    # the node after 5 is read from the lowest survivor's row (candidate 0: 8)
    path = greedy_walk(cands, 5, [[8, 0], [8, 3], [0, 0]])
    assert path.emitted == [5, 8, 3] and path.winner == 1 and path.hits == 2


# ---------------------------------------------------------------------------
# the budget, on literal curves


def test_cost_interpolates_and_extrapolates():
    assert cost(CPU, 1) == 0.055 and cost(CPU, 2) == 0.085
    assert cost(CPU, 9) == pytest.approx(0.085 + 7 * 0.045 / 14)
    assert cost(CPU, 48) == pytest.approx(0.184 + 16 * 0.054 / 16)
    assert cost(CPU, 0) == 0.055


def test_best_k_frugal_on_cpu_generous_on_flat_curve():
    likely = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5]
    unlikely = [0.3, 0.2, 0.1]
    assert best_k(unlikely, 1, CPU) == 0  # a plain one-row step
    assert best_k(likely, 1, CPU) == 10  # a long likely draft pays for its rows
    assert best_k(unlikely, 1, FLAT) == 3  # free rows: verify everything
    assert best_k(likely, 1, FLAT, cap=4) == 4
    assert best_k(unlikely, 1, None) == 3
    # window rows that ride along only with drafts make a marginal draft not pay
    assert best_k([0.6], 1, CPU) == 1 and best_k([0.6], 1, CPU, extra_rows=8) == 0
    # LP: rows split over workers make more of the tree pay
    probs = [0.9, 0.8, 0.7, 0.4, 0.3, 0.3, 0.2, 0.2]
    assert best_k(probs, 1, [(1, 1.0), (2, 1.5), (4, 3.0)], workers=1) <= best_k(
        probs, 1, [(1, 1.0), (2, 1.5), (4, 3.0)], workers=4)


def test_acceptance_model_buckets_and_updates():
    a = AcceptanceModel()
    assert [bucket(m) for m in (0, 1, 2, 3, 4, 7, 8, 15, 16, 99)] == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6]
    before = a.rate(1)
    a.observe(1, tried=10, accepted=0)
    assert a.rate(1) < before and a.rate(2) == AcceptanceModel().rate(2)


BUMPY = [(1, 58.0), (2, 95.0), (3, 118.0), (4, 84.0), (5, 75.0), (6, 78.0), (8, 81.0), (16, 98.0)]  # MKL, 2-core EPYC


def test_envelope_and_padded_rows_on_a_curve_that_dips():
    assert envelope(BUMPY) == [(1, 58.0), (2, 75.0), (3, 75.0), (4, 75.0), (5, 75.0), (6, 78.0), (8, 81.0),
                               (16, 98.0)]
    assert [padded_rows(BUMPY, r) for r in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17)] == [1, 5, 5, 5, 5, 6, 7, 8, 9, 17]
    assert envelope(CPU) == CPU  # a rising curve is its own envelope
    assert [padded_rows(CPU, r) for r in (1, 2, 3, 16, 40)] == [1, 2, 3, 16, 40]


def test_select_tree_pads_to_the_cheapest_size_within_cap():
    a = AcceptanceModel()
    one = [Scored((5, 6), 3, 1.0)]
    # priced as measured: 2 drafted rows + 1 pending cost t(3) = 118, the likely pair pays anyway
    assert select_tree(one, a, 1, BUMPY, 16) == [(5, 6)]
    # padded: 3 rows -> 5 rows at t(5) = 75; the next nodes fill first, then filler chains
    assert select_tree(one, a, 1, BUMPY, 16, pad=True) == [(5, 6), (0, 0)]
    two = [Scored((5, 6), 3, 1.0), Scored((7, 8, 9), 1, 0.5)]
    assert select_tree(two, a, 1, BUMPY, 16, pad=True) == [(5, 6), (7, 8)]
    assert select_tree(one, a, 1, BUMPY, 3, pad=True) == [(5, 6), (0,)]  # cap: 3 draft rows
    assert select_tree(one, a, 1, BUMPY, 2, pad=True) == [(5, 6)]
    filler = select_tree([Scored((0, 1), 3, 1.0)], a, 1, BUMPY, 16, pad=True)
    assert filler == [(0, 1), (1, 1)]  # filler never shares a first token with a draft
    assert select_tree([Scored((5,), 1, 0.2)], a, 1, BUMPY, 16, pad=True) == []  # nothing pays: one row


def test_node_probability_grows_with_the_match_a_draft_extends():
    a = AcceptanceModel()
    drafts = [Scored((1, 2, 3), 1, 1.0), Scored((4, 5), 0, 1.0)]
    trie = merge_trie([d.tokens for d in drafts])
    p = node_probs(drafts, trie, a)
    r = a.rate
    assert p[:3] == pytest.approx([r(1), r(1) * r(2), r(1) * r(2) * r(3)])
    assert p[3:] == pytest.approx([r(0), r(0) ** 2])  # pool n-grams: one rate at every depth
    assert r(1) < r(2) < r(3) < r(4) < r(8) < r(16)


def test_select_tree_keeps_ancestor_closed_nodes_within_cap():
    drafts = [Scored((5, 6, 7, 8, 9), 9, 1.0), Scored((5, 6, 1), 3, 0.5), Scored((2, 3), 0, 1.0)]
    for cap in range(0, 12):
        cut = select_tree(drafts, AcceptanceModel(), 1, None, cap)
        prefixes = {c[:i] for c in cut for i in range(1, len(c) + 1)}
        assert len(prefixes) == min(cap, 8)
        for c in cut:  # every kept draft is a prefix of a proposed one
            assert any(d.tokens[: len(c)] == c for d in drafts)


# ---------------------------------------------------------------------------
# tree shards


def test_tree_shards_keep_subtrees_whole_and_balance_rows():
    cands = ((5, 6, 7), (5, 6, 8), (9, 1, 2, 3), (4,), (4, 4))
    for workers in (1, 2, 3, 4):
        plan = plan_tree_shards(workers, 1, 0, 0, cands)
        owners = {}
        for k, s in enumerate(plan):
            for c in s.candidates:
                owners.setdefault(cands[c][0], set()).add(k)
        assert all(len(ks) == 1 for ks in owners.values())  # a subtree is never split
        assert sorted(c for s in plan for c in s.candidates) == list(range(len(cands)))
        assert sum(s.rows - 1 for s in plan) == 4 + 4 + 2  # trie nodes, each on one worker
    plan = plan_tree_shards(3, 1, 0, 0, cands)
    assert sorted(s.rows for s in plan) == [3, 5, 5]


# ---------------------------------------------------------------------------
# decoding with suffix drafts equals greedy generate (tiny random models)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
@pytest.mark.parametrize("budget", ["all", "cpu", "flat", "bumpy"], ids=["all", "cpu-curve", "flat-curve", "bumpy-curve"])
def test_suffix_drafts_greedy_equals_generate(tiny_factory, family, budget):
    model = tiny_factory(family)
    ref = hf_greedy(model, REPETITIVE_PROMPT, 48)
    curve = {"all": None, "cpu": CPU, "flat": FLAT, "bumpy": BUMPY}[budget]  # bumpy: padded steps, filler rows
    cfg = DecodingConfig(max_new_tokens=48, drafts="suffix", draft_budget="all" if curve is None else "auto",
                         max_draft_rows=12, W=2, N=3, G=3, window_policy="with_candidates")
    res = LookaheadDecoder(ModelRunner(model), cfg, tq_curve=curve).generate(REPETITIVE_PROMPT)
    assert res.output_ids == ref
    # drafts were verified: steps of more than one row (plain decoding runs one row a step)
    assert sum(rec.rows > 1 for rec in res.stats.records) >= 3, [rec.rows for rec in res.stats.records]
    if budget in ("all", "flat"):
        assert res.stats.compression_ratio > 1.0


def test_default_config_is_suffix_tree_and_exact(tiny_factory):
    model = tiny_factory("llama")
    dec = LookaheadDecoder(ModelRunner(model), DecodingConfig(max_new_tokens=40), tq_curve=CPU)
    assert dec.cfg.drafts == "suffix" and dec.cfg.max_draft_rows == 24
    assert dec.cfg.window_policy == "off"  # this CPU class: the window's rows do not pay (lp.config)
    res = dec.generate(REPETITIVE_PROMPT)
    assert res.output_ids == hf_greedy(model, REPETITIVE_PROMPT, 40)
    # explicit W/N/G keeps the paper's window and verification branch
    paper = LookaheadDecoder(ModelRunner(model), DecodingConfig(W=15, N=5, G=15, max_new_tokens=8))
    assert paper.cfg.drafts == "pool" and paper.cfg.window_policy == "always"


def test_drafts_alone_and_near_the_context_end(tiny_factory):
    model = tiny_factory("llama", max_positions=64)
    prompt = (REPETITIVE_PROMPT * 2)[:40]
    ref = hf_greedy(model, prompt, 24)
    cfg = DecodingConfig(max_new_tokens=24, drafts="suffix", draft_budget="all", max_draft_len=16, W=1, N=3, G=4,
                         window_policy="off")
    res = LookaheadDecoder(ModelRunner(model), cfg).generate(prompt)
    assert res.output_ids == ref
    assert res.stats.compression_ratio > 1.0


def test_draft_store_across_requests_is_exact_and_bounded(tiny_factory):
    model = tiny_factory("llama", max_positions=4200)
    runner = ModelRunner(model)
    store = DraftStore(max_tokens=3000)
    cfg = DecodingConfig(max_new_tokens=4096, drafts="suffix", draft_budget="all", max_draft_rows=8, W=1, N=3, G=2,
                         window_policy="off", draft_store=True)
    dec = LookaheadDecoder(runner, cfg, draft_store=store)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = dec.generate(prompt)
    assert first.output_ids == hf_greedy(model, prompt, 4096)
    assert len(store) == 3000 and store.num_states <= 2 * len(store) + store.num_sequences
    ix = SuffixIndex(prompt + first.output_ids)  # what the request's own index held
    assert ix.num_states <= 2 * len(ix)
    short = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=64, drafts="suffix", draft_budget="all",
                                                    max_draft_rows=8, W=1, N=3, G=2), draft_store=store)
    again = short.generate(prompt[1:])
    assert again.output_ids == hf_greedy(model, prompt[1:], 64)
    res = short.generate(prompt[1:])
    assert res.output_ids == again.output_ids
    assert res.stats.compression_ratio > again.stats.compression_ratio  # the store holds this continuation
    assert len(store) <= 3000


NOISY = [(1, 0.0518), (2, 0.0544), (4, 0.0545), (8, 0.0615), (9, 0.0610), (10, 0.0614), (12, 0.0658), (16, 0.0742),
         (24, 0.0844), (32, 0.0933)]  # a compiled SmolLM2 step on a 2-vCPU Xeon: 1-3% noise, no real bumps


def test_a_batched_step_prices_rows_at_the_curves_slope_not_its_noise():
    from lp.drafts.select import TreeRequest, select_trees

    a = AcceptanceModel()
    assert envelope(NOISY) == NOISY and padded_rows(NOISY, 8) == 8  # bumps within 5%: no padding
    plain = [TreeRequest([], a, base=1, cap=16) for _ in range(7)]
    weak = TreeRequest([Scored((5, 9), 1, 0.5)], a, base=1, cap=16)  # P 0.125, 0.069
    sure = TreeRequest([Scored((5, 6, 7, 8), 6, 1.0)], a, base=1, cap=16)  # P 0.78 .. 0.47
    # t(9) measured below t(8): priced as measured, a weak node looked free and every step drafted
    assert select_trees(plain + [weak], NOISY, pad=True) == [[]] * 8
    assert select_trees(plain + [sure], NOISY, pad=True)[-1] == [(5, 6, 7, 8)]
