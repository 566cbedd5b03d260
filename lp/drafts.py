"""The step's draft tree: candidates from every source, scored, merged, cut to a budget.

Contract: plain Python over token ids, no torch, deterministic. A ``Scored`` draft is a
candidate continuation of the current token x with what predicts its acceptance (the
match length it was read after, the share of occurrences that continue with it).
Sources:

* the suffix index over prompt + output (lp.suffix.SuffixIndex): continuations after
  the longest earlier occurrences of the current suffix, of a length that grows with
  the match length, several per step ranked by frequency;
* an optional cross-request ``DraftStore`` (lp.suffix) over earlier outputs;
* the n-gram pool keyed by x (the Jacobi window's trajectories, and the prompt's
  n-grams when the prompt pool is on), match length 0.

``select_tree`` merges them into a trie (lp.tree), gives every node the probability
that its whole path is accepted (the best over the drafts through it, lp.budget), and
keeps the nodes the budget pays for; the result is the drafts cut to the kept nodes
(a draft that became a prefix of another kept one is dropped):

    >>> from lp.budget import AcceptanceModel
    >>> drafts = [Scored((5, 6, 7, 8), 6, 1.0), Scored((5, 9), 1, 0.5), Scored((4,), 0, 1.0)]
    >>> select_tree(drafts, AcceptanceModel(), base=1, curve=None, cap=5)
    [(5, 6, 7, 8), (4,)]
    >>> select_tree(drafts, AcceptanceModel(), base=1, curve=None, cap=3)
    [(5, 6), (4,)]
    >>> steep = [(1, 0.055), (2, 0.085), (16, 0.130)]
    >>> select_tree(drafts, AcceptanceModel(), base=1, curve=steep, cap=16)
    [(5, 6, 7, 8), (4,)]
    >>> select_tree([Scored((5, 9), 1, 0.5)], AcceptanceModel(), base=1, curve=steep, cap=16)
    []

With the priors, node P is 0.6, 0.36, 0.22, 0.13 along (5, 6, 7, 8) (m=6: 0.6 per
token), 0.35 for the pool's (4,), 0.045 for (5, 9): on the steep CPU curve the five
likely nodes pay (2.66 tokens expected for t(6) = 98 ms against 1 for 55 ms), a lone
unlikely draft does not (a plain one-row step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lp.budget import AcceptanceModel, best_k
from lp.tree import merge_trie


@dataclass(frozen=True)
class Scored:
    tokens: tuple[int, ...]
    match_len: int  # 0: n-gram pool
    freq: float  # share of the matched occurrences continuing with these tokens (1.0: unknown)


def suffix_drafts(index, store, tokens: Sequence[int], max_len: int, max_drafts: int, alpha: float,
                  context: int = 32) -> list[Scored]:
    """Drafts from the request's suffix index and the cross-request store (if any)."""
    out = [_score(d) for d in index.draft(max_len, max_drafts, alpha=alpha, max_occurrences=64)]
    if store is not None and len(store):
        out += [_score(d) for d in store.draft(tokens[-context:], max_len, max_drafts, alpha=alpha,
                                                max_occurrences=64)]
    return out


def _score(d) -> Scored:
    return Scored(d.tokens, d.match_len, d.count / d.total if d.total else 1.0)


def select_tree(
    drafts: Sequence[Scored],
    acceptance: AcceptanceModel,
    base: int,
    curve,
    cap: int,
    extra_rows: int = 0,
    workers: int = 1,
) -> list[tuple[int, ...]]:
    """The drafts cut to the trie nodes the budget keeps (see module doc)."""
    if not drafts or cap <= 0:
        return []
    cands = [d.tokens for d in drafts]
    trie = merge_trie(cands)
    prob = [0.0] * len(trie)
    for d, path in zip(drafts, trie.paths):
        c = acceptance.rate(d.match_len)
        p = d.freq
        for node in path:
            p *= c
            if p > prob[node]:
                prob[node] = p
    # parents never rank below children (P falls along a path); ties: shallower, then earlier
    order = sorted(range(len(trie)), key=lambda n: (-prob[n], trie.depths[n], n))
    k = best_k([prob[n] for n in order], base, curve, extra_rows, workers, cap)
    kept = set(order[:k])
    cut: list[tuple[int, ...]] = []
    for cand, path in zip(cands, trie.paths):
        n = 0
        while n < len(path) and path[n] in kept:
            n += 1
        if n:
            cut.append(tuple(cand[:n]))
    cut = list(dict.fromkeys(cut))
    return [c for c in cut if not any(o != c and o[: len(c)] == c for o in cut)]


def observe(acceptance: AcceptanceModel, drafts: Sequence[Scored], verified: Sequence[Sequence[int]],
            emitted: Sequence[int]) -> None:
    """Update the acceptance model with one step: for the best-ranked draft of each match-length
    bucket that was verified (cut to the budget), the tokens tried (up to and including the
    first mismatch) and the tokens accepted. Only the best-ranked one: the rate is the
    per-token acceptance of a bucket's top draft; lower-ranked drafts are discounted by their
    occurrence share, and counting them here too would discount them twice.

        >>> a = AcceptanceModel()
        >>> observe(a, [Scored((5, 6, 7), 4, 1.0), Scored((5, 9), 4, 0.5)], [(5, 6, 7), (5, 9)], [5, 6, 2])
        >>> a.tried[4], a.accepted[4]
        (3, 2)
    """
    from lp.budget import bucket

    seen: set[int] = set()
    for d in drafts:
        b = bucket(d.match_len)
        if b in seen:
            continue
        seen.add(b)
        k = max((_common(c, d.tokens) for c in verified), default=0)  # d's part inside the verified trie
        if k == 0:
            continue
        cut = d.tokens[:k]
        acc = 0
        while acc < len(cut) and acc < len(emitted) and cut[acc] == emitted[acc]:
            acc += 1
        acceptance.observe(d.match_len, min(len(cut), acc + 1), acc)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
