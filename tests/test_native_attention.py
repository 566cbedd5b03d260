"""lp's C++ paged attention (csrc/lp_attention.cpp, ``torch.ops.lp_attention.paged``) against the
Python op it replaces on float32 CPU steps (``lp::paged_attention``: one sdpa call a sequence):
one-row sequences, trees with their masks, fragmented keys, the sliding mask, long sequences
(its sdpa route) and padding spans; a sequence's output does not depend on the others in the
batch; a batched engine on the C++ op equals generate."""

from __future__ import annotations

import shutil

import pytest
import torch

from lp.kernels import attention
from lp.kernels.attention import FIRST, KEYS, MASK, QO, ROWS, SLIDING, SLOTS

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ninja") is None,
                                reason="the kernel is built with g++ and ninja")

H, HKV, D, POOL = 6, 2, 32, 512


@pytest.fixture(scope="module")
def op():
    """The op itself, whatever path this build has (AVX-512 or its scalar loop)."""
    built = attention.native_op()
    assert built is not None
    return built[1]


def _batch(seqs, seed=0, sliding=False):
    """seqs: (rows, keys, fragmented); each tree's mask hides a random set of its own rows
    (the prefix always visible, a row always sees itself); every span of the table."""
    g = torch.Generator().manual_seed(seed)
    spans, masks, slots, qo, at, first = [], [], [], 0, 0, 0
    for q, k, frag in seqs:
        span = [0] * 7
        span[QO], span[ROWS], span[KEYS], span[MASK], span[SLIDING], span[SLOTS] = qo, q, k, -1, -1, -1
        if frag:
            span[FIRST], span[SLOTS] = -1, sum(t.numel() for t in slots)
            slots.append(torch.randperm(POOL, generator=g)[:k])
        else:
            span[FIRST] = first
            first += k + 7
        if q > 1:
            hide = torch.rand(q, q, generator=g) < 0.4
            hide.fill_diagonal_(False)
            m = torch.zeros(q, k)
            m[:, k - q:] = torch.zeros(q, q).masked_fill(hide, float("-inf"))
            span[MASK], at = at, at + q * k
            masks.append(m.view(-1))
        if sliding:
            m = torch.zeros(q, k)
            m[:, : k // 3] = float("-inf")
            span[SLIDING], at = at, at + q * k
            masks.append(m.view(-1))
        spans.append(span)
        qo += q
    spans.append([qo, 0, 0, 0, -1, -1, -1])  # a padding span
    masks.append(torch.zeros(2))
    slots.append(torch.zeros(2, dtype=torch.long))
    query = torch.randn(1, qo, H, D, generator=g).transpose(1, 2)  # transformers' layout: a transposed view
    key = torch.randn(1, HKV, POOL, D, generator=g)
    value = torch.randn(1, HKV, POOL, D, generator=g)
    return query, key, value, torch.tensor(spans), torch.cat(masks), torch.cat(slots)


@pytest.mark.parametrize("sliding", [False, True])
def test_equals_the_python_op(op, sliding):
    seqs = [(1, 37, False), (1, 1, False), (3, 20, False), (2, 64, True), (1, 130, True), (9, 40, False),
            (attention.NATIVE_ROWS, 33, False)]
    query, key, value, spans, masks, slots = _batch(seqs, sliding=sliding)
    want = attention.paged_attention(query, key, value, spans, masks, slots, 0.17, sliding)
    got = op(query, key, value, spans, masks, slots, 0.17, sliding, attention.NATIVE_ROWS)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-5, atol=2e-6), (got - want).abs().max()
    # every row through the C++ loop (no sdpa route) equals too
    got_all = op(query, key, value, spans, masks, slots, 0.17, sliding, 1000)
    assert torch.allclose(got_all, want, rtol=1e-5, atol=2e-6), (got_all - want).abs().max()


def test_a_sequence_does_not_depend_on_the_others(op):
    seqs = [(1, 50, False), (2, 30, True), (1, 90, False), (3, 12, False)]
    query, key, value, spans, masks, slots = _batch(seqs, seed=3)
    both = op(query, key, value, spans, masks, slots, 0.125, False, attention.NATIVE_ROWS)
    alone = spans.clone()
    alone[1:, ROWS] = 0  # the first sequence alone: the others as padding spans
    first = op(query, key, value, alone, masks, slots, 0.125, False, attention.NATIVE_ROWS)
    assert torch.equal(first[:, :1], both[:, :1])
    last = spans.clone()
    last[:3, ROWS] = 0
    got = op(query, key, value, last, masks, slots, 0.125, False, attention.NATIVE_ROWS)
    assert torch.equal(got[:, 4:], both[:, 4:])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = op(query, key, value, spans, masks, slots, 0.125, False, attention.NATIVE_ROWS)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one_thread, both)


