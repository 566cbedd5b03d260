"""Jacobi lookahead window: W columns x (N-1) trajectory levels, as token ids.

Contract: plain Python, no torch. Coordinates follow seeds/000 §0x01A/§0x03B.

Let ``x`` be the current token at logical position ``p`` and R = N - 1. The
*base stripe* is ``B = [x] + levels[0]``: B[j] sits at position p + j. Level
r >= 1, column j sits at position p + r + j and continues column j's path
``B[0..j], levels[1][j], ..., levels[r][j]``. The deepest level's row at column j
predicts position p + R + j (or, while only level 0 exists, B[j] predicts p + j + 1).
That prediction ``z[j]`` is the new trajectory value of column j.

Steady state keeps ragged sizes ``[W-1, W, ..., W]``: column 0 of level 0 is the
live token itself. Warm-up starts from one level of ``W + R - 2`` seed tokens and
grows one level per step (sizes [6] -> [5, 6] -> [4, 5, 5] for W=5, N=4) so that
all W columns are extractable once warm. Every step advances exactly one column
(the paper's "always forward one"), whatever the number of accepted tokens.

Once warm, each step harvests W n-grams (seeds/000 §0x03B), column j giving
``(B[j], levels[1][j], ..., levels[R-1][j], z[j])``. With N=4, W=5::

    x=10, levels=[[11,12,13,14],[21..25],[31..35]], z=[41..45]
    -> 10:(21,31,41) 11:(22,32,42) 12:(23,33,43) 13:(24,34,44) 14:(25,35,45)
"""

from __future__ import annotations

from collections.abc import Sequence


class Window:
    def __init__(self, W: int, N: int, seed_tokens: Sequence[int]):
        assert W >= 1 and N >= 2
        self.W = W
        self.N = N
        self.R = N - 1
        size0 = W + self.R - 2
        assert len(seed_tokens) == size0, (len(seed_tokens), size0)
        self.levels: list[list[int]] = [list(seed_tokens)]

    @staticmethod
    def seed_size(W: int, N: int) -> int:
        return W + N - 3

    @property
    def warm(self) -> bool:
        return len(self.levels) == self.R

    @property
    def num_columns(self) -> int:
        """Columns producing a new trajectory value this step (W once warm)."""
        return len(self.levels[0]) + 1

    @property
    def depth(self) -> int:
        """Number of levels below the base stripe that currently exist."""
        return len(self.levels) - 1

    def sizes(self) -> list[int]:
        return [len(level) for level in self.levels]

    def update(self, key: int, z: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """Advance one column with the new trajectory values ``z`` (one per column).

        ``key`` is the current token x that formed B[0] this step. Returns the harvested
        n-grams as (key, suffix) pairs (none during warm-up).
        """
        z = list(z)
        assert len(z) == self.num_columns, (len(z), self.num_columns)
        ngrams: list[tuple[int, tuple[int, ...]]] = []
        if self.warm:
            base = [key] + self.levels[0]
            for j in range(self.num_columns):
                suffix = tuple(level[j] for level in self.levels[1:]) + (z[j],)
                ngrams.append((base[j], suffix))
            self.levels = self.levels[1:] + [z]
            self.levels[0] = self.levels[0][1:]
        else:
            self.levels = [level[1:] for level in self.levels] + [z[1:]]
        return ngrams

    def fingerprint(self) -> int:
        return hash(tuple(tuple(level) for level in self.levels)) & 0x7FFFFFFFFFFF
