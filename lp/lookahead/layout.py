"""Row layout of one packed lookahead forward, as a forest of token rows.

Contract: plain Python over token ids (numpy only to materialize the mask). The
structure of a step (parents, depths, kept rows) is a ``Skeleton`` cached by shape;
``build_layout`` only fills in the tokens. Every
uncached row has exactly one *parent* row (or none, for the first pending row):
a row attends to the whole cached prefix, to its ancestors and to itself, and to
nothing else. Its logical position is ``cache_len + depth``. This single rule
gives all three branches of seeds/000 §0x04A:

* pending rows ``pending[0..I-1]`` (tokens not yet in the cache; the last one is
  the current token x, the ordinary row) form a causal chain;
* the lookahead branch: base stripe ``B[1..]`` = level 0 continues the chain after
  x; level r >= 1 at column j hangs below ``B[j]`` / level r-1 at column j;
* the verification branch: candidate c's suffix is its own chain below x
  (``build_layout``), or, with ``build_tree_layout``, the candidates are merged into a
  token trie (lp.lookahead.tree) and each distinct trie node is one row below its parent node
  (children of the trie root hang below x): rows = distinct prefixes, not the sum of
  the candidates' lengths.

Lookahead and verification never see each other, candidates never see each
other, and two rows at the same position in different branches stay isolated.

Row order: pending, base stripe, deeper levels level-major, candidates. Only the
rows in ``keep`` go through the LM head: the ordinary row, the deepest-level row
of every owned column, and every candidate row.

Example (I=1, x=7, levels=[[11],[21,22]], columns 0..1, candidates [(5,6)]):
rows = [7, 11, 21, 22, 5, 6], parents = [-1, 0, 0, 1, 0, 4],
depths = [0, 1, 1, 2, 1, 2], keep = [0, 2, 3, 4, 5].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True, eq=False)
class Skeleton:
    """Everything about a step's rows except their tokens; cached by shape, so a step of a
    shape seen before only writes tokens (runners key their device tensors on it)."""

    parents: tuple[int, ...]  # -1: root (sees only the cached prefix)
    depths: tuple[int, ...]  # position offset from the cache length
    keep: tuple[int, ...]  # rows whose logits are needed, ascending
    num_pending: int
    z_rows: tuple[int, ...]  # row of each owned column's deepest level, in column order
    cand_rows: tuple[tuple[int, ...], ...]  # rows of candidate c's suffix (chain layouts)
    columns: range
    num_rows: int
    tree_rows: tuple[int, ...] = ()  # row of each trie node (tree layouts), in trie order

    def local_mask(self) -> np.ndarray:
        """[Q, Q] bool: row i may attend row k (beyond the always-visible cache)."""
        return _ancestor_mask(self.parents)


@dataclass(frozen=True, eq=False)
class Layout:
    tokens: list[int]
    skeleton: Skeleton
    paths: tuple[tuple[int, ...], ...] | None = None  # tree layouts: trie nodes along candidate c

    @property
    def parents(self) -> list[int]:
        return list(self.skeleton.parents)

    @property
    def depths(self) -> list[int]:
        return list(self.skeleton.depths)

    @property
    def keep(self) -> list[int]:
        return list(self.skeleton.keep)

    @property
    def z_rows(self) -> list[int]:
        return list(self.skeleton.z_rows)

    @property
    def cand_rows(self) -> list[list[int]]:
        """Rows along candidate c's suffix (shared rows for shared prefixes in a tree layout)."""
        if self.paths is not None:
            tree = self.skeleton.tree_rows
            return [[tree[n] for n in path] for path in self.paths]
        return [list(rows) for rows in self.skeleton.cand_rows]

    @property
    def num_pending(self) -> int:
        return self.skeleton.num_pending

    @property
    def num_rows(self) -> int:
        return self.skeleton.num_rows

    @property
    def ordinary_row(self) -> int:
        return self.skeleton.num_pending - 1

    def local_mask(self) -> np.ndarray:
        return self.skeleton.local_mask()


def build_layout(
    pending: Sequence[int],
    levels: Sequence[Sequence[int]],
    columns: range,
    candidates: Sequence[Sequence[int]],
) -> Layout:
    """Compile the rows for ``pending`` + window ``columns`` + ``candidates``.

    ``levels`` is the window's ragged state (level 0 one shorter than the others);
    ``columns`` a contiguous range of the window's columns owned by this worker.
    """
    assert len(pending) >= 1
    sk = skeleton(
        len(pending), tuple(len(level) for level in levels), columns.start, columns.stop,
        tuple(len(c) for c in candidates),
    )
    tokens = list(pending)
    if len(columns) > 0:
        tokens += levels[0][: columns.stop - 1]  # base stripe B[1..stop-1]
        for level in levels[1:]:
            tokens += level[columns.start : columns.stop]
    for suffix in candidates:
        tokens += suffix
    assert len(tokens) == sk.num_rows
    return Layout(tokens, sk)


