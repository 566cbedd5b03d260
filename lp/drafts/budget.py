"""Draft budget: how many draft rows a step verifies, from the measured row cost t(Q).

Contract: plain Python, no torch, deterministic (every LP rank makes the same choice
from the same replicated state and the same curve). No timing happens here: the cost
curve is an argument (measured by ``lp.model.calibrate`` or given), so tests use literal curves.

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

The curve need not rise: a BLAS may run 2 or 3 rows slower than 4 or 8 (measured on a
2-core EPYC with MKL, SmolLM2 fp32: t(1..8) = 58, 95, 118, 84, 75, 78, 97, 81 ms).
``envelope`` turns t into the cost of the cheapest measured size at or above Q, and
``padded_rows`` names that size; one process pads its step up to it (the extra rows
are the next most likely nodes, else filler), so a step of 2 real rows costs t(5). A larger
size counts as cheaper only below 95% of t(Q) (``NOISE``): smaller bumps are the curve's
measurement noise:

    >>> bumpy = [(1, 58), (2, 95), (3, 118), (4, 84), (5, 75), (6, 78), (8, 81)]
    >>> envelope(bumpy)
    [(1, 58), (2, 75), (3, 75), (4, 75), (5, 75), (6, 78), (8, 81)]
    >>> padded_rows(bumpy, 2), padded_rows(bumpy, 6), padded_rows(bumpy, 9)
    (5, 6, 9)
    >>> noisy = [(8, 61.5), (9, 61.0), (10, 61.4), (12, 65.8), (16, 74.2)]
    >>> envelope(noisy) == noisy, padded_rows(noisy, 8)
    (True, 8)

On the smooth curve above the second row costs ~55% of a step, so a lone draft token
must be accepted with P > 0.55 to pay, while ten likely tokens (a long suffix match on
code) pay easily. On a GPU-like flat curve every node with P > 0 pays.

``AcceptanceModel`` estimates the acceptance of one draft token from the length m of
the suffix match it is predicted by (buckets 1, 2, 3, 4-7, 8-15, 16+; bucket 0 for
window/pool n-grams). A draft read after a match of m tokens predicts its token at
depth j (0-based) from a match of m + j tokens once the tokens before it are accepted,
so P(node at depth d) = share x rate(m) x rate(m + 1) x ... x rate(m + d - 1): the
longer a copy has held, the likelier it goes on (measured on HumanEval + ClassEval
outputs of SmolLM2: 0.26 at m = 1, 0.58 at 2, 0.70 at 3, ~0.8 at 4-7, ~0.9 at 8-15,
0.96 past 16, the priors below). Each bucket starts from its prior and is updated
online with what verification saw; the update reads only the published tokens, which
all ranks share.

A request's model starts from the priors and a 64-token chat answer ends before it has
learned much, so the rates can stay optimistic for a whole workload (chat, measured: bucket 2
accepted 0.35 against its prior 0.55). ``GainCalibration`` closes that loop across requests:
every drafting step adds the draft tokens the budget expected (the kept nodes' P, summed) and
the draft tokens verification accepted; ``factor()`` = realized / predicted over the recent
steps (decayed, a prior pseudo-count at 1.0, clamped), and the budget multiplies every node's
P by it (capped at 1) before pricing. Where drafts are accepted as predicted the factor stays
near 1; where they are not, fewer nodes pay and the step falls back to plain rows:

    >>> g = GainCalibration()
    >>> g.factor()
    1.0
    >>> for _ in range(40): g.observe(predicted=2.0, realized=0.5)
    >>> round(g.factor(), 2)
    0.32
    >>> steep = [(1, 0.02), (2, 0.03)]
    >>> best_k([0.9, 0.8], base=1, curve=steep), best_k([0.9, 0.8], base=1, curve=steep, gain=g.factor())
    (2, 0)

A factor that low would lock drafting out for good (only drafting steps are observed), so
every sequence-step that verifies no draft decays the evidence toward the prior
(``GainCalibration.idle``, a time constant of 100 such steps): after ~200 of them the
factor is back above 0.6 and the likelier node above pays again:

    >>> for _ in range(210): g.idle()
    >>> round(g.factor(), 2), best_k([0.9, 0.8], base=1, curve=steep, gain=g.factor())
    (0.61, 1)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# per-bucket prior acceptance of one draft token (bucket 0: window / pool n-grams)
PRIOR = (0.35, 0.25, 0.55, 0.65, 0.78, 0.88, 0.95)
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
        0.78
        >>> a.observe(5, tried=6, accepted=6); round(a.rate(5), 3)
        0.912
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


class GainCalibration:
    """Realized / predicted draft tokens over recent drafting steps (see module doc).

    ``weight``: the prior's pseudo-count of predicted tokens at a factor of 1.0; ``decay``:
    each observation multiplies the sums so far by it (the last ~1 / (1 - decay) drafting
    sequence-steps count); the factor is clamped to [``lo``, ``hi``]. ``idle_decay``: each
    sequence-step that verified no draft (``idle``) multiplies both sums by it, so the factor
    drifts back toward its prior 1.0 with a time constant of 1 / (1 - idle_decay) = 100
    non-drafting sequence-steps. Without it a factor that fell low enough that no node pays
    would never see another drafting step, and so never rise again. Plain arithmetic over
    counts every LP rank shares, so every rank holds the same factor."""

    def __init__(self, weight: float = 8.0, decay: float = 0.995, lo: float = 0.1, hi: float = 1.5,
                 idle_decay: float = 0.99):
        assert weight > 0 and 0 < decay <= 1 and 0 < idle_decay <= 1 and 0 < lo <= 1 <= hi
        self.weight, self.decay, self.idle_decay, self.lo, self.hi = weight, decay, idle_decay, lo, hi
        self.predicted = 0.0
        self.realized = 0.0

    def factor(self) -> float:
        f = (self.realized + self.weight) / (self.predicted + self.weight)
        return min(self.hi, max(self.lo, f))

    def observe(self, predicted: float, realized: float) -> None:
        assert predicted >= 0 and realized >= 0, (predicted, realized)
        self.predicted = self.predicted * self.decay + predicted
        self.realized = self.realized * self.decay + realized

    def idle(self) -> None:
        """A sequence-step that verified no draft: the evidence so far fades toward the prior
        (``idle_decay``), so after a stretch without drafts the budget tries drafting again."""
        self.predicted *= self.idle_decay
        self.realized *= self.idle_decay


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


# a larger step must measure at least this much cheaper than a smaller one to be taken for
# cheaper (``envelope``, ``padded_rows``): a curve's repeats differ by 1-3% (measured t(8) 61.5
# ms and t(9) 61.0 on a compiled SmolLM2 step), and a bump that small is noise, not a kernel
# change; pricing by it made every batched step look as cheap with a few drafts as without,
# and padding filled it to the noisy minimum (8 chat sequences: 13.5-16.7 rows a step where
# plain steps ran 8.8, 12% slower a step for ~10% more tokens)
NOISE = 0.05


def envelope(curve: Sequence[tuple[int, float]], margin: float = NOISE) -> list[tuple[int, float]]:
    """t(Q) -> the cost of a step padded to the cheapest measured size at or above Q (see
    ``padded_rows``): min over the measured Q' > Q of t(Q') where that is below (1 - ``margin``)
    x t(Q), else t(Q)."""
    out: list[tuple[int, float]] = []
    best = float("inf")  # min over the larger measured sizes
    for q, t in reversed(curve):
        out.append((q, best if best < (1.0 - margin) * t else t))
        best = min(best, t)
    return out[::-1]


def padded_rows(curve: Sequence[tuple[int, float]], rows: int, margin: float = NOISE) -> int:
    """The measured size Q' > rows of least cost when it is below (1 - ``margin``) x t(rows) (the
    smallest such on a tie); ``rows`` itself past the curve's end or when no larger size is
    cheaper by that much."""
    own = cost(curve, rows)
    best_q, best_t = rows, own
    for q, t in curve:
        if q > rows and t < best_t and t < (1.0 - margin) * own:
            best_q, best_t = q, t
    return best_q


def drafted_cost(curve: Sequence[tuple[int, float]], base: int, rows: int, pad: bool = True,
                 span: int = 16) -> float:
    """What a step of ``rows`` rows that verifies drafts is priced at, ``base`` of its rows
    running anyway. Padded (``pad``) to a cheaper measured size when one is cheaper beyond the
    noise (``envelope``); else t(rows), but never below t(base) + the curve's mean cost of a row
    over [base, base + ``span``] x (rows - base): within the noise a few more rows can measure as
    cheap as none (t(9) 61.0 ms < t(8) 61.5 on a compiled SmolLM2 step), and a draft of any P
    would then look free; over 16 rows the slope is the step's real one (~1.4 ms a row there).

        >>> noisy = [(8, 61.5), (9, 61.0), (10, 61.4), (12, 65.8), (16, 74.2), (24, 84.4)]
        >>> round(drafted_cost(noisy, 8, 9), 2), round(drafted_cost(noisy, 8, 12), 2)
        (62.93, 67.22)
        >>> bumpy = [(1, 58), (2, 95), (3, 118), (4, 84), (5, 75), (6, 78), (8, 81), (16, 98)]
        >>> drafted_cost(bumpy, 1, 2)   # a real drop: padded to 5 rows
        75.0
    """
    own = cost(curve, rows)
    if pad:
        padded = cost(envelope(curve), rows)
        if padded < own:
            return padded
    top = min(base + span, curve[-1][0]) if curve[-1][0] > base else base + span
    slope = max(0.0, (cost(curve, top) - cost(curve, base)) / (top - base))
    return max(own, cost(curve, base) + slope * (rows - base))


def best_k(
    probs: Sequence[float],
    base: int,
    curve: Sequence[tuple[int, float]] | None,
    extra_rows: int = 0,
    workers: int = 1,
    cap: int | None = None,
    plain: float | None = None,
    gain: float = 1.0,
) -> int:
    """How many of the nodes (``probs`` sorted by decreasing P) to verify.

    ``extra_rows``: rows that ride along only when k > 0 (the window under
    window_policy=with_candidates). ``workers``: LP splits the draft rows, a worker runs
    about k / workers of them. ``curve`` None: no cost model, take every node (up to cap).
    ``plain``: the cost of the step without drafts when it differs from t(base) (a padded
    step's envelope prices k >= 1; k = 0 runs unpadded). ``gain``: ``GainCalibration.factor()``,
    every P scaled by it (capped at 1)."""
    k_max = len(probs) if cap is None else min(len(probs), cap)
    if curve is None:
        return k_max
    best, best_rate = 0, 1.0 / (cost(curve, base) if plain is None else plain)
    tokens = 1.0
    for k in range(1, k_max + 1):
        tokens += min(1.0, gain * probs[k - 1])
        rows = base + extra_rows + -(-k // workers)
        rate = tokens / cost(curve, rows)
        if rate > best_rate:
            best, best_rate = k, rate
    return best
