"""lp.lookahead.shard.plan_shards: validity on a grid of small cases and minimality against brute force."""

from __future__ import annotations

import itertools

import lp.lookahead.shard
from lp.lookahead.shard import Shard, column_rows, plan_shards


def _check_valid(plan, W, P, C, D, G, R):
    assert len(plan) == W
    # columns: contiguous ranges that tile range(C) in worker order
    start = 0
    for s in plan:
        assert isinstance(s, Shard)
        assert s.columns.step == 1 and s.columns.start == start
        assert s.columns.stop >= s.columns.start
        start = s.columns.stop
    assert start == C
    # candidates: a partition of range(G)
    owned = sorted(c for s in plan for c in s.candidates)
    assert owned == list(range(G))
    # the row count is what the worker actually runs
    for s in plan:
        assert s.rows == P + column_rows(s.columns, D) + R * len(s.candidates)


def _compositions(n, k):
    if k == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _compositions(n - first, k - 1):
            yield (first, *rest)


def _brute_force_min_load(W, P, C, D, G, R):
    """Smallest max-rows over every contiguous split of the columns and every candidate count split."""
    best = None
    for comp in _compositions(C, W):
        loads, start = [], 0
        for size in comp:
            loads.append(P + column_rows(range(start, start + size), D))
            start += size
        for counts in itertools.product(range(G + 1), repeat=W):
            if sum(counts) != G:
                continue
            m = max(l + R * n for l, n in zip(loads, counts))
            best = m if best is None else min(best, m)
    return best


def test_column_rows():
    assert column_rows(range(0, 0), 3) == 0
    assert column_rows(range(0, 1), 0) == 0  # column 0 alone in warm-up is the ordinary row
    assert column_rows(range(0, 1), 2) == 2
    assert column_rows(range(3, 5), 3) == 4 + 6
    assert column_rows(range(0, 5), 3) == 4 + 15


def test_plan_single_worker_takes_everything():
    (s,) = plan_shards(1, 2, 5, 2, 3, 3)
    assert s.columns == range(0, 5) and s.candidates == [0, 1, 2]
    assert s.rows == 2 + (4 + 10) + 9


def test_plan_docstring_example():
    plan = plan_shards(2, 1, 5, 3, 5, 4)
    _check_valid(plan, 2, 1, 5, 3, 5, 4)
    assert [(s.columns, s.candidates, s.rows) for s in plan] == [
        (range(0, 5), [], 20),
        (range(5, 5), [0, 1, 2, 3, 4], 21),
    ]
    plan = plan_shards(3, 1, 2, 2, 1, 3)
    _check_valid(plan, 3, 1, 2, 2, 1, 3)
    assert [(s.columns, s.candidates, s.rows) for s in plan] == [
        (range(0, 1), [], 3),
        (range(1, 2), [], 4),
        (range(2, 2), [0], 4),
    ]


def test_plan_docstring_example_is_balanced():
    plan = plan_shards(2, 1, 5, 3, 5, 4)
    assert max(s.rows for s in plan) == _brute_force_min_load(2, 1, 5, 3, 5, 4) == 21


def test_plan_fewer_columns_than_workers():
    plan = plan_shards(4, 1, 2, 0, 0, 3)
    _check_valid(plan, 4, 1, 2, 0, 0, 3)
    assert max(s.rows for s in plan) == 2
    # workers left with neither columns nor candidates still run the pending rows
    idle = [s for s in plan if len(s.columns) == 0 and not s.candidates]
    assert idle, plan
    assert all(s.rows == 1 for s in idle)


def test_plan_candidates_not_divisible_by_workers():
    plan = plan_shards(3, 1, 0, 0, 5, 2)
    _check_valid(plan, 3, 1, 0, 0, 5, 2)
    assert sorted(len(s.candidates) for s in plan) == [1, 2, 2]
    assert max(s.rows for s in plan) == 1 + 2 * 2


def test_plan_worker_with_nothing():
    plan = plan_shards(3, 2, 1, 0, 0, 1)
    _check_valid(plan, 3, 2, 1, 0, 0, 1)
    assert [s.rows for s in plan] == [2, 2, 2]
    assert sum(1 for s in plan if len(s.columns) == 0 and not s.candidates) == 2


def test_plan_is_the_same_in_another_process():
    """Every rank computes the plan alone: another interpreter, with another hash seed
    (set and dict orders differ), must reach the very same plans."""
    import os
    import subprocess
    import sys

    args = [(3, 2, 7, 2, 5, 3), (2, 1, 5, 3, 5, 4), (4, 3, 2, 1, 7, 2), (3, 1, 0, 0, 5, 2)]
    # lp.lookahead.shard is plain Python: loaded from its file alone (no torch import), it starts in ~0.1 s
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('shard', sys.argv[1]); "
            "m = u.module_from_spec(s); sys.modules['shard'] = m; s.loader.exec_module(m); "
            "print(repr([m.plan_shards(*a) for a in eval(sys.argv[2])]))")
    env = dict(os.environ, PYTHONHASHSEED=str(1 + int(os.environ.get("PYTHONHASHSEED", "0") or 0)))
    out = subprocess.run([sys.executable, "-c", code, lp.lookahead.shard.__file__, repr(args)], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == repr([plan_shards(*a) for a in args])


GRID = [
    (W, P, C, D, G, R)
    for W in (1, 2, 3)
    for P in (1, 2)
    for C in range(0, 6)
    for D in range(0, 4)
    for G in range(0, 5)
    for R in (1, 2, 3)
]


def test_plan_valid_on_grid():
    for case in GRID:
        _check_valid(plan_shards(*case), *case)


def test_plan_minimal_against_brute_force():
    bad = []
    for case in GRID:
        got = max(s.rows for s in plan_shards(*case))
        best = _brute_force_min_load(*case)
        assert got >= best, (case, got, best)  # brute force is a lower bound of any valid plan
        if got != best:
            bad.append((case, got, best))
    assert not bad, f"{len(bad)} of {len(GRID)} plans are not minimal, e.g. (W,P,C,D,G,R), got, best: {bad[:5]}"


def test_plan_minimal_smallest_counterexample():
    # 2 workers, 1 pending row, 2 columns at depth 1, two 3-token candidates:
    # columns [0,1) + 1 candidate = 1+1+3 = 5 rows; [1,2) + 1 candidate = 1+2+3 = 6 rows.
    plan = plan_shards(2, 1, 2, 1, 2, 3)
    assert max(s.rows for s in plan) == 6, plan
