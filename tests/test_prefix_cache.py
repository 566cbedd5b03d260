"""Automatic prefix caching in the paged pool (lp.model.paged) and the batch engine
(lp.engine.batch, ``prefix_cache=True``).

A later request whose prompt starts with an earlier one's rows (a chat's next turn: the
same system prompt, the earlier turns and replies) reuses their K/V blocks instead of
computing them; every output stays transformers' greedy ``generate`` of its own prompt,
token for token, and equals a cold engine's. Under pressure the least recently released
cached blocks are evicted, never one a running sequence holds. The engine tests check the
prefix cache's block invariants after every step (tests.test_prefix_blocks.step_checked).
"""

from __future__ import annotations

import random

import pytest

from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine
from lp.model.paged import BlockTable
from lp.model.runner import ModelRunner
from tests.helpers import make_tiny_model, hf_greedy
from tests.test_prefix_blocks import assert_prefix_blocks, step_checked

TREE = dict(drafts="suffix", draft_budget="all", W=2, N=3, G=3, window_policy="always", max_draft_rows=8)
SYSTEM = [(7 * i) % 97 + 3 for i in range(45)]  # 5 blocks of 8 + 5 rows


def _run(engine, prompt, cfg):
    rid = engine.add(prompt, cfg)
    step_checked(engine)  # the prefix cache's block invariants after every step
    return engine.result(rid)


# -- the block table ---------------------------------------------------------------


def test_block_table_hits_refs_and_lru_eviction():
    bt = BlockTable(6, 4, prefix_cache=True)
    a = list(range(100, 113))  # 13 tokens: 3 full blocks
    assert bt.reserve(0, 16, a) == 0 and bt.lookup(a) == []
    bt.lengths[0] = 13
    bt.grow(0, 13)
    bt.register(0, a)
    assert len(bt.by_digest) == 3 and bt.lookup(a) == bt.tables[0][:3]
    assert bt.lookup(a[:12]) == bt.tables[0][:2]  # at most len(prompt) - 1 rows: the last is fed
    other = [1] + a[1:]
    assert bt.lookup(other) == []  # a different first block: the chain misses from the start
    # a second sequence shares the cached prefix while the first still runs
    assert bt.reserve(1, 16, a + [5]) == 12
    shared = bt.tables[1][:3]
    assert shared == bt.tables[0][:3] and all(bt.refs[b] == 2 for b in shared)
    assert bt.lengths[1] == 12 and len(bt.owned[1]) == 4
    bt.release(0)
    assert not bt.evictable and all(bt.refs[b] == 1 for b in shared)  # still held by 1
    bt.release(1)
    assert list(bt.evictable) == shared and len(bt.free) == 3 and bt.available == 6
    # a reservation larger than the free list evicts the least recently released first
    assert bt.can_reserve(20) and bt.cost(20, [], set()) == 5
    bt.reserve(2, 20)
    assert bt.evictions == 2 and list(bt.evictable) == [shared[2]] and bt.lookup(a) == []
    bt.release(2)
    assert bt.available == 6


def test_a_hit_is_copied_into_one_contiguous_run_when_the_pool_has_room():
    """Pool of 16 blocks of 4. A's 3 full blocks are cached (0-2) and B holds 3-4, so a prompt
    hitting A's blocks whose new blocks land after B's would be fragmented: with room, C
    owns one contiguous run instead, its first 3 blocks a copy of the cached ones (``copies``;
    the cached blocks stay registered and evictable, C holds none of them). A round whose
    reservations need the free blocks (D, then E) shares D's hits as before: copying them
    would leave E too few free blocks and evict cached ones. A sequence that leaves drops
    its pending copy."""
    from tests.helpers import assert_block_invariants

    bt = BlockTable(16, 4, prefix_cache=True)
    a = list(range(100, 113))
    bt.reserve(0, 12, a)
    bt.grow(0, 12)
    bt.lengths[0] = 12
    bt.register(0, a)
    bt.reserve(1, 8)  # B: blocks 3-4
    bt.release(0)
    assert bt.tables[1] == [] and bt.owned[1] == [3, 4] and list(bt.evictable) == [0, 1, 2]
    assert bt.reserve(2, 16, a + [7]) == 12  # C: 4 blocks, 3 of them cached
    assert bt.owned[2] == [5, 6, 7, 8] and bt.tables[2] == [5, 6, 7] and bt.first_slot(2) == 20
    assert bt.copies == [(2, [0, 1, 2], [5, 6, 7])]
    assert list(bt.evictable) == [0, 1, 2] and all(bt.refs[b] == 0 for b in (0, 1, 2))
    assert_block_invariants(bt)
    # 7 free blocks; D needs 1 new (+3 to copy its hits), E 4: D's hits are shared
    assert bt.reserve_round([(3, 16, a + [8]), (4, 16, [])]) == [12, 0]
    assert bt.tables[3] == [0, 1, 2] and bt.owned[3][:3] == [0, 1, 2] and len(bt.copies) == 1
    assert all(bt.refs[b] == 1 for b in (0, 1, 2)) and bt.evictions == 0
    assert_block_invariants(bt)
    for seq in (1, 2, 3, 4):
        bt.release(seq)
    assert bt.available == 16 and not bt.copies


