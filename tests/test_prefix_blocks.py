"""Prefix caching's block bookkeeping under the cases a strict read found untested (issue 38):
a block's digest must encode its position, an evicted block must never be hit again, n > 1
sequences of one prompt under a pool too small for them all, and aborts of a sequence whose
blocks others share or whose prefill others wait on.

Contract of these tests: every output equals transformers' greedy ``generate`` of its own
prompt (sampled ones: a cold engine's, no prefix cache, same seed), the hit counts are the
exact rows that should be reused, and ``assert_prefix_blocks`` holds after every engine step:
each registered block's reference count equals the number of block tables holding it, the
free list is disjoint from every used, held or cached block, every digest-table entry points
to a block that is held or cached (evictable) and registered under that very digest, and a
table holding a registered block at index i holds exactly the tokens of that block's chain
digest there. When nothing runs, every block is free or evictable with no reference left.
Freed blocks are filled with NaN (``PagedCache.poison_released``), so a step that reads a
block it does not own shows in its output. ``step_checked`` is what the prefix tests
(here and in tests/test_prefix_cache.py) step the engine with.
"""

from __future__ import annotations

from collections import Counter

import pytest

from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine
from lp.model.paged import blocks_for
from lp.model.runner import ModelRunner
from tests.helpers import assert_block_invariants, hf_greedy

BS = 8
TREE = dict(drafts="suffix", draft_budget="all", W=2, N=3, G=3, window_policy="always", max_draft_rows=8)
SYSTEM = [(7 * i) % 97 + 3 for i in range(45)]  # 5 full blocks of 8 + 5 rows


