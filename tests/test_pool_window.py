"""NGramPool and Window on literal token lists."""

from __future__ import annotations

import pytest

from lp.lookahead.pool import NGramPool
from lp.lookahead.window import Window

# ---------------------------------------------------------------------------
# NGramPool


def test_pool_docstring_example():
    p = NGramPool(n=3, capacity=2)
    p.add(1, (2, 3))
    p.add(1, (4, 5))
    p.add(1, (2, 3))
    p.add(1, (6, 7))
    assert p.get(1) == [(6, 7), (2, 3)]
    assert len(p) == 2


def test_pool_lru_order_and_reinsert():
    p = NGramPool(n=3, capacity=3)
    p.add(1, (2, 3))
    p.add(1, (4, 5))
    p.add(1, (6, 7))
    assert p.get(1) == [(6, 7), (4, 5), (2, 3)]
    p.add(1, [2, 3])  # a list suffix is the same n-gram; re-insert makes it most recent
    assert p.get(1) == [(2, 3), (6, 7), (4, 5)]
    assert len(p) == 3
    assert p.get(1, limit=2) == [(2, 3), (6, 7)]
    assert p.get(1, limit=0) == []


def test_pool_eviction_drops_least_recent():
    p = NGramPool(n=2, capacity=2)
    p.add(9, (1,))
    p.add(9, (2,))
    p.add(9, (1,))  # (2,) is now the least recent
    p.add(9, (3,))
    assert p.get(9) == [(3,), (1,)]
    p.add(9, (4,))
    assert p.get(9) == [(4,), (3,)]
    assert len(p) == 2


def test_pool_buckets_are_independent():
    p = NGramPool(n=2, capacity=1)
    p.add(1, (10,))
    p.add(2, (20,))
    p.add(1, (11,))  # evicts only within key 1
    assert p.get(1) == [(11,)]
    assert p.get(2) == [(20,)]
    assert p.get(3) == []
    assert [k in p for k in (1, 2, 3)] == [True, True, False]
    assert len(p) == 2


def test_pool_capacity_zero_stores_nothing():
    p = NGramPool(n=3, capacity=0)
    p.add(1, (2, 3))
    p.add_sequence([1, 2, 3, 1, 2, 3, 4])
    assert len(p) == 0
    assert p.get(1) == []
    assert (1 in p) is False


def test_pool_rejects_wrong_suffix_length():
    p = NGramPool(n=3, capacity=2)
    with pytest.raises(AssertionError):
        p.add(1, (2,))


def test_pool_add_sequence_from_start():
    p = NGramPool(n=3, capacity=4)
    p.add_sequence([1, 2, 3, 1, 2, 4])
    # n-grams in order: 1:(2,3) 2:(3,1) 3:(1,2) 1:(2,4)
    assert p.get(1) == [(2, 4), (2, 3)]
    assert p.get(2) == [(3, 1)]
    assert p.get(3) == [(1, 2)]
    assert p.get(4) == []
    assert len(p) == 4


def test_pool_add_sequence_short_input():
    p = NGramPool(n=4, capacity=4)
    p.add_sequence([1, 2, 3])  # shorter than n: nothing
    assert len(p) == 0
    p.add_sequence([1, 2, 3, 4])
    assert p.get(1) == [(2, 3, 4)]
    assert len(p) == 1


def test_pool_add_sequence_start_adds_only_new_ngrams():
    n = 3
    tokens = [1, 2, 3]
    inc = NGramPool(n=n, capacity=8)
    inc.add_sequence(tokens)
    assert inc.get(1) == [(2, 3)]
    new = [4, 5]
    tokens = tokens + new
    start = len(tokens) - len(new) - (n - 1)
    assert start == 1
    before = len(inc)
    inc.add_sequence(tokens, start=start)
    # only n-grams whose last token is one of the new tokens: 2:(3,4) 3:(4,5)
    assert len(inc) == before + 2
    assert inc.get(2) == [(3, 4)]
    assert inc.get(3) == [(4, 5)]
    assert inc.get(1) == [(2, 3)]
    # incremental seeding builds the same pool, in the same order, as one pass
    full = NGramPool(n=n, capacity=8)
    full.add_sequence(tokens)
    assert inc.fingerprint() == full.fingerprint()
    # a start that would be negative (more new tokens than the history) is clamped
    neg = NGramPool(n=n, capacity=8)
    neg.add_sequence([7, 8, 9], start=-5)
    assert neg.get(7) == [(8, 9)]
    # start beyond the last n-gram: nothing
    none = NGramPool(n=n, capacity=8)
    none.add_sequence([7, 8, 9, 10], start=2)
    assert len(none) == 0


