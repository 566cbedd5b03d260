"""SuffixIndex, suffix drafts and DraftStore on literal token lists, plus brute-force references."""

from __future__ import annotations

import doctest
import random

import lp.drafts.suffix
from lp.drafts.suffix import Draft, DraftStore, SuffixIndex

# ---------------------------------------------------------------------------
# Brute-force references, O(n^2) and worse: obviously right, only for small texts. They
# use nothing of lp.drafts.suffix: the draft length is the documented rule, written out here.


def draft_len(m, max_tokens, alpha=1.0):
    """min(max_tokens, max(1, floor(alpha * m))), as lp.drafts.suffix's docstring states it."""
    return min(max_tokens, max(1, int(alpha * m)))


def bf_longest(t, max_len=None):
    n = len(t)
    top = n - 1 if max_len is None else min(n - 1, max_len)
    for m in range(top, 0, -1):
        ends = [e for e in range(m - 1, n - 1) if t[e - m + 1 : e + 1] == t[n - m :]]
        if ends:
            return m, ends
    return 0, []


def bf_drafts(seqs, context, max_tokens, max_drafts, min_match=1, alpha=1.0):
    """Every match length m from len(context) down; occurrences (serial, e) in any stored
    sequence with a token after e; ranking and covering exactly as documented."""
    out = []
    for m in range(len(context), max(min_match, 1) - 1, -1):
        pat = list(context[len(context) - m :])
        occs = [
            ((serial, e), tuple(seq[e + 1 : e + 1 + draft_len(m, max_tokens, alpha)]))
            for serial, seq in enumerate(seqs)
            for e in range(m - 1, len(seq) - 1)
            if seq[e - m + 1 : e + 1] == pat
        ]
        if not occs:
            continue
        L = draft_len(m, max_tokens, alpha)
        conts = {c for _, c in occs}
        leaves = [c for c in conts if not any(o != c and o[: len(c)] == c for o in conts)]

        def agree(prefix):
            return [rec for rec, c in occs if c[: len(prefix)] == prefix]

        def key(leaf):
            counts = [-len(agree(leaf[:i])) if i <= len(leaf) else 0 for i in range(1, L + 1)]
            return counts, tuple(-x for x in max(agree(leaf)))

        for leaf in sorted(leaves, key=key):
            if any(d.tokens[: len(leaf)] == leaf for d in out):
                continue
            out.append(Draft(leaf, m, len(agree(leaf)), len(occs)))
            if len(out) == max_drafts:
                return out
    return out


def repetitive(rng, n, vocab=64):
    """A generation-like sequence: random tokens with frequent copies of earlier spans."""
    t = [rng.randrange(vocab)]
    while len(t) < n:
        if rng.random() < 0.5 and len(t) > 8:
            i = rng.randrange(len(t) - 4)
            t.extend(t[i : i + rng.randint(2, 12)])
        else:
            t.append(rng.randrange(vocab))
    return t[:n]


def test_module_doctests():
    result = doctest.testmod(lp.drafts.suffix, verbose=False, report=True)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------
# SuffixIndex: longest earlier match


def test_longest_match_after_each_append():
    ix = SuffixIndex()
    got = []
    for t in [1, 2, 1, 2, 3, 1, 2, 3, 4]:
        ix.append(t)
        got.append(ix.longest_match())
    assert got == [
        (0, []),
        (0, []),
        (1, [0]),  # 1 ended at 0
        (2, [1]),  # 1 2 ended at 1
        (0, []),  # 3 is new
        (1, [0, 2]),
        (2, [1, 3]),
        (3, [4]),  # 1 2 3 ended at 4
        (0, []),
    ]


def test_longest_match_overlapping_and_max_len():
    ix = SuffixIndex([7])
    assert ix.longest_match() == (0, [])
    ix.extend([7, 7, 7])
    assert ix.longest_match() == (3, [2])  # 7 7 7 ends at 2, overlapping the suffix itself
    ix = SuffixIndex([5, 1, 2, 3, 9, 2, 3, 1, 2, 3])
    assert [ix.longest_match(k) for k in (None, 9, 3, 2, 1, 0)] == [
        (3, [3]),
        (3, [3]),
        (3, [3]),
        (2, [3, 6]),
        (1, [3, 6]),
        (0, []),
    ]
    assert SuffixIndex().longest_match() == (0, [])


def test_occurrences_count_first_end():
    ix = SuffixIndex([4, 1, 2, 4, 1, 2, 4, 1])
    assert ix.occurrences([4, 1]) == [1, 4, 7]
    assert ix.count([4, 1]) == 3 and ix.count([1, 2, 4]) == 2 and ix.count([2, 1]) == 0
    assert ix.first_end([1, 2]) == 2 and ix.first_end([9]) is None
    assert ix.occurrences([]) == [] and len(ix) == 8