def test_a_round_pins_every_hit_before_evicting():
    """Pool of 6 blocks of 4: Y's 3 cached blocks are the least recently released, one more
    cached block after them, 2 free. A round admitting X (3 new blocks: one must be evicted)
    before Y (all 3 hits) fits exactly -- only if X evicts the other block, not Y's."""
    bt = BlockTable(6, 4, prefix_cache=True)
    y, other = list(range(100, 113)), list(range(200, 205))
    for seq, ids in ((0, y), (1, other)):
        bt.reserve(seq, len(ids) - 1, ids)
        bt.grow(seq, len(ids) - 1)
        bt.lengths[seq] = len(ids) - 1
        bt.register(seq, ids)
    bt.release(0)
    bt.release(1)
    assert len(bt.free) == 2 and len(bt.evictable) == 4
    claimed = set()
    assert bt.cost(12, [], claimed) + bt.cost(12, y, claimed) == 6 == bt.available
    assert bt.reserve_round([(2, 12, []), (3, 12, y)]) == [0, 12]
    assert bt.lookup(other) == [] and bt.evictions == 1


def test_admission_counts_cached_blocks(tiny_factory):
    """A request that does not fit a full pool fits once most of its prompt is cached, and
    two waiting requests hitting the same evictable blocks count them once."""
    runner = ModelRunner(tiny_factory("llama"))
    engine = BatchEngine(runner, kv_tokens=96, block_size=8, max_batch=4, prefix_cache=True)
    cfg = DecodingConfig(max_new_tokens=8, W=1, N=2, G=0)
    prompt = SYSTEM + [5, 6]
    first = _run(engine, prompt, cfg)
    assert engine.cache.blocks.evictable and first.stats.cached_tokens == 0
    a, b = engine.add(prompt + [9], cfg), engine.add(prompt + [10], cfg)
    assert engine.admissions() == [a, b]  # 2 x (new blocks) + the 5 shared evictable ones once
    outs = step_checked(engine)
    model = runner.model
    assert outs[a] == hf_greedy(model, prompt + [9], 8) and outs[b] == hf_greedy(model, prompt + [10], 8)
    assert engine.result(a).stats.cached_tokens == 40 and engine.result(b).stats.cached_tokens == 40
    assert engine.blocks_in_use == 0 and engine.cache.blocks.available == engine.cache.blocks.num_blocks


# -- exactness ---------------------------------------------------------------------


@pytest.mark.parametrize("family,attention,quant", [("llama", "sdpa", None), ("gemma3", "sdpa", None),
                                                   ("llama", "eager", None), ("llama", "auto", "int8")],
                         ids=["llama", "gemma3", "eager", "int8_rowexact"])
def test_chat_turns_equal_generate_and_cold(tiny_factory, family, attention, quant):
    """Four turns of a chat over token ids: each turn's prompt is the last prompt, its reply
    and a new user message. Warm: the cached prefix covers all but the newest rows (at
    least the system prompt and the earlier turns); every reply == generate == a cold
    engine's (no prefix cache). int8: the row-exact runner (lp.model.quant's per-row int8
    linears, lp_rowexact attention), whose rows do not depend on the step they ran in, so a
    hit's K/V are the very values a fresh prefill writes; generate runs on the same int8 model."""
    model = tiny_factory(family) if quant is None else make_tiny_model(seed=1)
    runner = ModelRunner(model, attention=attention, quant=quant)  # int8: quantizes the model in place
    assert (runner.attention == "rowexact") == (quant == "int8")
    warm = BatchEngine(runner, kv_tokens=1024, block_size=8, max_batch=4, max_prefill_tokens=16, prefix_cache=True)
    cold = BatchEngine(runner, kv_tokens=1024, block_size=8, max_batch=4, max_prefill_tokens=16)
    rng = random.Random(1)
    prompt = list(SYSTEM)
    for turn in range(4):
        prompt = prompt + [rng.randrange(3, 120) for _ in range(5 + turn)]
        cfg = DecodingConfig(max_new_tokens=12, **TREE)
        w, c = _run(warm, prompt, cfg), _run(cold, prompt, cfg)
        ref = hf_greedy(model, prompt, 12)
        assert w.output_ids == ref, f"turn {turn}: warm {w.output_ids} vs generate {ref}"
        assert c.output_ids == ref and c.stats.cached_tokens == 0
        if turn:
            assert w.stats.cached_tokens >= len(prompt) - 8 - 5 - turn - 12, (turn, w.stats.cached_tokens)
        prompt = prompt + w.output_ids
    assert warm.blocks_in_use == 0


