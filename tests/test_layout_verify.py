"""build_layout (rows, parents, depths, mask) and the verification walk, on literal token lists."""

from __future__ import annotations

import numpy as np
import pytest

from lp.lookahead.layout import build_layout
from lp.lookahead.verify import Path, children, greedy_walk, sharing_prefix, walk

# ---------------------------------------------------------------------------
# layout


def test_layout_docstring_example():
    lay = build_layout([7], [[11], [21, 22]], range(0, 2), [(5, 6)])
    assert lay.tokens == [7, 11, 21, 22, 5, 6]
    assert lay.parents == [-1, 0, 0, 1, 0, 4]
    assert lay.depths == [0, 1, 1, 2, 1, 2]
    assert lay.keep == [0, 2, 3, 4, 5]
    assert lay.z_rows == [2, 3]
    assert lay.cand_rows == [[4, 5]]
    assert lay.num_rows == 6 and lay.ordinary_row == 0 and lay.num_pending == 1
    m = lay.local_mask()
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0],  # x
            [1, 1, 0, 0, 0, 0],  # B[1] = 11
            [1, 0, 1, 0, 0, 0],  # level 1, column 0: below x
            [1, 1, 0, 1, 0, 0],  # level 1, column 1: below B[1]
            [1, 0, 0, 0, 1, 0],  # candidate token 5
            [1, 0, 0, 0, 1, 1],  # candidate token 6
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(m, expected)


def _visible_sets(pending, levels, columns, candidates):
    """Independent description of what each row may see, by row *name*."""
    names = []
    vis = {}
    I = len(pending)
    for i in range(I):
        names.append(("p", i))
        vis[("p", i)] = {("p", k) for k in range(i + 1)}
    all_p = {("p", k) for k in range(I)}
    if len(columns):
        for j in range(1, columns.stop):
            names.append(("b", j))
            vis[("b", j)] = all_p | {("b", k) for k in range(1, j + 1)}
        for r in range(1, len(levels)):
            for j in columns:
                names.append(("l", r, j))
                vis[("l", r, j)] = all_p | {("b", k) for k in range(1, j + 1)} | {("l", q, j) for q in range(1, r + 1)}
    for c, suffix in enumerate(candidates):
        for s in range(len(suffix)):
            names.append(("c", c, s))
            vis[("c", c, s)] = all_p | {("c", c, q) for q in range(s + 1)}
    return names, vis


def _expected_depth(name, I):
    kind = name[0]
    if kind == "p":
        return name[1]
    if kind == "b":
        return I - 1 + name[1]
    if kind == "l":
        return I - 1 + name[1] + name[2]
    return I + name[2]


@pytest.mark.parametrize(
    "pending,levels,columns,candidates",
    [
        # steady state W=4, N=4, three pending rows, three candidates
        (
            [100, 101, 102],
            [[11, 12, 13], [21, 22, 23, 24], [31, 32, 33, 34]],
            range(0, 4),
            [(51, 52, 53), (61, 62, 63), (71, 72, 73)],
        ),
        # a shard owning columns 2..3 only
        (
            [100, 101],
            [[11, 12, 13], [21, 22, 23, 24], [31, 32, 33, 34]],
            range(2, 4),
            [(51, 52, 53)],
        ),
        # a shard owning no column (candidates only)
        ([100], [[11, 12, 13], [21, 22, 23, 24], [31, 32, 33, 34]], range(0, 0), [(51, 52, 53), (61, 52, 53)]),
        # warm-up: only level 0 exists
        ([100, 101], [[11, 12, 13, 14, 15, 16]], range(0, 7), [(51, 52, 53)]),
        # N=2 steady state, identical tokens in different branches
        ([5], [[5, 5]], range(0, 3), [(5,), (6,)]),
    ],
)
def test_layout_rows_mask_depths(pending, levels, columns, candidates):
    lay = build_layout(pending, levels, columns, candidates)
    names, vis = _visible_sets(pending, levels, columns, candidates)
    I = len(pending)
    assert lay.num_rows == len(names)
    row = {name: i for i, name in enumerate(names)}

    def token(name):
        kind = name[0]
        if kind == "p":
            return pending[name[1]]
        if kind == "b":
            return levels[0][name[1] - 1]
        if kind == "l":
            return levels[name[1]][name[2]]
        return candidates[name[1]][name[2]]

    assert lay.tokens == [token(n) for n in names]
    assert lay.depths == [_expected_depth(n, I) for n in names]
    mask = lay.local_mask()
    expected = np.zeros_like(mask)
    for n in names:
        for seen in vis[n]:
            expected[row[n], row[seen]] = True
    np.testing.assert_array_equal(mask, expected)

    # structural invariants, stated directly
    look = [i for i, n in enumerate(names) if n[0] in "bl"]
    cand = [i for i, n in enumerate(names) if n[0] == "c"]
    assert not mask[np.ix_(look, cand)].any(), "lookahead rows must not see candidate rows"
    assert not mask[np.ix_(cand, look)].any(), "candidate rows must not see lookahead rows"
    for c1 in range(len(candidates)):
        for c2 in range(len(candidates)):
            if c1 != c2:
                assert not mask[np.ix_(lay.cand_rows[c1], lay.cand_rows[c2])].any()
    assert mask[:, :I][:, -1][I - 1 :].all(), "every uncached row after x sees x"
    assert not np.triu(mask, 1).any(), "never attend to a later row"
    # positions: a row is one deeper than its parent
    for i, p in enumerate(lay.parents):
        assert lay.depths[i] == (0 if p < 0 else lay.depths[p] + 1)

    # kept rows: the ordinary row, the deepest row of every owned column, every candidate row
    deepest = len(levels) - 1
    if len(columns):
        if deepest == 0:
            z_names = [("p", I - 1) if j == 0 else ("b", j) for j in columns]
        else:
            z_names = [("l", deepest, j) for j in columns]
        assert lay.z_rows == [row[n] for n in z_names]
    else:
        assert lay.z_rows == []
    assert lay.cand_rows == [[row[("c", c, s)] for s in range(len(sfx))] for c, sfx in enumerate(candidates)]
    assert lay.keep == sorted({I - 1, *lay.z_rows, *cand})
    assert lay.ordinary_row == I - 1