def test_longest_match_matches_brute_force_random():
    rng = random.Random(1234)
    for trial in range(60):
        vocab = (2, 3, 5)[trial % 3]
        t = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        ix = SuffixIndex()
        for i, tok in enumerate(t):
            ix.append(tok)
            assert ix.longest_match() == bf_longest(t[: i + 1]), (t[: i + 1],)
            k = rng.randint(0, 6)
            assert ix.longest_match(k) == bf_longest(t[: i + 1], k), (t[: i + 1], k)
        assert ix.num_states <= 2 * len(t)
        for _ in range(10):  # occurrence sets (hence counts, first/last ends) are exact
            a = rng.randrange(len(t))
            pat = t[a : a + rng.randint(1, 4)]
            ends = [e for e in range(len(pat) - 1, len(t)) if t[e - len(pat) + 1 : e + 1] == pat]
            assert ix.occurrences(pat) == ends and ix.first_end(pat) == ends[0]


# ---------------------------------------------------------------------------
# SuffixIndex: drafts


def test_draft_length_grows_with_match_length():
    text = [1, 2, 3, 4, 5, 6, 7, 8]
    for alpha, lengths in ((1.0, [1, 2, 3, 4]), (2.0, [2, 4, 6, 8])):
        ix = SuffixIndex(text)
        got = []
        for t in [1, 2, 3, 4]:
            ix.append(t)
            (d,) = ix.draft(max_tokens=8, max_drafts=1, alpha=alpha)
            assert d.match_len == t and d.count == 1 and d.total == 1
            got.append(d.tokens)
        assert [len(g) for g in got] == lengths
        assert got[-1] == (5, 6, 7, 8, 1, 2, 3, 4)[: lengths[-1]]
    ix = SuffixIndex(text + [1, 2, 3, 4])
    assert ix.draft(max_tokens=3, max_drafts=1)[0].tokens == (5, 6, 7)  # capped by max_tokens


def test_draft_frequency_then_recency():
    # after 1: continuations (5, 6) x2, (7, 8) x1 (the most recent) -> frequency wins
    ix = SuffixIndex([9, 1, 5, 6, 1, 5, 6, 1, 7, 8, 2, 1])
    assert ix.draft(4, 5, alpha=2) == [Draft((5, 6), 1, 2, 3), Draft((7, 8), 1, 1, 3)]
    # equal counts -> the latest occurrence first
    ix = SuffixIndex([9, 1, 5, 1, 7, 2, 1])
    assert ix.draft(4, 5) == [Draft((7,), 1, 1, 2), Draft((5,), 1, 1, 2)]
    # first token's agreement, then the second's: 5 (3 times) before 3 (twice)
    ix = SuffixIndex([1, 5, 6, 1, 5, 6, 1, 5, 8, 1, 3, 3, 1, 3, 3, 0, 1])
    assert ix.draft(4, 5, alpha=2) == [
        Draft((5, 6), 1, 2, 5),
        Draft((5, 8), 1, 1, 5),
        Draft((3, 3), 1, 2, 5),
    ]
    assert ix.draft(4, 2, alpha=2) == [Draft((5, 6), 1, 2, 5), Draft((5, 8), 1, 1, 5)]
    # only the most recent occurrences: the last two are 1 3 3 (twice)
    assert ix.draft(4, 5, alpha=2, max_occurrences=2) == [Draft((3, 3), 1, 2, 2)]


def test_draft_falls_back_to_shorter_matches():
    ix = SuffixIndex([1, 2, 3, 4, 2, 3, 5, 1, 2, 3])
    assert ix.draft(4, 3) == [Draft((4, 2, 3), 3, 1, 1), Draft((5, 1), 2, 1, 2)]
    assert ix.draft(4, 1) == [Draft((4, 2, 3), 3, 1, 1)]
    assert ix.draft(4, 3, min_match=3) == [Draft((4, 2, 3), 3, 1, 1)]
    assert ix.draft(4, 3, min_match=4) == []


def test_draft_never_passes_text_end():
    ix = SuffixIndex([1, 2, 1])
    assert ix.draft(5, 5, alpha=10) == [Draft((2, 1), 1, 1, 1)]  # 5 asked, 2 exist
    ix = SuffixIndex([7, 7, 7, 7])
    assert ix.draft(5, 5) == [Draft((7,), 3, 1, 1), Draft((7, 7), 2, 1, 2)]


def test_no_match_no_drafts():
    assert SuffixIndex().draft(4, 4) == []
    assert SuffixIndex([3]).draft(4, 4) == []
    assert SuffixIndex([1, 2, 3, 4]).draft(4, 4) == []
    ix = SuffixIndex([1, 2, 1])
    assert ix.draft(0, 4) == [] and ix.draft(4, 0) == []