def test_a_fully_masked_row_is_nan_like_sdpa(op):
    query, key, value, spans, masks, slots = _batch([(2, 10, False)], seed=5)
    masks[: 2 * 10] = float("-inf")  # both rows see nothing
    got = op(query, key, value, spans, masks, slots, 0.125, False, attention.NATIVE_ROWS)
    assert torch.isnan(got).all()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_engine_on_the_cpp_op_equals_generate(tiny_factory, monkeypatch, family):
    from lp.config import DecodingConfig
    from lp.engine.batch import BatchEngine
    from lp.model.runner import ModelRunner
    from tests.helpers import REPETITIVE_PROMPT, hf_greedy

    model = tiny_factory(family)
    runner = ModelRunner(model)
    engine = BatchEngine(runner, kv_tokens=1024, block_size=8, max_batch=3)
    calls = []
    native = attention._NATIVE
    fast = attention.native_op()[0].simd()
    # steps take the C++ op from a vector build (AVX-512, AVX2); elsewhere they keep the Python op
    # (its scalar loop was not measured), and the engine must still equal generate
    assert (native is not None) == fast
    if fast:
        monkeypatch.setattr(attention, "_NATIVE", lambda *a: calls.append(a[3][:, ROWS].tolist()) or native(*a))
    cfg = DecodingConfig(max_new_tokens=24, drafts="suffix", draft_budget="all", max_draft_rows=6)
    prompts = [REPETITIVE_PROMPT, REPETITIVE_PROMPT[3:], [5, 6, 7, 8, 9] * 4]
    ids = [engine.add(p, cfg) for p in prompts]
    while engine.has_work:
        engine.step()
    for i, p in zip(ids, prompts):
        assert engine.result(i).output_ids == hf_greedy(model, p, 24)
    if fast:
        assert calls and any(len([r for r in rows if r]) == 3 for rows in calls)  # steps of all three ran it


def test_a_nan_score_gives_nan_like_the_python_op(op):
    """A NaN in one key (or in one query row) is NaN in the rows that see it, for the heads that
    read it, as sdpa gives it (``std::max`` skips a NaN, and the AVX-512 exp clamped it to a finite
    88.7: the row was finite and wrong); every other sequence is bit-equal to the batch without it."""
    seqs = [(1, 37, False), (3, 20, False), (2, 64, True), (1, 50, False)]
    query, key, value, spans, masks, slots = _batch(seqs, seed=7)
    clean = op(query, key, value, spans, masks, slots, 0.17, False, attention.NATIVE_ROWS)
    key[0, 0, spans[0, FIRST] + 5] = float("nan")  # sequence 0, KV head 0: its query heads 0-2
    frag = slots[spans[2, SLOTS] + 9]
    key[0, 1, frag, 3] = float("nan")  # sequence 2 (fragmented), KV head 1: query heads 3-5
    query = query.clone()
    query[0, 4, spans[3, QO]] = float("nan")  # sequence 3's row, query head 4 alone
    want = attention.paged_attention(query, key, value, spans, masks, slots, 0.17, False)
    got = op(query, key, value, spans, masks, slots, 0.17, False, attention.NATIVE_ROWS)
    nan_QH = torch.zeros(got.shape[1:3], dtype=torch.bool)
    nan_QH[0, :3] = True
    nan_QH[4:6, 3:] = True
    nan_QH[6, 4] = True
    assert torch.equal(torch.isnan(want).all(-1)[0], nan_QH) and torch.equal(torch.isnan(want).any(-1)[0], nan_QH)
    assert torch.equal(torch.isnan(got).all(-1)[0], nan_QH) and torch.equal(torch.isnan(got).any(-1)[0], nan_QH)
    ok = ~nan_QH
    assert torch.equal(got[0][ok], clean[0][ok])  # the other sequences' rows and heads: unchanged


def test_non_contiguous_slots(op):
    """Slots given as a strided view: the op reads its own contiguous copy (kept alive for the
    whole call), equal to the contiguous slots' output."""
    seqs = [(1, 64, True), (2, 100, True), (1, 30, False), (3, 200, True)]
    query, key, value, spans, masks, slots = _batch(seqs, seed=11)
    want = op(query, key, value, spans, masks, slots, 0.2, False, attention.NATIVE_ROWS)
    strided = torch.stack([slots, torch.full_like(slots, 10**12)], 1)[:, 0]
    assert not strided.is_contiguous()
    for _ in range(5):
        assert torch.equal(op(query, key, value, spans, masks, strided, 0.2, False, attention.NATIVE_ROWS), want)


def test_an_infinite_key_is_nan_or_hidden_like_the_python_op(op):
    """A key with one infinite element: a +inf score makes its row NaN (exp(inf - inf)), a
    -inf one hides the key, per query head by the sign of its query element, as the Python op."""
    query, key, value, spans, masks, slots = _batch([(1, 37, False), (2, 20, True)], seed=7)
    inf_D = torch.zeros(D)
    inf_D[0] = float("inf")
    key[0, 0, spans[0, FIRST] + 3] = inf_D  # sequence 0, query heads 0-2: +inf or -inf by query[..., 0]'s sign
    want = attention.paged_attention(query, key, value, spans, masks, slots, 0.17, False)
    got = op(query, key, value, spans, masks, slots, 0.17, False, attention.NATIVE_ROWS)
    nan_QH = torch.isnan(want).all(-1)[0]
    assert torch.equal(nan_QH, torch.isnan(want).any(-1)[0]) and 0 < int(nan_QH[0, :3].sum()) < 3  # both signs
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.allclose(got[~torch.isnan(got)], want[~torch.isnan(want)], rtol=1e-5, atol=2e-6)