def assert_prefix_blocks(engine) -> None:
    """The prefix cache's invariants (module doc), on top of tests.helpers'
    ``assert_block_invariants`` (reserved runs disjoint, nothing leaked or invented)."""
    blocks = engine.cache.blocks
    assert_block_invariants(blocks)
    in_tables = Counter(b for table in blocks.tables.values() for b in table)
    for b, d in blocks.digest_of.items():
        assert blocks.refs[b] == in_tables[b], f"block {b}: {blocks.refs[b]} references, {in_tables[b]} tables hold it"
    used = set(in_tables) | {b for run in blocks.owned.values() for b in run} | set(blocks.evictable)
    assert not used & blocks.free, f"used or cached blocks on the free list: {sorted(used & blocks.free)}"
    for d, b in blocks.by_digest.items():
        assert b not in blocks.free, f"digest entry points to free block {b}"
        assert blocks.digest_of.get(b) == d, f"digest entry of block {b} is not its registered digest"
        assert blocks.refs[b] > 0 or b in blocks.evictable, f"registered block {b} neither held nor cached"
    running = {r.id: r for r in engine.running}
    for seq, table in blocks.tables.items():
        tokens = running[seq].run.tokens
        chain = list(blocks.chain(tokens, min(blocks.lengths[seq], len(tokens)) // blocks.block_size))
        for i, b in enumerate(table[: len(chain)]):
            if b in blocks.digest_of:
                assert blocks.digest_of[b] == chain[i], f"sequence {seq} holds block {b} at {i} under other tokens"
    if not engine.running:
        assert not blocks.tables and all(r == 0 for r in blocks.refs.values()), blocks.refs
        assert blocks.available == blocks.num_blocks


def step_checked(engine, outs: dict | None = None, schedule: dict | None = None, until: int = 600) -> dict:
    """Step until drained; ``schedule[step]``: a callable run before that step (joins,
    aborts); ``assert_prefix_blocks`` after each. Returns {request id: streamed tokens}."""
    outs = {} if outs is None else outs
    schedule = dict(schedule or {})
    for step in range(until):
        if step in schedule:
            schedule.pop(step)()
            assert_prefix_blocks(engine)
        if not engine.has_work and not schedule:
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_tokens)
        assert_prefix_blocks(engine)
    raise AssertionError("engine did not drain")


def _engine(model, kv_tokens: int, **kw) -> BatchEngine:
    engine = BatchEngine(ModelRunner(model), kv_tokens=kv_tokens, block_size=BS, prefix_cache=True,
                         **dict(dict(max_batch=4, max_prefill_tokens=16), **kw))
    engine.cache.poison_released()
    return engine


def _run(engine, prompt, cfg):
    rid = engine.add(prompt, cfg)
    outs = step_checked(engine)
    res = engine.result(rid)
    assert outs[rid] == res.output_ids
    return res


def test_a_block_seen_at_another_position_is_no_hit(tiny_factory):
    """P1 = X Y t: its blocks X (rows 0-7) and Y (rows 8-15) are cached. P2 = Y Z u holds
    Y's tokens at rows 0-7: its K/V there (other positions, no X before it) is not P1's, so
    P2 hits nothing; P3 = X Y v hits both blocks, P4 = X Z w one. Every output == generate.
    (A digest of a block's own ids alone would hand P2 P1's row 8-15 K/V.)"""
    model = tiny_factory("llama")
    engine = _engine(model, 512)
    cfg = DecodingConfig(max_new_tokens=10, **TREE)
    X, Y, Z = list(range(10, 18)), [60, 61, 62, 63, 64, 65, 66, 67], [90, 3, 91, 4, 92, 5, 93, 6]
    cases = [(X + Y + [20, 21, 22], 0), (Y + Z + [23, 24], 0), (X + Y + [25, 26], 16), (X + Z + [27], 8)]
    for prompt, hit in cases:
        res = _run(engine, prompt, cfg)
        assert res.output_ids == hf_greedy(model, prompt, 10), prompt
        assert res.stats.cached_tokens == hit, (prompt, res.stats.cached_tokens, hit)


def test_an_evicted_block_is_never_hit_again(tiny_factory):
    """P's 4 full blocks (27 prompt rows + 7 committed new ones: 34) are cached, then Q (no shared prefix) needs every block of the pool:
    P's blocks are evicted and Q's rows written into them. P again hits nothing (its
    blocks hold Q's K/V now) and == generate; Q again hits its own 5 cached blocks."""
    model = tiny_factory("llama")
    cfg = DecodingConfig(max_new_tokens=8, W=2, N=3, G=2)
    P = [(5 * i) % 90 + 7 for i in range(27)]
    Q = [(11 * i) % 100 + 13 for i in range(44)]
    probe = _engine(model, 1024)
    need_q = probe.check(Q, cfg)[1]
    engine = _engine(model, blocks_for(need_q, BS) * BS)  # Q's worst case is the whole pool
    first = _run(engine, P, cfg)
    blocks = engine.cache.blocks
    assert len(blocks.evictable) == 4 and blocks.evictions == 0 and first.stats.cached_tokens == 0
    q = _run(engine, Q, cfg)
    assert blocks.evictions == 4 and q.output_ids == hf_greedy(model, Q, 8)
    again = _run(engine, P, cfg)
    assert again.output_ids == first.output_ids == hf_greedy(model, P, 8)
    assert again.stats.cached_tokens == 0, "hit an evicted block"


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_n_choices_of_one_prompt_under_pressure(tiny_factory, sample):
    """n = 5 choices of one prompt (3 at once, 2 more later) and a distinct request between
    them, in a pool of 17 blocks: one worst case (11 blocks) plus one choice sharing its 5
    prompt blocks (6 new). They wait, share the prompt's blocks while others decode, and the
    distinct request's reservation evicts cached blocks (LRU: the released decode blocks
    first, so the prompt's stay). Greedy: every choice == generate; sampled (seeds 0-4):
    every choice == a cold engine's (no prefix cache, a pool for all at once). The prompt is
    computed once: every later choice hits its 5 full blocks."""
    model = tiny_factory("llama")
    other = [(3 * i) % 100 + 11 for i in range(30)]
    cfgs = [DecodingConfig(max_new_tokens=12, **TREE, **(dict(do_sample=True, temperature=0.9, seed=s)
                                                         if sample else {})) for s in range(5)]
    greedy = DecodingConfig(max_new_tokens=12, **TREE)
    engine = _engine(model, 17 * BS)
    assert blocks_for(engine.check(SYSTEM, cfgs[0])[1], BS) == 11 and blocks_for(engine.check(other, greedy)[1], BS) == 9
    ids = [engine.add(SYSTEM, c) for c in cfgs[:3]]
    schedule = {4: lambda: ids.append(engine.add(other, greedy)),
                9: lambda: ids.extend(engine.add(SYSTEM, c) for c in cfgs[3:])}
    outs = step_checked(engine, schedule=schedule)
    results = {rid: engine.result(rid) for rid in ids}
    choices = [ids[i] for i in (0, 1, 2, 4, 5)]
    if sample:
        cold = BatchEngine(ModelRunner(model), kv_tokens=2048, block_size=BS, max_batch=8, max_prefill_tokens=16)
        cold_ids = [cold.add(SYSTEM, c) for c in cfgs]
        step_checked(cold)
        want = [cold.result(i).output_ids for i in cold_ids]
        assert len({tuple(w) for w in want}) == 5  # the seeds really differ
    else:
        want = [hf_greedy(model, SYSTEM, 12)] * 5
    assert [results[r].output_ids for r in choices] == want
    assert [outs[r] for r in choices] == want
    assert results[ids[3]].output_ids == hf_greedy(model, other, 12)
    assert [results[r].stats.cached_tokens for r in choices] == [0, 40, 40, 40, 40]
    assert results[ids[3]].stats.cached_tokens == 0
    assert engine.cache.blocks.evictions > 0, "no pressure"


def test_abort_of_a_sequence_whose_blocks_others_share(tiny_factory):
    """A computes the system prompt; B and C join while A decodes and share its 5 blocks; A is
    aborted mid-decode, then B: C (still sharing them) and D (joining after) == generate,
    the shared blocks stay registered until the last holder leaves, then every reference is
    gone and the whole pool is free or evictable."""
    model = tiny_factory("llama")
    cfg = DecodingConfig(max_new_tokens=16, **TREE)
    prompts = {"A": SYSTEM + [1, 2], "B": SYSTEM + [3], "C": SYSTEM + [4, 5, 6], "D": SYSTEM + [7]}
    # a pool where B and C fit beside A only by sharing its 5 blocks (copying them into runs of
    # their own would need 10 more): A 12 blocks, B and C 7 new each, 2 to spare
    need = {k: blocks_for(_engine(model, 1024).check(p, cfg)[1], BS) for k, p in prompts.items()}
    assert need == {"A": 12, "B": 12, "C": 12, "D": 12}, need
    engine = _engine(model, (12 + 7 + 7 + 2) * BS)
    ids = {}
    blocks = engine.cache.blocks

    def abort(name, holders):
        assert engine.abort(ids[name])
        shared = blocks.tables[ids["C"]][:5]
        assert shared == blocks.owned[ids["C"]][:5] and all(b in blocks.digest_of for b in shared)
        assert all(blocks.refs[b] == holders for b in shared), (name, [blocks.refs[b] for b in shared])

    schedule = {0: lambda: ids.__setitem__("A", engine.add(prompts["A"], cfg)),
                5: lambda: ids.update(B=engine.add(prompts["B"], cfg), C=engine.add(prompts["C"], cfg)),
                7: lambda: abort("A", 2), 8: lambda: abort("B", 1),
                9: lambda: ids.__setitem__("D", engine.add(prompts["D"], cfg))}
    outs = step_checked(engine, schedule=schedule)
    for name in ("C", "D"):
        res = engine.result(ids[name])
        assert res.output_ids == outs[ids[name]] == hf_greedy(model, prompts[name], 16), name
        assert res.stats.cached_tokens == 40, name
    for name in ("A", "B"):
        res = engine.result(ids[name])
        assert res.finish_reason == "cancelled" and outs.get(ids[name], []) == res.output_ids, name
        assert res.output_ids == hf_greedy(model, prompts[name], 16)[: len(res.output_ids)], name
    assert sorted(blocks.evictable) and all(r == 0 for r in blocks.refs.values())


def test_abort_of_a_prefill_others_wait_on(tiny_factory):
    """Three requests of one prompt arrive together: A prefills it in chunks of 16 rows, B and
    C wait to hit its blocks. A is aborted after its first chunk (2 blocks registered): B and
    C are admitted, B hits those 2 blocks and computes the rest, C waits for B and then hits
    all 5. Both == generate; nothing is left referenced."""
    model = tiny_factory("llama")
    engine = _engine(model, 1024)
    cfg = DecodingConfig(max_new_tokens=10, **TREE)
    ids = [engine.add(SYSTEM, cfg) for _ in range(3)]
    assert engine.admissions() == ids[:1]
    schedule = {1: lambda: engine.abort(ids[0])}
    outs = step_checked(engine, schedule=schedule)
    a, b, c = (engine.result(i) for i in ids)
    assert a.finish_reason == "cancelled" and a.output_ids == [] and ids[0] not in outs
    want = hf_greedy(model, SYSTEM, 10)
    assert b.output_ids == c.output_ids == want
    assert (b.stats.cached_tokens, c.stats.cached_tokens) == (16, 40)