def test_drafts_match_brute_force_random():
    rng = random.Random(99)
    for trial in range(40):
        vocab = (2, 3, 4)[trial % 3]
        t = [rng.randrange(vocab) for _ in range(rng.randint(2, 40))]
        ix = SuffixIndex()
        for i, tok in enumerate(t):
            ix.append(tok)
            mt, md, mm, alpha = rng.randint(1, 6), rng.randint(1, 5), rng.randint(1, 3), rng.choice((1.0, 1.5, 3.0))
            got = ix.draft(mt, md, min_match=mm, alpha=alpha)
            assert got == bf_drafts([t[: i + 1]], t[: i + 1], mt, md, mm, alpha), (t[: i + 1], mt, md, mm, alpha)
            for d in got:  # every draft is read from the text after an earlier match
                ends = ix.occurrences(t[i + 1 - d.match_len : i + 1])
                assert any(tuple(t[e + 1 : e + 1 + len(d.tokens)]) == d.tokens for e in ends if e < i)
                assert len(d.tokens) >= 1 and len(d.tokens) <= mt
                assert d.count >= 1 and d.count <= d.total


def test_generation_like_sequence_states_linear():
    t = repetitive(random.Random(7), 4096)
    ix = SuffixIndex()
    for tok in t:
        ix.append(tok)
    assert ix.num_states <= 2 * len(t)
    m, ends = ix.longest_match()
    n = len(t)
    assert m >= 1 and ends == [e for e in range(m - 1, n - 1) if t[e - m + 1 : e + 1] == t[-m:]]
    assert not any(t[e - m : e + 1] == t[-m - 1 :] for e in range(m, n - 1))  # m is the longest
    for d in ix.draft(8, 4):
        assert len(d.tokens) >= 1 and len(d.tokens) <= 8


# ---------------------------------------------------------------------------
# DraftStore


def test_store_drafts_and_eviction():
    st = DraftStore(max_tokens=10)
    st.add([1, 2, 3, 4])
    st.add([5, 2, 3, 6, 6])
    assert len(st) == 9 and st.num_sequences == 2
    # 2 3 in both sequences: later sequence ranks first on a tie
    assert st.draft([9, 2, 3], max_tokens=2, max_drafts=4) == [
        Draft((6, 6), 2, 1, 2),
        Draft((4,), 2, 1, 2),
    ]
    assert st.draft([1, 2, 3], max_tokens=4, max_drafts=4) == [
        Draft((4,), 3, 1, 1),
        Draft((6, 6), 2, 1, 2),
    ]
    st.add([7, 8])  # 9 + 2 > 10: the oldest sequence goes
    assert len(st) == 7 and st.num_sequences == 2
    assert st.draft([1, 2, 3], max_tokens=4, max_drafts=4) == [Draft((6, 6), 2, 1, 1)]
    assert st.draft([4], 4, 4) == [] and st.draft([], 4, 4) == []
    st.clear()
    assert len(st) == 0 and st.num_states == 0 and st.draft([7], 4, 4) == []


def test_store_never_crosses_sequences_and_truncates_long_adds():
    st = DraftStore(max_tokens=6)
    st.add([1, 2])
    st.add([3, 4])
    assert st.draft([2], 4, 4) == []  # 2 ends its sequence: 3 is not its continuation
    st.add(list(range(20, 30)))  # longer than the store: its last 6 tokens
    assert len(st) == 6 and st.num_sequences == 1
    assert st.draft([22, 23], 4, 4) == []  # dropped head
    assert st.draft([24, 25], 4, 4) == [Draft((26, 27), 2, 1, 1)]
    assert DraftStore(0).draft([1], 4, 4) == []


def test_store_matches_brute_force_random():
    rng = random.Random(5)
    for trial in range(30):
        st = DraftStore(max_tokens=rng.randint(5, 40))
        kept: list[list[int]] = []
        for _ in range(rng.randint(1, 6)):
            seq = [rng.randrange(3) for _ in range(rng.randint(1, 15))]
            st.add(seq)
            kept.append(seq[-st.max_tokens :])
            while sum(map(len, kept)) > st.max_tokens:
                kept.pop(0)
            assert len(st) == sum(map(len, kept))
        for _ in range(5):
            ctx = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
            mt, md, mm = rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 2)
            assert st.draft(ctx, mt, md, min_match=mm) == bf_drafts(kept, ctx, mt, md, mm), (kept, ctx, mt, md, mm)


def test_store_memory_bounded_on_generation_like_sequence():
    rng = random.Random(11)
    t = repetitive(rng, 4096)
    st = DraftStore(max_tokens=1024)
    i = 0
    while i < len(t):
        k = rng.randint(16, 300)
        st.add(t[i : i + k])
        i += k
        assert len(st) <= 1024
        assert st.num_states <= 2 * len(st) + 1
        for d in st.draft(t[i - 16 : i], max_tokens=8, max_drafts=4):
            assert len(d.tokens) >= 1 and len(d.tokens) <= 8 and d.match_len >= 1
    assert len(st) > 1024 - 300