def build_tree_layout(
    pending: Sequence[int],
    levels: Sequence[Sequence[int]],
    columns: range,
    candidates: Sequence[Sequence[int]],
) -> Layout:
    """Like ``build_layout``, with the candidates merged into one token trie (lp.lookahead.tree):
    one row per distinct nonempty prefix; the skeleton is cached by the trie's parent tuple.

        >>> lay = build_tree_layout([7], [], range(0), [(5, 6), (5, 8), (9,)])
        >>> lay.tokens, lay.parents, lay.cand_rows
        ([7, 5, 6, 8, 9], [-1, 0, 1, 1, 0], [[1, 2], [1, 3], [4]])
    """
    from lp.lookahead.tree import merge_trie

    assert len(pending) >= 1
    trie = merge_trie(candidates)
    level_sizes = tuple(len(level) for level in levels) if levels else (0,)
    sk = skeleton(len(pending), level_sizes, columns.start, columns.stop, (), tuple(trie.parents))
    tokens = list(pending)
    if len(columns) > 0:
        tokens += levels[0][: columns.stop - 1]
        for level in levels[1:]:
            tokens += level[columns.start : columns.stop]
    tokens += trie.tokens
    assert len(tokens) == sk.num_rows
    return Layout(tokens, sk, tuple(tuple(p) for p in trie.paths))


def chain_layout(tokens: Sequence[int]) -> Layout:
    """One causal chain of rows, every row through the LM head (prefill-like; for t(Q) curves)."""
    q = len(tokens)
    sk = Skeleton(tuple(range(-1, q - 1)), tuple(range(q)), tuple(range(q)), q, (), (), range(0), q)
    return Layout(list(tokens), sk)


@lru_cache(maxsize=4096)
def skeleton(
    num_pending: int,
    level_sizes: tuple[int, ...],
    col_start: int,
    col_stop: int,
    cand_lens: tuple[int, ...],
    tree_parents: tuple[int, ...] = (),
) -> Skeleton:
    columns = range(col_start, col_stop)
    parents = list(range(-1, num_pending - 1))
    depths = list(range(num_pending))
    x_row = num_pending - 1
    num_columns = level_sizes[0] + 1
    assert 0 <= col_start <= col_stop <= num_columns
    z_rows: list[int] = []
    if len(columns) > 0:
        base_rows = [x_row]  # column 0 of the base stripe is x itself
        for j in range(1, col_stop):
            parents.append(base_rows[-1])
            depths.append(depths[x_row] + j)
            base_rows.append(len(parents) - 1)
        deepest = base_rows
        for r in range(1, len(level_sizes)):
            above, deepest = deepest, {}
            for j in columns:
                parents.append(above[j])
                depths.append(depths[above[j]] + 1)
                deepest[j] = len(parents) - 1
        z_rows = [deepest[j] for j in columns]
    cand_rows: list[tuple[int, ...]] = []
    for n in cand_lens:
        rows = []
        parent = x_row
        for _ in range(n):
            parents.append(parent)
            depths.append(depths[parent] + 1)
            parent = len(parents) - 1
            rows.append(parent)
        cand_rows.append(tuple(rows))
    tree_rows: list[int] = []
    for parent in tree_parents:  # trie nodes in preorder: a parent comes before its children
        row = x_row if parent < 0 else tree_rows[parent]
        parents.append(row)
        depths.append(depths[row] + 1)
        tree_rows.append(len(parents) - 1)
    keep = sorted({x_row, *z_rows, *(r for rows in cand_rows for r in rows), *tree_rows})
    return Skeleton(tuple(parents), tuple(depths), tuple(keep), num_pending, tuple(z_rows), tuple(cand_rows),
                    columns, len(parents), tuple(tree_rows))


@lru_cache(maxsize=4096)
def _ancestor_mask(parents: tuple[int, ...]) -> np.ndarray:
    q = len(parents)
    mask = np.zeros((q, q), dtype=bool)
    for i, parent in enumerate(parents):
        assert parent < i
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    mask.flags.writeable = False
    return mask
