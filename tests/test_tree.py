"""merge_trie on literal candidate lists, plus random checks against the prefix set."""

from __future__ import annotations

import doctest
import random

import lp.lookahead.tree
from lp.lookahead.tree import merge_trie


def chain_rows(candidates):
    return sum(len(c) for c in candidates)


def check(candidates):
    """Invariants every TrieRows must satisfy; returns it."""
    t = merge_trie(candidates)
    prefixes = {tuple(c[:i]) for c in candidates for i in range(1, len(c) + 1)}
    assert len(t) == len(prefixes) <= chain_rows(candidates)
    assert len(t.parents) == len(t.tokens) == len(t.depths) == len(t)
    for r in range(len(t)):
        p = t.parents[r]
        assert p < r  # parents first
        assert t.depths[r] == (1 if p == -1 else t.depths[p] + 1)
    # DFS preorder: each subtree is the contiguous range of rows after its root
    for r in range(len(t)):
        end = r + 1
        while end < len(t) and t.depths[end] > t.depths[r]:
            end += 1
        below = {s for s in range(len(t)) if _ancestor(t, r, s)}
        assert below == set(range(r, end))
    assert len(t.paths) == len(candidates)
    for c, path in zip(candidates, t.paths):
        assert [t.tokens[r] for r in path] == list(c)
        assert [t.parents[r] for r in path] == ([-1] + path[:-1] if path else [])
    return t


def _ancestor(t, a, s):
    while s != -1:
        if s == a:
            return True
        s = t.parents[s]
    return False


def test_module_doctests():
    result = doctest.testmod(lp.lookahead.tree, verbose=False, report=True)
    assert result.attempted > 0 and result.failed == 0


def test_shared_prefixes_share_rows():
    t = check([(5, 6, 7), (5, 6, 8), (9,), (5, 2)])
    assert t.parents == [-1, 0, 1, 1, 0, -1]
    assert t.tokens == [5, 6, 7, 8, 2, 9]
    assert t.depths == [1, 2, 3, 3, 2, 1]
    assert t.paths == [[0, 1, 2], [0, 1, 3], [5], [0, 4]]
    assert len(t) == 6 < chain_rows([(5, 6, 7), (5, 6, 8), (9,), (5, 2)]) == 9


def test_no_shared_prefix_equals_chains():
    cands = [(1, 2, 3), (4, 5), (6,), (7, 1, 2, 3)]
    t = check(cands)
    assert len(t) == chain_rows(cands) == 10
    assert t.paths == [[0, 1, 2], [3, 4], [5], [6, 7, 8, 9]]
    assert t.parents == [-1, 0, 1, -1, 3, -1, -1, 6, 7, 8]
    assert t.tokens == [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]


def test_duplicates_prefixes_and_empties():
    t = check([(3, 4), (3, 4), (3,), (), (3, 4, 5)])
    assert t.tokens == [3, 4, 5] and t.parents == [-1, 0, 1] and t.depths == [1, 2, 3]
    assert t.paths == [[0, 1], [0, 1], [0], [], [0, 1, 2]]
    t = check([])
    assert len(t) == 0 and t.paths == []


def test_children_in_first_appearance_order():
    t = check([(1, 9), (2,), (1, 8), (1, 9, 7)])
    assert t.tokens == [1, 9, 7, 8, 2]
    assert t.paths == [[0, 1], [4], [0, 3], [0, 1, 2]]


def test_random_candidates():
    rng = random.Random(3)
    for _ in range(200):
        cands = [tuple(rng.randrange(3) for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(0, 8))]
        check(cands)
