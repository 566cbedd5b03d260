"""Token trie of draft candidates: shared prefixes become shared rows.

Contract: plain Python over token ids, no torch. ``merge_trie(candidates)`` takes
candidates (token sequences of any lengths, all hanging below the current token x)
and returns one row per distinct nonempty prefix, in DFS preorder (children in order
of first appearance among the candidates), so a parent's row always comes before its
children's and every subtree is a contiguous range of rows:

* ``parents[r]``: the row of r's parent, -1 when r is a child of x;
* ``tokens[r]``: the token r adds; ``depths[r]``: its depth below x (1-based);
* ``paths[c]``: the rows along candidate c's path, one per token (``[]`` for an
  empty candidate; equal candidates get equal paths).

Rows == distinct nonempty prefixes <= sum of the candidates' lengths (the rows of
independent chains), with equality when no two candidates share a first token.

    >>> t = merge_trie([(5, 6, 7), (5, 6, 8), (9,), (5, 2)])
    >>> t.parents, t.tokens, t.depths
    ([-1, 0, 1, 1, 0, -1], [5, 6, 7, 8, 2, 9], [1, 2, 3, 3, 2, 1])
    >>> t.paths
    [[0, 1, 2], [0, 1, 3], [5], [0, 4]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TrieRows:
    parents: list[int]  # parent row, -1 = child of x
    tokens: list[int]
    depths: list[int]  # 1-based depth below x
    paths: list[list[int]]  # per candidate: its rows, root side first

    def __len__(self) -> int:
        return len(self.tokens)


def merge_trie(candidates: Sequence[Sequence[int]]) -> TrieRows:
    # Build the trie as nested dicts (token -> node id), children in first-appearance order.
    kids: list[dict[int, int]] = [{}]  # node 0 is x
    node_token: list[int] = [-1]
    node_paths: list[list[int]] = []
    for cand in candidates:
        node, path = 0, []
        for token in cand:
            child = kids[node].get(token)
            if child is None:
                child = len(kids)
                kids[node][token] = child
                kids.append({})
                node_token.append(token)
            path.append(child)
            node = child
        node_paths.append(path)

    # Number the nodes in DFS preorder (iterative; children in insertion order).
    row_of = [-1] * len(kids)
    parents: list[int] = []
    tokens: list[int] = []
    depths: list[int] = []
    stack = [(child, -1, 1) for child in reversed(list(kids[0].values()))]
    while stack:
        node, parent_row, depth = stack.pop()
        row_of[node] = len(tokens)
        parents.append(parent_row)
        tokens.append(node_token[node])
        depths.append(depth)
        stack.extend((child, row_of[node], depth + 1) for child in reversed(list(kids[node].values())))
    return TrieRows(parents, tokens, depths, [[row_of[n] for n in path] for path in node_paths])
