"""N-gram pool: generated n-grams keyed by their first token.

Contract: plain Python over token ids, no torch. ``pool[key]`` is a per-key LRU
list of at most ``capacity`` suffixes, each a tuple of ``n - 1`` token ids.
Re-inserting a suffix makes it most recent; inserting into a full bucket evicts
the least recent one. Retrieval returns the most recent suffix first.

    >>> p = NGramPool(n=3, capacity=2)
    >>> p.add(1, (2, 3)); p.add(1, (4, 5)); p.add(1, (2, 3)); p.add(1, (6, 7))
    >>> p.get(1)
    [(6, 7), (2, 3)]

A frequent key cannot take another key's budget; the number of distinct keys is
not bounded (one request's pool lives as long as the request).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class NGramPool:
    def __init__(self, n: int, capacity: int):
        assert n >= 2 and capacity >= 0
        self.n = n
        self.capacity = capacity
        # key -> dict used as an ordered set, least recent first
        self._buckets: dict[int, dict[tuple[int, ...], None]] = {}

    def add(self, key: int, suffix: Sequence[int]) -> None:
        assert len(suffix) == self.n - 1, (len(suffix), self.n)
        if self.capacity == 0:
            return
        suffix = tuple(suffix)
        bucket = self._buckets.setdefault(key, {})
        if suffix in bucket:
            del bucket[suffix]
        elif len(bucket) >= self.capacity:
            del bucket[next(iter(bucket))]
        bucket[suffix] = None

    def add_ngrams(self, pairs: Iterable[tuple[int, Sequence[int]]]) -> None:
        for key, suffix in pairs:
            self.add(key, suffix)

    def add_sequence(self, tokens: Sequence[int], start: int = 0) -> None:
        """Insert every n-gram of ``tokens`` whose last token sits at index >= start + n - 1.

        With ``start=0`` this seeds the pool from a whole prompt; with ``start`` set to the
        first new index minus ``n - 1`` it adds only the n-grams completed by new tokens.
        """
        m = self.n - 1
        for i in range(max(start, 0), len(tokens) - m):
            self.add(tokens[i], tokens[i + 1 : i + 1 + m])

    def get(self, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        bucket = self._buckets.get(key)
        if not bucket:
            return []
        out = list(reversed(bucket))
        return out if limit is None else out[:limit]

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def __contains__(self, key: int) -> bool:
        return bool(self._buckets.get(key))

    def fingerprint(self) -> int:
        """A deterministic hash of the whole pool (order included), for cross-rank checks."""
        h = 1469598103934665603
        for key, bucket in self._buckets.items():
            for suffix in bucket:
                h = hash((h, key, suffix))
        return h & 0x7FFFFFFFFFFF


class ContextIndex:
    """Ranks prompt/output n-grams by how much left context they share with the live frontier.

    Keeps every position of every token of the committed sequence. ``lookup(R, limit)``
    returns up to ``limit`` distinct R-token continuations that followed earlier
    occurrences of the sequence's last ``m`` tokens, longest context ``m`` first
    (m = max_context .. 1), most recent occurrence first. With m = 1 these are exactly
    the prompt/output n-grams keyed by the current token; longer m only orders them
    better (prompt-lookup style), so the verifier tries the likeliest ones first.

        >>> ix = ContextIndex([5, 6, 7, 9, 6, 7, 8, 1, 6, 7])
        >>> ix.lookup(2, 3)
        [(8, 1), (9, 6)]
    """

    def __init__(self, tokens: Sequence[int] = (), max_context: int = 3):
        self.tokens: list[int] = []
        self.positions: dict[int, list[int]] = {}
        self.max_context = max_context
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.positions.setdefault(t, []).append(len(self.tokens))
            self.tokens.append(t)

    def lookup(self, R: int, limit: int) -> list[tuple[int, ...]]:
        toks = self.tokens
        end = len(toks) - 1
        if end < 1 or limit <= 0:
            return []
        out: list[tuple[int, ...]] = []
        seen: set[tuple[int, ...]] = set()
        starts = [i for i in reversed(self.positions.get(toks[end], [])) if i < end and i + R < len(toks)]
        for m in range(min(self.max_context, end + 1), 0, -1):
            for i in starts:
                if i - m + 1 < 0 or toks[i - m + 1 : i + 1] != toks[end - m + 1 : end + 1]:
                    continue
                suffix = tuple(toks[i + 1 : i + 1 + R])
                if suffix not in seen:
                    seen.add(suffix)
                    out.append(suffix)
                    if len(out) == limit:
                        return out
        return out
