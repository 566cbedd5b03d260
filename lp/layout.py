"""Row layout of one packed lookahead forward, as a forest of token rows.

Contract: plain Python over token ids (numpy only to materialize the mask). Every
uncached row has exactly one *parent* row (or none, for the first pending row):
a row attends to the whole cached prefix, to its ancestors and to itself, and to
nothing else. Its logical position is ``cache_len + depth``. This single rule
gives all three branches of seeds/000 §0x04A:

* pending rows ``pending[0..I-1]`` (tokens not yet in the cache; the last one is
  the current token x, the ordinary row) form a causal chain;
* the lookahead branch: base stripe ``B[1..]`` = level 0 continues the chain after
  x; level r >= 1 at column j hangs below ``B[j]`` / level r-1 at column j;
* the verification branch: candidate c's suffix is its own chain below x.

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


@dataclass(frozen=True)
class Layout:
    tokens: list[int]
    parents: list[int]  # -1: root (sees only the cached prefix)
    depths: list[int]  # position offset from the cache length
    keep: list[int]  # rows whose logits are needed, ascending
    num_pending: int
    z_rows: list[int]  # row of each owned column's deepest level, in column order
    cand_rows: list[list[int]]  # rows of candidate c's suffix

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    @property
    def ordinary_row(self) -> int:
        return self.num_pending - 1

    def local_mask(self) -> np.ndarray:
        """[Q, Q] bool: row i may attend row k (beyond the always-visible cache)."""
        return _ancestor_mask(tuple(self.parents))


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
    tokens = list(pending)
    parents = list(range(-1, len(pending) - 1))
    depths = list(range(len(pending)))
    x_row = len(pending) - 1
    keep = [x_row]

    num_columns = len(levels[0]) + 1
    assert columns.step == 1 and 0 <= columns.start and columns.stop <= num_columns
    z_rows: list[int] = []
    if len(columns) > 0:
        # base stripe B[1..stop-1]: level 0 up to the last owned column
        base_rows = [x_row]
        for j in range(1, columns.stop):
            parents.append(base_rows[-1])
            depths.append(depths[x_row] + j)
            tokens.append(levels[0][j - 1])
            base_rows.append(len(tokens) - 1)
        deepest = base_rows
        for r in range(1, len(levels)):
            above = deepest
            deepest = {}
            for j in columns:
                parent = above[j]
                parents.append(parent)
                depths.append(depths[parent] + 1)
                tokens.append(levels[r][j])
                deepest[j] = len(tokens) - 1
        z_rows = [deepest[j] for j in columns]

    cand_rows: list[list[int]] = []
    for suffix in candidates:
        rows = []
        parent = x_row
        for token in suffix:
            parents.append(parent)
            depths.append(depths[parent] + 1)
            tokens.append(token)
            parent = len(tokens) - 1
            rows.append(parent)
        cand_rows.append(rows)

    keep = sorted(set(keep + z_rows + [r for rows in cand_rows for r in rows]))
    return Layout(tokens, parents, depths, keep, len(pending), z_rows, cand_rows)


@lru_cache(maxsize=256)
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