def test_layout_warmup_z_row_of_column_zero_is_the_ordinary_row():
    lay = build_layout([3, 4], [[11, 12]], range(0, 3), [])
    assert lay.z_rows == [1, 2, 3]
    assert lay.keep == [1, 2, 3]
    assert lay.tokens == [3, 4, 11, 12]


def test_layout_same_position_rows_in_different_branches_are_isolated():
    # B[1] (token 11), candidate rows at depth 1: all at position cache_len + 1
    lay = build_layout([7], [[11], [21, 22]], range(0, 2), [(5, 6), (8, 9)])
    same = [i for i, d in enumerate(lay.depths) if d == 1]
    assert len(same) == 4
    m = lay.local_mask()
    for a in same:
        for b in same:
            assert m[a, b] == (a == b)


# ---------------------------------------------------------------------------
# verification walk


def test_walk_docstring_example():
    path = walk([(5, 6), (5, 8), (9, 1)], 5, lambda depth, c: {(1, 0): 6, (2, 0): 4}[depth, c])
    assert path == Path(emitted=[5, 6, 4], winner=0, hits=2)


def test_greedy_full_match_emits_n_tokens():
    # N = 4: R = 3-token candidates; full match publishes 4 tokens
    path = greedy_walk([(5, 6, 7)], 5, [[6, 7, 8]])
    assert path == Path([5, 6, 7, 8], 0, 3)


def test_greedy_partial_match():
    path = greedy_walk([(5, 6, 7)], 5, [[6, 9, 8]])
    assert path == Path([5, 6, 9], 0, 2)
    path = greedy_walk([(5, 6, 7)], 5, [[1, 9, 8]])
    assert path == Path([5, 1], 0, 1)


def test_greedy_no_match():
    path = greedy_walk([(5, 6, 7), (8, 6, 7)], 4, [[6, 7, 8], [6, 7, 8]])
    assert path == Path([4], None, 0)
    assert greedy_walk([], 3, []) == Path([3], None, 0)


def test_greedy_tie_goes_to_lowest_index():
    # both candidates match fully: lowest index wins, its rows give the outcomes
    path = greedy_walk([(5, 6), (5, 6), (9, 9)], 5, [[6, 1], [6, 2], [0, 0]])
    assert path == Path([5, 6, 1], 0, 2)
    # the higher index is the only survivor: it wins
    path = greedy_walk([(9, 9), (5, 6)], 5, [[0, 0], [6, 3]])
    assert path == Path([5, 6, 3], 1, 2)


def test_greedy_lower_candidate_drops_out_later():
    # 0 and 1 share the first token; the target picks 1's second token
    path = greedy_walk([(5, 6, 1), (5, 7, 2), (5, 7, 3)], 5, [[7, 0, 0], [7, 3, 4], [7, 3, 5]])
    assert path == Path([5, 7, 3, 5], 2, 3)


def test_walk_reads_outcomes_from_the_current_winner():
    calls = []

    def outcome(depth, c):
        calls.append((depth, c))
        return {(1, 1): 4, (2, 1): 8}[depth, c]

    path = walk([(2, 9), (3, 4), (3, 5)], 3, outcome)
    assert path == Path([3, 4, 8], 1, 2)
    assert calls == [(1, 1), (2, 1)]


def test_children_and_sharing_prefix():
    cands = [(5, 6, 1), (5, 7, 2), (5, 6, 3), (8, 6, 1)]
    assert children(cands, range(4), 0) == [5, 8]
    assert children(cands, [0, 1, 2], 1) == [6, 7]
    assert children(cands, [0, 2], 2) == [1, 3]
    assert sharing_prefix(cands, 0, 0) == [0, 1, 2, 3]
    assert sharing_prefix(cands, 0, 1) == [0, 1, 2]
    assert sharing_prefix(cands, 2, 2) == [0, 2]
    assert sharing_prefix(cands, 3, 1) == [3]
