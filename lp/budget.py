"""Draft budget: how many draft rows a step verifies, from the measured row cost t(Q).

Contract: plain Python, no torch, deterministic (every LP rank makes the same choice
from the same replicated state and the same curve). No timing happens here: the cost
curve is an argument (measured by ``lp.calibrate`` or given), so tests use literal curves.

A step that verifies trie nodes n_1..n_k (an ancestor-closed set) publishes on average
``1 + sum_i P(n_i)`` tokens, where P(n) is the probability that the target accepts the
whole path to n. It costs ``t(base + k)`` (``base``: the pending rows, plus the window
rows that ride along only when something is verified). The budget takes the nodes by
decreasing P (parents never rank below their children, ties go to the shallower node)
and keeps the k that maximizes tokens per second:

    >>> curve = [(1, 0.055), (2, 0.085), (16, 0.130), (32, 0.184)]
    >>> best_k([0.9, 0.8, 0.7, 0.6, 0.1, 0.05], base=1, curve=curve)
    4
    >>> best_k([0.3, 0.1], base=1, curve=curve)    # 1.4 tokens / 85 ms < 1 / 55 ms
    0

On this curve the second row costs ~55% of a step, so a lone draft token must be
accepted with P > 0.55 to pay, while ten likely tokens (a long suffix match on code)
pay easily. On a GPU-like flat curve every node with P > 0 pays.

``AcceptanceModel`` estimates the per-token acceptance of a draft from its source:
suffix-matched drafts by the length m of the match they were read after (buckets
1, 2, 3, 4-7, 8-15, 16+), window/pool n-grams as bucket 0. Each bucket starts from a
prior and is updated online with what verification saw (tokens tried, tokens
accepted); the update reads only the published tokens, which all ranks share.
P(node at depth d of a draft) = freq * c^d, with c the bucket's estimate and freq the
share of earlier occurrences that continue with the draft.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# per-bucket prior acceptance of one draft token (bucket 0: window / pool n-grams)
PRIOR = (0.35, 0.3, 0.4, 0.5, 0.6, 0.75, 0.85)
PRIOR_WEIGHT = 4.0  # the prior counts as this many observed tokens


def bucket(match_len: int) -> int:
    """0: n-gram pool; 1, 2, 3; 4: m in 4..7; 5: 8..15; 6: 16+."""
    if match_len <= 3:
        return max(match_len, 0)
    if match_len < 8:
        return 4
    if match_len < 16:
        return 5
    return 6


class AcceptanceModel:
    """Online per-bucket estimate of one draft token's acceptance probability.

        >>> a = AcceptanceModel()
        >>> round(a.rate(5), 3)
        0.6
        >>> a.observe(5, tried=6, accepted=6); round(a.rate(5), 3)
        0.84
    """

    def __init__(self, prior: Sequence[float] = PRIOR, weight: float = PRIOR_WEIGHT):
        self.prior = tuple(prior)
        self.weight = weight
        self.tried = [0] * len(self.prior)
        self.accepted = [0] * len(self.prior)

    def rate(self, match_len: int) -> float:
        b = bucket(match_len)
        return (self.accepted[b] + self.weight * self.prior[b]) / (self.tried[b] + self.weight)

    def observe(self, match_len: int, tried: int, accepted: int) -> None:
        b = bucket(match_len)
        self.tried[b] += tried
        self.accepted[b] += accepted


def cost(curve: Sequence[tuple[int, float]], q: int) -> float:
    """t(q) by linear interpolation of ``curve`` (ascending Q); linear extrapolation past
    its ends (the last two points' slope; below the first point, its value)."""
    qs = [c[0] for c in curve]
    if q <= qs[0]:
        return curve[0][1]
    i = bisect.bisect_left(qs, q)
    if i == len(qs):
        (q0, t0), (q1, t1) = curve[-2], curve[-1]
    else:
        (q0, t0), (q1, t1) = curve[i - 1], curve[i]
    return t0 + (t1 - t0) * (q - q0) / (q1 - q0)


def best_k(
    probs: Sequence[float],
    base: int,
    curve: Sequence[tuple[int, float]] | None,
    extra_rows: int = 0,
    workers: int = 1,
    cap: int | None = None,
) -> int:
    """How many of the nodes (``probs`` sorted by decreasing P) to verify.

    ``extra_rows``: rows that ride along only when k > 0 (the window under
    window_policy=with_candidates). ``workers``: LP splits the draft rows, a worker runs
    about k / workers of them. ``curve`` None: no cost model, take every node (up to cap)."""
    k_max = len(probs) if cap is None else min(len(probs), cap)
    if curve is None:
        return k_max
    best, best_rate = 0, 1.0 / cost(curve, base)
    gain = 1.0
    for k in range(1, k_max + 1):
        gain += probs[k - 1]
        rows = base + extra_rows + -(-k // workers)
        rate = gain / cost(curve, rows)
        if rate > best_rate:
            best, best_rate = k, rate
    return best