def test_pool_add_sequence_start_does_not_refresh_old_ngrams():
    # Re-adding old n-grams would change LRU order; start must skip them.
    p = NGramPool(n=2, capacity=2)
    p.add_sequence([1, 2, 1, 3])  # 1:(2,) then 1:(3,)
    assert p.get(1) == [(3,), (2,)]
    tokens = [1, 2, 1, 3, 5]
    p.add_sequence(tokens, start=len(tokens) - 1 - 1)
    assert p.get(1) == [(3,), (2,)]
    assert p.get(3) == [(5,)]


def test_pool_fingerprint_sees_order():
    a = NGramPool(n=2, capacity=2)
    b = NGramPool(n=2, capacity=2)
    a.add(1, (2,))
    a.add(1, (3,))
    b.add(1, (3,))
    b.add(1, (2,))
    assert a.fingerprint() != b.fingerprint()
    b.add(1, (3,))
    assert a.fingerprint() == b.fingerprint()


# ---------------------------------------------------------------------------
# Window


def test_window_seed_size():
    assert Window.seed_size(5, 4) == 6
    assert Window.seed_size(1, 2) == 0
    assert Window.seed_size(15, 5) == 17
    with pytest.raises(AssertionError):
        Window(5, 4, [1, 2, 3])


def test_window_docstring_extraction_example():
    w = Window(5, 4, [0] * 6)
    w.levels = [[11, 12, 13, 14], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]]
    assert w.warm and w.num_columns == 5 and w.depth == 2
    ngrams = w.update(10, [41, 42, 43, 44, 45])
    assert ngrams == [
        (10, (21, 31, 41)),
        (11, (22, 32, 42)),
        (12, (23, 33, 43)),
        (13, (24, 34, 44)),
        (14, (25, 35, 45)),
    ]
    # advanced exactly one column: level 1 minus its first entry becomes level 0
    assert w.levels == [[22, 23, 24, 25], [31, 32, 33, 34, 35], [41, 42, 43, 44, 45]]
    assert w.sizes() == [4, 5, 5]


def test_window_warmup_sizes_w5_n4():
    seed = [1, 2, 3, 4, 5, 6]
    w = Window(5, 4, seed)
    assert w.sizes() == [6] and not w.warm and w.num_columns == 7 and w.depth == 0
    assert w.update(100, [10, 11, 12, 13, 14, 15, 16]) == []
    assert w.sizes() == [5, 6] and not w.warm and w.num_columns == 6 and w.depth == 1
    assert w.levels == [[2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]]
    assert w.update(101, [20, 21, 22, 23, 24, 25]) == []
    assert w.sizes() == [4, 5, 5] and w.warm and w.num_columns == 5 and w.depth == 2
    assert w.levels == [[3, 4, 5, 6], [12, 13, 14, 15, 16], [21, 22, 23, 24, 25]]
    # first warm step harvests W n-grams
    ngrams = w.update(102, [30, 31, 32, 33, 34])
    assert ngrams == [
        (102, (12, 21, 30)),
        (3, (13, 22, 31)),
        (4, (14, 23, 32)),
        (5, (15, 24, 33)),
        (6, (16, 25, 34)),
    ]
    assert w.sizes() == [4, 5, 5]
    assert w.levels == [[13, 14, 15, 16], [21, 22, 23, 24, 25], [30, 31, 32, 33, 34]]


def test_window_update_checks_z_length():
    w = Window(5, 4, [1, 2, 3, 4, 5, 6])
    with pytest.raises(AssertionError):
        w.update(0, [1, 2, 3, 4, 5])  # needs 7 during the first warm-up step


def test_window_n2_is_warm_immediately():
    w = Window(3, 2, [7, 8])
    assert w.warm and w.sizes() == [2] and w.num_columns == 3 and w.depth == 0
    assert w.update(6, [1, 2, 3]) == [(6, (1,)), (7, (2,)), (8, (3,))]
    assert w.levels == [[2, 3]]
    assert w.update(9, [4, 5, 6]) == [(9, (4,)), (2, (5,)), (3, (6,))]
    assert w.levels == [[5, 6]]


