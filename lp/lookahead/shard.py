"""Shard plan of Lookahead Parallelism: which window columns and candidates each worker runs.

Contract: plain Python, deterministic, so every rank computes the same plan from
the same (replicated) state without communicating.

Costs, in packed rows: every worker runs the ``num_pending`` uncached rows. A
worker owning the contiguous columns [a, b) runs the base stripe up to column
b - 1 (b - 1 rows: column 0 is the current token itself) plus ``depth`` deeper
rows per owned column. Each candidate costs R rows. The plan minimizes the
largest per-worker row count: it finds the smallest load L for which some split
of the columns into contiguous ranges leaves room for every candidate, then
hands each candidate to the worker with the most room. W smaller than the worker count, G not divisible
by it and workers with nothing but the pending rows are all valid plans.

    >>> [(s.columns, s.candidates, s.rows) for s in plan_shards(2, 1, 5, 3, 5, 4)]
    [(range(0, 5), [], 20), (range(5, 5), [0, 1, 2, 3, 4], 21)]
    >>> [(s.columns, s.candidates, s.rows) for s in plan_shards(3, 1, 2, 2, 1, 3)]
    [(range(0, 1), [], 3), (range(1, 2), [], 4), (range(2, 2), [0], 4)]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Shard:
    columns: range
    candidates: list[int]
    rows: int


def column_rows(columns: range, depth: int) -> int:
    if len(columns) == 0:
        return 0
    return (columns.stop - 1) + len(columns) * depth


@lru_cache(maxsize=1024)
def plan_shards(
    num_workers: int, num_pending: int, num_columns: int, depth: int, num_candidates: int, R: int
) -> tuple[Shard, ...]:
    assert num_workers >= 1 and num_pending >= 1 and num_columns >= 0 and R >= 1
    args = (num_workers, num_pending, num_columns, depth, num_candidates, R)
    lo, hi = num_pending, num_pending + column_rows(range(num_columns), depth) + num_candidates * R
    best = _try_load(hi, *args)
    assert best is not None  # one worker can always take everything
    while lo < hi:  # feasibility is monotone in the load
        mid = (lo + hi) // 2
        plan = _try_load(mid, *args)
        if plan is None:
            lo = mid + 1
        else:
            best, hi = plan, mid
    return best


def _try_load(load, num_workers, num_pending, num_columns, depth, num_candidates, R):
    """A plan with every worker at most ``load`` rows, or None.

    Column split points are chosen (dynamic programming over workers x columns) to
    maximize the candidates that fit in the rooms left; candidates then go one by one
    to the worker with the most room.
    """
    budget = load - num_pending
    if budget < 0:
        return None
    neg = -1
    # best[k][j]: most candidate slots when workers < k cover columns [0, j)
    best = [[neg] * (num_columns + 1) for _ in range(num_workers + 1)]
    choice = [[0] * (num_columns + 1) for _ in range(num_workers + 1)]
    best[0][0] = 0
    for k in range(num_workers):
        for j in range(num_columns + 1):
            if best[k][j] == neg:
                continue
            for stop in range(j, num_columns + 1):
                cost = column_rows(range(j, stop), depth)
                if cost > budget:
                    break
                slots = best[k][j] + (budget - cost) // R
                if slots >= best[k + 1][stop]:  # ties: earlier workers take the columns
                    best[k + 1][stop] = slots
                    choice[k + 1][stop] = j
    if best[num_workers][num_columns] < num_candidates:
        return None
    columns = [range(0)] * num_workers
    stop = num_columns
    for k in range(num_workers, 0, -1):
        start = choice[k][stop]
        columns[k - 1] = range(start, stop)
        stop = start
    room = [budget - column_rows(c, depth) for c in columns]
    cands: list[list[int]] = [[] for _ in range(num_workers)]
    for c in range(num_candidates):
        k = max(range(num_workers), key=lambda i: (room[i], -i))
        assert room[k] >= R
        cands[k].append(c)
        room[k] -= R
    return tuple(
        Shard(columns[k], cands[k], num_pending + column_rows(columns[k], depth) + R * len(cands[k]))
        for k in range(num_workers)
    )


# ---------------------------------------------------------------------------
# draft trees


@lru_cache(maxsize=1024)
def plan_tree_shards(
    num_workers: int, num_pending: int, num_columns: int, depth: int, candidates: tuple[tuple[int, ...], ...]
) -> tuple[Shard, ...]:
    """Shards for a step whose candidates form one token trie (lp.lookahead.tree): the trie is split
    by the subtrees below x (candidates grouped by first token, so no trie node is run
    twice and every node's children sit on the same worker), balanced by rows.

    Columns are split as by ``plan_shards`` (no candidates); then subtrees, largest first,
    go to the worker with the fewest rows (lowest rank on ties). A worker's candidates
    keep their global order.

        >>> [(s.columns, s.candidates, s.rows) for s in plan_tree_shards(2, 1, 0, 0, ((5, 6), (5, 7), (9,)))]
        [(range(0, 0), [0, 1], 4), (range(0, 0), [2], 2)]
        >>> [(s.candidates, s.rows) for s in plan_tree_shards(1, 1, 0, 0, ((5, 6), (5, 7), (9,)))]
        [([0, 1, 2], 5)]
    """
    cols = plan_shards(num_workers, num_pending, num_columns, depth, 0, 1)
    groups: dict[int, list[int]] = {}
    for c, cand in enumerate(candidates):
        if cand:
            groups.setdefault(cand[0], []).append(c)
    sizes = {}
    for first, members in groups.items():
        sizes[first] = len({tuple(candidates[c][:i]) for c in members for i in range(1, len(candidates[c]) + 1)})
    rows = [s.rows for s in cols]
    owned: list[list[int]] = [[] for _ in range(num_workers)]
    for first in sorted(groups, key=lambda f: (-sizes[f], groups[f][0])):
        k = min(range(num_workers), key=lambda i: (rows[i], i))
        owned[k] += groups[first]
        rows[k] += sizes[first]
    return tuple(Shard(cols[k].columns, sorted(owned[k]), rows[k]) for k in range(num_workers))
