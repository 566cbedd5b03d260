"""The step's draft tree: candidates from every source, scored, merged, cut to a budget.

Contract: plain Python over token ids, no torch, deterministic. A ``Scored`` draft is a
candidate continuation of the current token x with what predicts its acceptance (the
match length it was read after, the share of occurrences that continue with it).
Sources:

* the suffix index over prompt + output (lp.drafts.suffix.SuffixIndex): continuations after
  the longest earlier occurrences of the current suffix, of a length that grows with
  the match length, several per step ranked by frequency;
* an optional cross-request ``DraftStore`` (lp.drafts.suffix) over earlier outputs;
* the n-gram pool keyed by x (the Jacobi window's trajectories, and the prompt's
  n-grams when the prompt pool is on), match length 0.

``select_tree`` merges them into a trie (lp.lookahead.tree), gives every node the probability
that its whole path is accepted (the best over the drafts through it, lp.drafts.budget), and
keeps the nodes the budget pays for; the result is the drafts cut to the kept nodes
(a draft that became a prefix of another kept one is dropped):

    >>> from lp.drafts.budget import AcceptanceModel
    >>> drafts = [Scored((5, 6, 7, 8), 6, 1.0), Scored((5, 9), 1, 0.5), Scored((4,), 0, 1.0)]
    >>> select_tree(drafts, AcceptanceModel(), base=1, curve=None, cap=5)
    [(5, 6, 7, 8), (4,)]
    >>> select_tree(drafts, AcceptanceModel(), base=1, curve=None, cap=3)
    [(5, 6, 7)]
    >>> steep = [(1, 0.055), (2, 0.085), (16, 0.130)]
    >>> select_tree(drafts, AcceptanceModel(), base=1, curve=steep, cap=16)
    [(5, 6, 7, 8), (4,)]
    >>> select_tree([Scored((5, 9), 1, 0.5)], AcceptanceModel(), base=1, curve=steep, cap=16)
    []

With the priors, node P is 0.78, 0.61, 0.54, 0.47 along (5, 6, 7, 8) (read after a
6-token match: the rates of m = 6, 7, 8, 9), 0.35 for the pool's (4,), 0.125 and 0.069
along (5, 9) (m = 1, half the occurrences): on the steep CPU curve the five likely nodes
pay (3.74 tokens expected for t(6) = 98 ms against 1 for 55 ms), a lone unlikely draft
does not (a plain one-row step). With ``pad=True`` the step is priced on the curve's
envelope and filled to the cheapest size (lp.drafts.budget):

    >>> bumpy = [(1, 0.058), (2, 0.095), (3, 0.118), (4, 0.084), (5, 0.075), (8, 0.081)]
    >>> select_tree([Scored((5, 6), 3, 1.0)], AcceptanceModel(), base=1, curve=bumpy, cap=16, pad=True)
    [(5, 6), (0, 0)]

(2 draft rows + 1 pending would cost t(3) = 118 ms; 5 rows cost 75 ms, so two filler
rows ride along.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lp.drafts.budget import AcceptanceModel, best_k, bucket, cost, drafted_cost, envelope, padded_rows
from lp.lookahead.tree import merge_trie


# match_len of a draft whose acceptance is certain: the grammar's forced continuation
# (lp.grammar): P = 1 along it, and it teaches the acceptance model nothing
FORCED = -1


@dataclass(frozen=True)
class Scored:
    tokens: tuple[int, ...]
    match_len: int  # 0: n-gram pool; FORCED: the grammar's forced tokens
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
    pad: bool = False,
    gain: float = 1.0,
) -> list[tuple[int, ...]]:
    """The drafts cut to the trie nodes the budget keeps (see module doc). ``gain``: the
    calibration factor every node's P is scaled by when priced (lp.drafts.budget.GainCalibration).

    ``pad`` (one process): the step is priced at the cheapest measured size at or above
    its rows (lp.drafts.budget.envelope) and filled up to that size, first with the next most
    likely nodes, then with filler chains (never expected to be accepted; verification
    keeps them exact), all within ``cap`` nodes."""
    if not drafts or cap <= 0:
        return []
    cands = [d.tokens for d in drafts]
    trie = merge_trie(cands)
    prob = node_probs(drafts, trie, acceptance)
    # parents never rank below children (P falls along a path); ties: shallower, then earlier
    order = sorted(range(len(trie)), key=lambda n: (-prob[n], trie.depths[n], n))
    pad = pad and curve is not None
    probs = [prob[n] for n in order]
    if pad:  # k >= 1 priced at the cheapest size at or above it; k = 0 is the unpadded step
        k = best_k(probs, base, envelope(curve), extra_rows, workers, cap, plain=cost(curve, base), gain=gain)
    else:
        k = best_k(probs, base, curve, extra_rows, workers, cap, gain=gain)
    filler = 0
    if pad and k:
        rows = base + extra_rows + k
        room = min(padded_rows(curve, rows), base + extra_rows + cap) - rows
        more = min(room, len(order) - k)
        k, filler = k + more, room - more
    cut = _cut(cands, trie, set(order[:k]))
    return cut + _filler(filler, {c[0] for c in cands}, max(len(c) for c in cands))


def _cut(cands, trie, kept: set[int]) -> list[tuple[int, ...]]:
    """The drafts cut to their longest prefixes inside ``kept`` (drafts that became a prefix
    of another kept one dropped)."""
    cut: list[tuple[int, ...]] = []
    for cand, path in zip(cands, trie.paths):
        n = 0
        while n < len(path) and path[n] in kept:
            n += 1
        if n:
            cut.append(tuple(cand[:n]))
    cut = list(dict.fromkeys(cut))
    return [c for c in cut if not any(o != c and o[: len(c)] == c for o in cut)]


@dataclass(frozen=True)
class TreeRequest:
    """One sequence's part of a batched step's budget (``select_trees``)."""

    drafts: Sequence[Scored]
    acceptance: AcceptanceModel
    base: int  # rows this sequence runs with or without drafts
    cap: int  # most trie nodes it may verify
    extra_rows: int = 0  # its rows that ride along only when it verifies something
    gain: float = 1.0  # its nodes' P scaled by this when priced (lp.drafts.budget.GainCalibration)


@dataclass(frozen=True)
class BatchCost:
    """What a batched step of S sequences costs beyond the one-sequence t(rows) (seconds,
    measured by lp.engine.batch_cost): ``seq_s`` per sequence after the first (each reads
    its own keys in its own attention call), ``draft_s`` per sequence that verifies drafts
    (its rows run attention's multi-row path under a tree mask; the mask is built and read)."""

    seq_s: float = 0.0
    draft_s: float = 0.0


def select_trees(requests: Sequence[TreeRequest], curve, fixed_rows: int = 0, pad: bool = False,
                 batch: BatchCost | None = None, seqs: int | None = None) -> list[list[tuple[int, ...]]]:
    """One draft budget for a batched step: the trie nodes of every sequence compete for
    the step's rows. Nodes are taken by decreasing P across the batch (each sequence's
    parents before its children) and the count k that maximizes the batch's expected
    tokens per second on t(Q), Q = every row of the step, is kept; ``fixed_rows``: rows of
    the step outside these requests (prefill chunks, budget-free sequences). As the batch
    grows, its base rows climb the curve and extra nodes must pay more: drafts shrink by
    themselves, no batch-size threshold. ``pad``: price k >= 1 on the curve's envelope and
    fill the step with the next most likely nodes up to the cheapest measured size.
    ``batch``: add a batched step's own costs (``BatchCost``: per sequence of the step,
    ``seqs`` of them, default the requests; per sequence that drafts), so a sequence starts
    drafting only when its nodes pay for that too.

        >>> from lp.drafts.budget import AcceptanceModel
        >>> a = AcceptanceModel()
        >>> sure = TreeRequest([Scored((5, 6, 7, 8), 6, 1.0)], a, base=1, cap=16)
        >>> weak = TreeRequest([Scored((4, 9), 1, 0.5)], a, base=1, cap=16)
        >>> steep = [(1, 0.055), (2, 0.085), (16, 0.130), (32, 0.184)]
        >>> select_trees([sure, weak], steep)
        [[(5, 6, 7, 8)], []]
        >>> select_trees([sure, weak], None)
        [[(5, 6, 7, 8)], [(4, 9)]]
        >>> flat = [(1, 0.020), (2, 0.0205), (16, 0.027)]  # rows nearly free
        >>> select_trees([sure, weak], flat)
        [[(5, 6, 7, 8)], [(4,)]]
        >>> select_trees([sure, weak], flat, batch=BatchCost(seq_s=0.001, draft_s=0.004))  # drafting is not
        [[(5, 6, 7, 8)], []]
    """
    tries, orders, probs = [], [], []
    for r in requests:
        if not r.drafts or r.cap <= 0:
            tries.append(None), orders.append([]), probs.append([])
            continue
        trie = merge_trie([d.tokens for d in r.drafts])
        # scaled before the merge: the batch's nodes compete at their calibrated P
        prob = [min(1.0, r.gain * p) for p in node_probs(r.drafts, trie, r.acceptance)]
        order = sorted(range(len(trie)), key=lambda n: (-prob[n], trie.depths[n], n))[: r.cap]
        tries.append(trie), orders.append(order), probs.append(prob)
    merged: list[tuple[int, int]] = []  # (request, node) by decreasing P, stable per request
    heads = [0] * len(requests)
    while True:
        live = [i for i in range(len(requests)) if heads[i] < len(orders[i])]
        if not live:
            break
        i = min(live, key=lambda j: (-probs[j][orders[j][heads[j]]], j))
        merged.append((i, orders[i][heads[i]]))
        heads[i] += 1
    base = fixed_rows + sum(r.base for r in requests)
    k = len(merged)
    if curve is not None:
        batch = batch or BatchCost()
        fixed_s = batch.seq_s * ((len(requests) if seqs is None else seqs) - 1)
        tokens, rows, started = float(len(requests)), base, set()
        best_rate, k = tokens / (cost(curve, base) + fixed_s), 0
        for n, (i, node) in enumerate(merged, start=1):
            if i not in started:
                started.add(i)
                rows += requests[i].extra_rows
            rows += 1
            tokens += probs[i][node]
            rate = tokens / (drafted_cost(curve, base, rows, pad) + fixed_s + batch.draft_s * len(started))
            if rate > best_rate:
                best_rate, k = rate, n
        if pad and k:
            started = {i for i, _ in merged[:k]}
            rows = base + sum(requests[i].extra_rows for i in started) + k
            room = padded_rows(curve, rows) - rows
            more = [m for m in range(k, len(merged)) if merged[m][0] in started][:room]
            kept_idx = list(range(k)) + more
        else:
            kept_idx = list(range(k))
    else:
        kept_idx = list(range(k))
    kept: list[set[int]] = [set() for _ in requests]
    for m in kept_idx:
        kept[merged[m][0]].add(merged[m][1])
    out = []
    for r, trie, nodes in zip(requests, tries, kept):
        out.append(_cut([d.tokens for d in r.drafts], trie, nodes) if nodes else [])
    return out


def node_probs(drafts: Sequence[Scored], trie, acceptance: AcceptanceModel) -> list[float]:
    """P(the target accepts the whole path to each trie node): the best over the drafts
    through it of share x rate(m) x rate(m + 1) x ... (lp.drafts.budget; pool n-grams: m = 0
    at every depth)."""
    prob = [0.0] * len(trie)
    for d, path in zip(drafts, trie.paths):
        p = d.freq
        for j, node in enumerate(path):
            if d.match_len != FORCED:
                p *= acceptance.rate(d.match_len + j if d.match_len else 0)
            if p > prob[node]:
                prob[node] = p
    return prob


def predicted_gain(drafts: Sequence[Scored], verified: Sequence[Sequence[int]],
                   acceptance: AcceptanceModel) -> float | None:
    """The draft tokens the budget expected this step to accept: the sum of P over the nodes of
    the verified trie (``node_probs``, before ``observe`` updates ``acceptance``; filler nodes,
    which no draft predicts, count 0). None when a grammar-forced draft was verified (certain
    tokens: nothing to calibrate), or when nothing was.

        >>> from lp.drafts.budget import AcceptanceModel
        >>> d = [Scored((5, 6), 6, 1.0), Scored((4,), 0, 1.0)]
        >>> round(predicted_gain(d, [(5, 6), (4,)], AcceptanceModel()), 4)   # 0.78 + 0.78 x 0.78 + 0.35
        1.7384
        >>> round(predicted_gain(d, [(5,)], AcceptanceModel()), 4)
        0.78
        >>> predicted_gain(d, [], AcceptanceModel()) is None
        True
    """
    if not verified or any(d.match_len == FORCED for d in drafts):
        return None
    kept = {tuple(v[:j]) for v in verified for j in range(1, len(v) + 1)}
    trie = merge_trie([d.tokens for d in drafts])
    prob = node_probs(drafts, trie, acceptance)
    total = 0.0
    for d, path in zip(drafts, trie.paths):
        for j, node in enumerate(path):
            prefix = d.tokens[: j + 1]
            if prefix in kept:
                kept.discard(prefix)
                total += prob[node]
    return total


def _filler(rows: int, taken: set[int], max_len: int) -> list[tuple[int, ...]]:
    """``rows`` trie nodes as chains of at most ``max_len`` tokens whose first tokens are not
    among ``taken`` (so they merge with nothing): token ids 0, 1, 2, ... repeated."""
    out: list[tuple[int, ...]] = []
    t = 0
    while rows > 0:
        while t in taken:
            t += 1
        n = min(rows, max_len)
        out.append((t,) * n)
        rows -= n
        t += 1
    return out


def observe(acceptance: AcceptanceModel, drafts: Sequence[Scored], verified: Sequence[Sequence[int]],
            emitted: Sequence[int]) -> None:
    """Update the acceptance model with one step: for the best-ranked draft of each match-length
    bucket that was verified (cut to the budget), each token tried (up to and including the
    first mismatch) counts for the match length that predicted it (m + its depth; pool
    n-grams: 0). Only the best-ranked one: the rate is the per-token acceptance of a
    bucket's top draft; lower-ranked drafts are discounted by their occurrence share, and
    counting them here too would discount them twice.

        >>> a = AcceptanceModel()
        >>> observe(a, [Scored((5, 6, 7), 4, 1.0), Scored((5, 9), 4, 0.5)], [(5, 6, 7), (5, 9)], [5, 6, 2])
        >>> a.tried[4], a.accepted[4]
        (3, 2)
        >>> observe(a, [Scored((1, 2, 3), 3, 1.0)], [(1, 2, 3)], [1, 5])
        >>> a.tried[3], a.accepted[3], a.tried[4], a.accepted[4]
        (1, 1, 4, 2)
    """
    seen: set[int] = set()
    for d in drafts:
        if d.match_len == FORCED:
            continue
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
        for j in range(min(len(cut), acc + 1)):
            acceptance.observe(d.match_len + j if d.match_len else 0, 1, int(j < acc))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