def test_window_w1_n2():
    w = Window(1, 2, [])
    assert w.warm and w.sizes() == [0] and w.num_columns == 1
    assert w.update(4, [5]) == [(4, (5,))]
    assert w.levels == [[]]
    assert w.update(5, [6]) == [(5, (6,))]


def test_window_w1_n4_warmup():
    w = Window(1, 4, [1, 2])
    assert w.sizes() == [2] and w.num_columns == 3
    assert w.update(0, [10, 11, 12]) == []
    assert w.levels == [[2], [11, 12]] and w.num_columns == 2
    assert w.update(0, [20, 21]) == []
    assert w.levels == [[], [12], [21]] and w.warm and w.num_columns == 1
    assert w.update(50, [30]) == [(50, (12, 21, 30))]
    assert w.levels == [[], [21], [30]]
    assert w.update(51, [40]) == [(51, (21, 30, 40))]


def test_window_fingerprint_tracks_state():
    a = Window(3, 3, [1, 2, 3])
    b = Window(3, 3, [1, 2, 3])
    assert a.fingerprint() == b.fingerprint()
    a.update(0, [4, 5, 6, 7])
    assert a.fingerprint() != b.fingerprint()
    b.update(0, [4, 5, 6, 7])
    assert a.fingerprint() == b.fingerprint()


# ---------------------------------------------------------------------------
# ContextIndex (prompt-lookup ranking of prompt/output n-grams)


def test_context_index_docstring_example():
    from lp.lookahead.pool import ContextIndex

    ix = ContextIndex([5, 6, 7, 9, 6, 7, 8, 1, 6, 7])
    assert ix.lookup(2, 3) == [(8, 1), (9, 6)]
    assert ix.lookup(2, 1) == [(8, 1)]
    assert ix.lookup(2, 0) == []


def test_context_index_longest_context_first():
    from lp.lookahead.pool import ContextIndex

    # last token 3 with left context (1, 2, 3); earlier 3s at index 2 (context 1,2,3),
    # index 6 (context 9,2,3) and index 10 (context 4,4,3)
    toks = [1, 2, 3, 7, 9, 2, 3, 8, 4, 4, 3, 5, 1, 2, 3]
    ix = ContextIndex(toks, max_context=3)
    # m=3 matches only position 2 -> (7, 9); m=2 adds position 6 -> (8, 4); m=1 adds position 10 -> (5, 1)
    assert ix.lookup(2, 5) == [(7, 9), (8, 4), (5, 1)]
    # with one token of context only, the most recent occurrence comes first
    assert ContextIndex(toks, max_context=1).lookup(2, 5) == [(5, 1), (8, 4), (7, 9)]


def test_context_index_suffixes_are_complete_and_distinct():
    from lp.lookahead.pool import ContextIndex

    ix = ContextIndex([4, 1, 2, 4, 1, 2, 4, 1])
    # both earlier 1s continue with (2, 4, 1): proposed once
    assert ix.lookup(3, 5) == [(2, 4, 1)]
    assert ix.lookup(2, 5) == [(2, 4)]
    # an occurrence too close to the end cannot give a full R-token suffix
    assert ix.lookup(6, 5) == [(2, 4, 1, 2, 4, 1)]
    assert ix.lookup(7, 5) == []
    ix.extend([9])
    assert ix.lookup(2, 5) == []
    assert ContextIndex([]).lookup(2, 3) == [] and ContextIndex([7]).lookup(1, 3) == []


def test_context_index_agrees_with_pool_for_unit_context():
    """With one token of context the index proposes exactly the pool's suffixes for the last token."""
    from lp.lookahead.pool import ContextIndex

    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    for n in (2, 3, 4):
        pool = NGramPool(n=n, capacity=100)
        prefix = toks[:-1]
        pool.add_sequence(prefix)
        got = ContextIndex(toks, max_context=1).lookup(n - 1, 100)
        # the pool also holds n-grams ending at the last prefix token; those need the whole
        # sequence: compare the sets over the full sequence instead
        full = NGramPool(n=n, capacity=100)
        full.add_sequence(toks)
        expected = [s for s in full.get(toks[-1])]
        assert sorted(got) == sorted(expected), n
