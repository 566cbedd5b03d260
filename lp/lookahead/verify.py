"""Verification of pooled candidates: a walk down the candidate trie.

Contract: plain Python over token ids, no torch. Candidates are token sequences of
any lengths hanging below the current token x (pooled n-gram suffixes of R = N - 1
tokens, suffix-matched drafts of adaptive length); a candidate that ends stops the
walk along it, others sharing its prefix go on (trie semantics). Each *node* of their trie
is a verified prefix; its target distribution is read from the ordinary row (the
root) or from the last candidate row of that prefix (any candidate sharing the
prefix gives the same conditional: the mask gives them the same visible prefix).

A node's *outcome* is the token the target emits there: the argmax (greedy) or
the exact multi-candidate sample verifier (lp.lookahead.sampling). The walk emits the
root's outcome; while the emitted token is a child of the current node it moves
there and emits that node's outcome. So a full match of an R-token suffix emits
N tokens: R verified ones plus the target's next token (seeds/000 §0x05A).

    >>> walk([(5, 6), (5, 8), (9, 1)], 5, lambda depth, c: {(1, 0): 6, (2, 0): 4}[depth, c])
    Path(emitted=[5, 6, 4], winner=0, hits=2)

    >>> walk([(5,), (5, 6, 7), (5, 6)], 5, lambda depth, c: {1: 6, 2: 7, 3: 3}[depth])
    Path(emitted=[5, 6, 7, 3], winner=1, hits=3)

Ties among equally long survivors go to the lowest candidate index (the node's
outcome is the same whichever survivor's row it is read from).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Path:
    emitted: list[int]  # tokens the target publishes this step, >= 1
    winner: int | None  # candidate whose rows hold the accepted tokens' K/V
    hits: int  # accepted candidate tokens (= len(emitted) - 1)


def children(candidates: Sequence[Sequence[int]], survivors: Sequence[int], depth: int) -> list[int]:
    """Distinct tokens at offset ``depth`` among ``survivors``, in candidate order."""
    out: list[int] = []
    for c in survivors:
        if depth < len(candidates[c]):
            token = candidates[c][depth]
            if token not in out:
                out.append(token)
    return out


def sharing_prefix(candidates: Sequence[Sequence[int]], c: int, depth: int) -> list[int]:
    """Candidates whose first ``depth`` tokens equal candidate ``c``'s."""
    prefix = tuple(candidates[c][:depth])
    return [i for i, cand in enumerate(candidates) if tuple(cand[:depth]) == prefix]


def walk(
    candidates: Sequence[Sequence[int]],
    root_outcome: int,
    node_outcome: Callable[[int, int], int],
) -> Path:
    """Walk the trie. ``node_outcome(depth, c)``: the outcome at the node reached after
    accepting ``candidates[c][:depth]`` (read from candidate c's row ``depth - 1``)."""
    emitted = [root_outcome]
    survivors = list(range(len(candidates)))
    winner = None
    depth = 0
    while survivors:
        survivors = [c for c in survivors if depth < len(candidates[c]) and candidates[c][depth] == emitted[-1]]
        if not survivors:
            break
        winner = survivors[0]
        depth += 1
        emitted.append(node_outcome(depth, winner))
    return Path(emitted, winner, len(emitted) - 1)


def greedy_walk(
    candidates: Sequence[Sequence[int]], root_argmax: int, cand_argmax: Sequence[Sequence[int]]
) -> Path:
    """Greedy verification: ``cand_argmax[c][s]`` is the argmax at candidate c's row s."""
    return walk(candidates, root_argmax, lambda depth, c: cand_argmax[c][depth - 1])