def test_shared_prefix_while_running_and_eviction_under_pressure(tiny_factory):
    """A pool of 14 blocks of 8: requests with the shared system prompt join while others
    hold it (ref counts), then distinct prompts push the cached blocks out (LRU) and the
    system prompt is computed again; every output == generate, nothing leaks."""
    model = tiny_factory("llama")
    runner = ModelRunner(model)
    engine = BatchEngine(runner, kv_tokens=14 * 8, block_size=8, max_batch=3, max_prefill_tokens=16,
                         prefix_cache=True)
    cfg = DecodingConfig(max_new_tokens=10, **TREE)
    rng = random.Random(2)
    prompts = [SYSTEM + [rng.randrange(3, 120) for _ in range(4)] for _ in range(3)]
    prompts += [[rng.randrange(3, 120) for _ in range(50)] for _ in range(2)]  # distinct: evict the system's blocks
    prompts += [SYSTEM + [11, 12]]
    ids, outs = [], {}
    for step in range(400):
        if step in (0, 6, 7) or (step >= 8 and len(ids) < len(prompts) and not engine.waiting):
            ids.append(engine.add(prompts[len(ids)], cfg))
        if not engine.has_work and len(ids) == len(prompts):
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_tokens)
        assert_prefix_blocks(engine)
    assert len(ids) == len(prompts)
    results = [engine.result(i) for i in ids]
    for i, (p, rid, res) in enumerate(zip(prompts, ids, results)):
        ref = hf_greedy(model, p, 10)
        assert outs[rid] == ref and res.output_ids == ref, f"request {i}"
    cached = [r.stats.cached_tokens for r in results]
    assert cached[1] == 40 and cached[2] == 40, cached  # joined while request 0 held the prefix
    assert engine.cache.blocks.evictions > 0, "the distinct prompts should have evicted cached blocks"
    blocks = engine.cache.blocks
    assert engine.blocks_in_use == 0 and blocks.available == blocks.num_blocks
    assert all(r == 0 for r in blocks.refs.values())


def test_eviction_metric_moves_by_the_pool_count():
    from lp.server.metrics import ServerMetrics

    m = ServerMetrics()
    for total in (0, 3, 3, 5):
        m.observe_evictions(total)
    assert m.prefix_evictions._value.get() == 5


def test_requests_arriving_together_compute_a_shared_prompt_once(tiny_factory):
    """Three requests with one prompt (n = 3 choices, or clients sharing a system prompt) added
    at once: the first computes the prompt (fed in chunks); the others wait while it is being
    prefilled and then hit all its full blocks instead of computing them too; an unrelated
    request behind them waits its FIFO turn. Every output == generate; without the cache all
    start together."""
    model = tiny_factory("llama")
    runner = ModelRunner(model)
    cfg = DecodingConfig(max_new_tokens=10, **TREE)
    other = [(5 * i) % 90 + 7 for i in range(20)]
    for cache in (True, False):
        engine = BatchEngine(runner, kv_tokens=1024, block_size=8, max_batch=4, max_prefill_tokens=16,
                             prefix_cache=cache)
        ids = [engine.add(SYSTEM, cfg) for _ in range(3)] + [engine.add(other, cfg)]
        assert engine.admissions() == (ids[:1] if cache else ids)
        step_checked(engine)
        results = [engine.result(i) for i in ids]
        want = hf_greedy(model, SYSTEM, 10)
        assert [r.output_ids for r in results[:3]] == [want] * 3
        assert results[3].output_ids == hf_greedy(model, other, 10)
        want_cached = [0, 40, 40, 0] if cache else [0, 0, 0, 0]
        assert [r.stats.cached_tokens for r in results] == want_cached, cache
