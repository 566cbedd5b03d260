"""Batched lookahead steps (lp.engine.batch) over the paged K/V cache (lp.model.paged).

Every output of a batch equals transformers' greedy ``generate`` of its own prompt,
token for token, while other requests join and leave mid-decode; different settings
share one batch; the K/V bound makes requests wait, never fail; sampling in a batch
keeps the distribution (and the very draws of a one-sequence run with the same seed).
"""

from __future__ import annotations

import pytest
import torch

from lp.engine.batch import BatchEngine, generate_batch
from lp.drafts.budget import AcceptanceModel
from lp.config import DecodingConfig
from lp.engine.decoder import LookaheadDecoder
from lp.drafts.select import Scored, TreeRequest, select_tree, select_trees
from lp.model.runner import ModelRunner
from lp.model.paged import BlockTable
from tests.helpers import REPETITIVE_PROMPT, hf_greedy

PROMPTS = [
    REPETITIVE_PROMPT,
    [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5],
    [50, 51, 52, 53, 50, 51, 52],
    list(range(10, 40)),
    [9, 8, 7, 9, 8, 7, 9, 8, 100, 101, 9, 8],
]
TREE = dict(drafts="suffix", draft_budget="all", W=2, N=3, G=3, window_policy="always", max_draft_rows=8)


def _drain(engine, outs: dict, schedule: dict, until: int = 500):
    """Step the engine; ``schedule[step]`` is a callable run before that step (joins, aborts);
    the block table's invariants after every step."""
    from tests.helpers import assert_block_invariants

    for step in range(until):
        if step in schedule:
            schedule.pop(step)()
            assert_block_invariants(engine.cache.blocks)
        if not engine.has_work and not schedule:
            return step
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_tokens)
        assert_block_invariants(engine.cache.blocks)
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize("family,attention", [("llama", "sdpa"), ("llama", "flex"), ("gemma3", "sdpa"),
                                              ("gemma3", "flex"), ("llama", "sdpa-fragmented"),
                                              ("gemma3", "sdpa-fragmented")])
def test_joins_and_leaves_equal_generate(tiny_factory, monkeypatch, family, attention):
    """A literal schedule: A, B start; C joins at step 2 (prefill in chunks of 16 rows beside
    A and B's decode rows); B leaves at step 4 (abort); D joins at step 5; A, C, D finish
    at different lengths. Every complete output == generate; B's tokens are generate's prefix;
    B's freed blocks are filled with NaN; the block table holds after every step.
    ``sdpa-fragmented``: every sequence's blocks treated as scattered, so the attention
    gathers its keys by slot instead of slicing the pool."""
    if attention == "sdpa-fragmented":
        monkeypatch.setattr(BlockTable, "first_slot", lambda self, seq: None)
        attention = "sdpa"
    model = tiny_factory(family)
    runner = ModelRunner(model, attention=attention)
    engine = BatchEngine(runner, kv_tokens=1024, block_size=8, max_batch=4, max_prefill_tokens=16)
    engine.cache.poison_released()  # B's blocks hold NaN once it leaves: D must never read them
    lens = {"A": 30, "B": 40, "C": 20, "D": 25}
    prompts = {"A": PROMPTS[0], "B": PROMPTS[1], "C": PROMPTS[3], "D": PROMPTS[4]}
    cfgs = {"A": DecodingConfig(max_new_tokens=30, **TREE),
            "B": DecodingConfig(max_new_tokens=40, W=3, N=3, G=3),  # the paper's pool drafts
            "C": DecodingConfig(max_new_tokens=20, **TREE),
            "D": DecodingConfig(max_new_tokens=25, W=1, N=2, G=0)}  # plain one-row steps
    ids, outs = {}, {}

    def join(name):
        return lambda: ids.__setitem__(name, engine.add(prompts[name], cfgs[name]))

    schedule = {0: lambda: (join("A")(), join("B")()), 2: join("C"), 4: lambda: engine.abort(ids["B"]), 5: join("D")}
    _drain(engine, outs, schedule)
    for name in "ACD":
        ref = hf_greedy(model, prompts[name], lens[name])
        assert outs[ids[name]] == ref, name
        res = engine.result(ids[name])
        assert res.output_ids == ref and res.finish_reason == "length"
    b = outs.get(ids["B"], [])
    assert 0 < len(b) < lens["B"] and b == hf_greedy(model, prompts["B"], lens["B"])[: len(b)]
    assert engine.blocks_in_use == 0


def test_mixed_settings_and_sampling_in_one_batch(tiny_factory):
    """Pool drafts, tree drafts, plain steps, eos, and two sampled requests in one batch: the
    greedy ones equal generate, the sampled ones equal their one-sequence runs (same seed)."""
    model = tiny_factory("llama")
    runner = ModelRunner(model)
    sample = dict(W=3, N=3, G=3, do_sample=True, temperature=0.8, top_k=20)
    cfgs = [DecodingConfig(max_new_tokens=32, **TREE),
            DecodingConfig(max_new_tokens=24, W=4, N=4, G=4),
            DecodingConfig(max_new_tokens=16, W=1, N=2, G=0),
            DecodingConfig(max_new_tokens=20, seed=7, **sample),
            DecodingConfig(max_new_tokens=20, seed=8, **sample)]
    ref1 = hf_greedy(model, PROMPTS[1], 24)
    eos = ref1[10]  # stops request 1 early, at its first eos
    results = generate_batch(LookaheadDecoder(runner, cfgs[0]), PROMPTS, eos_token_ids=[eos], configs=cfgs)
    for i in range(3):
        want = hf_greedy(model, PROMPTS[i], cfgs[i].max_new_tokens)
        if eos in want:
            want = want[: want.index(eos) + 1]
        assert results[i].output_ids == want, i
    assert results[1].finish_reason == "stop"
    for i in (3, 4):
        alone = LookaheadDecoder(runner, cfgs[i]).generate(PROMPTS[i], eos_token_ids=[eos])
        assert results[i].output_ids == alone.output_ids, i
    assert results[3].output_ids != results[4].output_ids


def distinct_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` different prompts of random token ids (5 to 30 tokens): a row that read another
    sequence's block, or a stale block of a finished one, would see other K/V."""
    import random

    rng = random.Random(seed)
    prompts = set()
    while len(prompts) < n:
        prompts.add(tuple(rng.randrange(1, 128) for _ in range(rng.randrange(5, 31))))
    return [list(p) for p in sorted(prompts)]


MIXED = [dict(max_new_tokens=20, **TREE), dict(max_new_tokens=16, W=3, N=3, G=3),  # tree drafts; the paper's pool
         dict(max_new_tokens=12, W=1, N=2, G=0), dict(max_new_tokens=18, W=4, N=4, G=4)]  # plain steps; a wider pool


@pytest.mark.parametrize("requests,room", [(6, 2), (64, 8)])
def test_kv_bound_makes_requests_wait(tiny_factory, requests, room):
    """K/V room for ``room`` worst-case requests, ``requests`` queued with distinct prompts and
    mixed settings (max_batch twice the room, so the pool binds): all complete exactly, none
    lost; after every step the block table holds (reserved runs pairwise disjoint and off
    the free list, free + reserved == every block) and the pool never grows; every block
    freed is filled with NaN (PagedCache.poison_released), so a step that read a stale or
    foreign block would not equal generate; every block is back at the end; a request that
    can never fit is refused at once."""
    from tests.helpers import assert_block_invariants

    model = tiny_factory("llama")
    runner = ModelRunner(model)
    prompts = distinct_prompts(requests)
    cfgs = [DecodingConfig(**MIXED[i % len(MIXED)]) for i in range(requests)]
    need = max(len(p) + c.max_new_tokens + LookaheadDecoder(runner, c).max_step_rows() for p, c in zip(prompts, cfgs))
    engine = BatchEngine(runner, kv_tokens=room * (need + 8), block_size=8, max_batch=2 * room)
    engine.cache.poison_released()
    ids = [engine.add(p, c) for p, c in zip(prompts, cfgs)]
    outs, most, released = {}, 0, 0  # released: requests finished (their blocks freed)
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_tokens)
            released += o.finished
        most = max(most, len(engine.running))
        assert_block_invariants(engine.cache.blocks)
        assert all(k.shape[1] == engine.cache.kv_tokens for k in engine.cache.keys + engine.cache.values)
    # the pool, not max_batch, bounds the batch: room for the largest worst case `room`
    # times (smaller ones fit a few more)
    assert room <= most < 2 * room
    assert sorted(outs) == sorted(ids)
    for rid, p, c in zip(ids, prompts, cfgs):
        ref = hf_greedy(model, p, c.max_new_tokens)
        assert outs[rid] == ref, rid
        assert engine.result(rid).output_ids == ref
    assert engine.blocks_in_use == 0 and not engine.cache.blocks.reserved
    assert_block_invariants(engine.cache.blocks)
    assert torch.isnan(engine.cache.keys[0]).any() and released == requests  # the freed blocks hold NaN
    if engine.cache.kv_tokens < 297:  # a prompt within the tiny model's 512 positions that can never fit
        with pytest.raises(ValueError, match="kv_tokens"):
            engine.add(list(range(1, 100)) * 3, cfgs[0])


def test_block_table_literal():
    t = BlockTable(num_blocks=4, block_size=2)
    t.reserve(7, 5)  # 3 blocks booked
    assert not t.can_reserve(3) and t.can_reserve(2)
    t.grow(7, 3)
    assert t.tables[7] == [0, 1] and t.slots(7, 0, 3) == [0, 1, 2]
    t.shrink(7, 1)
    assert t.tables[7] == [0] and t.blocks_in_use == 1
    t.release(7)
    assert t.blocks_in_use == 0 and t.can_reserve(8)


def test_block_table_contiguous_runs_and_fragmentation():
    """Each reservation owns a contiguous run when one exists (first fit); when the free
    blocks are scattered it takes the lowest ones and has no first slot."""
    t = BlockTable(num_blocks=6, block_size=4)
    for seq in (1, 2, 3):
        t.reserve(seq, 8)
    assert t.owned == {1: [0, 1], 2: [2, 3], 3: [4, 5]} and t.first_slot(2) == 8
    t.release(1)
    t.release(3)
    t.reserve(4, 12)  # 3 blocks, free {0, 1, 4, 5}: no run of 3
    assert t.owned[4] == [0, 1, 4] and t.first_slot(4) is None
    t.grow(4, 9)
    assert t.slots(4, 6, 9) == [6, 7, 16]
    t.release(4)
    t.reserve(5, 8)  # first fit: blocks 0-1 again
    assert t.owned[5] == [0, 1] and t.first_slot(5) == 0


def test_batch_budget_of_one_is_the_one_sequence_budget():
    """select_trees with one request prices and cuts like select_tree; in a batch, the
    same drafts compete with the others' base rows and shrink."""
    a = AcceptanceModel()
    drafts = [Scored((5, 6, 7, 8, 9, 10), 6, 1.0), Scored((5, 9), 1, 0.5), Scored((4,), 0, 1.0)]
    steep = [(1, 0.055), (2, 0.085), (4, 0.095), (16, 0.130), (32, 0.184), (64, 0.40)]
    one = select_tree(drafts, a, base=1, curve=steep, cap=16)
    assert select_trees([TreeRequest(drafts, a, 1, 16)], steep) == [one] and one
    many = select_trees([TreeRequest(drafts, a, 1, 16)] * 8, steep, fixed_rows=30)
    assert sum(len(t) for t in many) < 8 * len(one)


@pytest.mark.slow
def test_smollm2_four_prompts_in_one_batch(smollm2, smollm2_runner):
    """4 real prompts (code, chat, math) in one batch, default settings, each == generate."""
    from tests.test_smollm2 import assert_equal_or_tie, eos_ids, prompt_ids

    model, tokenizer = smollm2
    new = 32
    keys = [("code", 0), ("code", 1), ("chat", 0), ("math", 0)]
    prompts = [prompt_ids(tokenizer, k, i) for k, i in keys]
    dec = LookaheadDecoder(smollm2_runner, DecodingConfig(max_new_tokens=new))
    results = generate_batch(dec, prompts, eos_token_ids=eos_ids(model))
    for (k, i), p, res in zip(keys, prompts, results):
        ref = hf_greedy(model, p, new, eos_token_id=eos_ids(model))
        assert_equal_or_tie(model, p, res.output_ids, ref, f"batch {k}{i}")
    assert any(sum(r.stats.accept_hist[2:]) for r in results), "drafts were accepted in the batch"


def test_sampling_in_a_batch_of_four_matches_generate():
    """Sampled requests in batches of 4 with 4 different prompts of one length (seeds i)
    draw every token with its exact probability given its own prompt (the conditionals of
    tests.helpers.exact_next_probs, transformers' own warpers): a row that read another
    sequence's keys would draw from that prompt's distribution."""
    from tests.helpers import conditional_fit, exact_next_probs, fit_verdict, make_tiny_model

    model = make_tiny_model("llama", vocab=12, initializer_range=0.2)
    heads = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 3, 7, 2, 9], [4, 4, 8, 1, 6]]
    prompts = [h + hf_greedy(model, h, 20) for h in heads]  # repetitive: drafts get accepted
    runner = ModelRunner(model)
    n, kw = 1000, dict(temperature=0.9)
    dec = LookaheadDecoder(runner, DecodingConfig(W=3, N=4, G=5, max_new_tokens=3, do_sample=True))
    draws, multi = {i: [] for i in range(4)}, 0
    for start in range(0, n, 4):
        cfgs = [DecodingConfig(W=3, N=4, G=5, max_new_tokens=3, do_sample=True, seed=s, **kw)
                for s in range(start, start + 4)]
        order = [(start // 4 + j) % 4 for j in range(4)]  # each prompt in every slot of the batch
        for i, res in zip(order, generate_batch(dec, [prompts[i] for i in order], configs=cfgs)):
            draws[i].append(res.output_ids)
            multi += sum(res.stats.accept_hist[2:])
    assert multi > 0.1 * n, "the verifier accepted multi-token runs"
    rows = [row for i, p in enumerate(prompts) for row in conditional_fit(draws[i], exact_next_probs(model, p, 3, **kw))]
    ok, report = fit_verdict(rows)
    assert ok, report


@pytest.mark.parametrize("policy,static_batch", [("none", 4), ("static", 1), ("static", 3)])
def test_draft_policies_equal_generate(tiny_factory, policy, static_batch):
    """The baselines the bench compares the batch budget with: ``none`` steps one row per
    decoding sequence; ``static`` drafts only while at most ``static_batch`` sequences decode.
    Outputs == generate either way."""
    model = tiny_factory("llama")
    engine = BatchEngine(ModelRunner(model), kv_tokens=2048, block_size=8, max_batch=3, draft_policy=policy,
                         static_batch=static_batch)
    cfg = DecodingConfig(max_new_tokens=24, **{**TREE, "window_policy": "with_candidates"})
    ids = [engine.add(p, cfg) for p in PROMPTS[:3]]
    rows = []
    while engine.has_work:
        before = len(engine.running)
        engine.step()
        rows.append((engine.last_rows, before))
    for i, p in zip(ids, PROMPTS[:3]):
        assert engine.result(i).output_ids == hf_greedy(model, p, 24)
    steps = rows[1:]  # after the prefill
    if policy == "none" or static_batch == 1:
        assert all(r == n for r, n in steps), steps  # no draft rows: one per decoding sequence
    else:
        assert any(r > 3 for r, _ in steps), steps  # three sequences, at most 3: they draft


def test_draft_policy_refused():
    with pytest.raises(ValueError, match="draft_policy"):
        BatchEngine.__init__(object.__new__(BatchEngine), _FakeRunner(), 64, draft_policy="sometimes")
    with pytest.raises(ValueError, match="static_batch"):
        BatchEngine.__init__(object.__new__(BatchEngine), _FakeRunner(), 64, static_batch=0)


class _FakeRunner:
    attention = "sdpa"
    _static = None


def test_kv_pool_from_a_memory_fraction():
    """server.kv_memory_fraction: bytes per slot from the config (SmolLM2's shape: 30 layers,
    3 key/value heads of 64, K and V), refused off CUDA and outside (0, 1]."""
    import torch
    from transformers import LlamaConfig

    from lp.model.paged import kv_slot_bytes, kv_tokens_for_memory

    cfg = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_slot_bytes(cfg, torch.float32) == 30 * 2 * 3 * 64 * 4
    assert kv_slot_bytes(cfg, torch.bfloat16) == 30 * 2 * 3 * 64 * 2
    with pytest.raises(ValueError, match="server.kv_tokens"):
        kv_tokens_for_memory(cfg, torch.float32, torch.device("cpu"), 0.5)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kv_tokens_for_memory(cfg, torch.float32, torch.device("cpu"), 1.5)
    from lp.server.config import ServerConfig

    with pytest.raises(ValueError, match="server.kv_memory_fraction"):
        ServerConfig(kv_memory_fraction=0).validate()
    assert ServerConfig(kv_memory_fraction=0.9).validate().kv_memory_fraction == 0.9


def test_spec_decode_counters_literal_steps():
    """lp.engine.batch's per-step counters (vLLM's spec-decode metrics): a step with candidates
    of lengths 3 and 2 that publishes 3 tokens accepted 2 (positions 0 and 1); one with no
    candidates is no draft and accepts nothing; one publishing 1 token of a 4-long candidate
    is a draft that accepted none."""
    from lp.engine.batch import _count_drafts
    from lp.engine.decoder import GenerationStats

    st = GenerationStats()
    _count_drafts(st, [(5, 6, 7), (5, 9)], 3)
    _count_drafts(st, [], 1)
    _count_drafts(st, [(1, 2, 3, 4)], 1)
    _count_drafts(st, [(8,)], 2)
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (3, 8, 3)
    assert st.accepted_per_pos == [2, 1]


def test_compiled_batched_step_equals_generate(tiny_factory):
    """model.compile=on under continuous batching: the batched step under torch.compile (the
    attention one opaque lp::paged_attention call per layer, where every sequence's rows and keys
    are given by tensors) decodes every sequence exactly like generate while sequences join and
    leave, with no graph break, two graphs (one for one-row steps, one dynamic graph for every
    other; the first step, which allocates the pool, runs eager), and a second batch of other
    sizes compiles nothing new."""
    import torch._dynamo

    model = tiny_factory("llama")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    from lp.kernels.linears import bf16_packs

    screen = bf16_packs()  # the bf16 greedy screen where oneDNN packs bf16 (not on a plain AVX2 CPU)
    runner = ModelRunner(model, small_rows="off", linears="packed", compile="on", head="screen" if screen else "exact")
    calls = runner.head_screen.calls if screen else 0  # kept on the (shared) model
    engine = BatchEngine(runner, kv_tokens=1024, block_size=8, max_batch=4, max_prefill_tokens=16)
    cfgs = {"A": DecodingConfig(max_new_tokens=30, **TREE), "B": DecodingConfig(max_new_tokens=40, W=3, N=3, G=3),
            "C": DecodingConfig(max_new_tokens=20, **TREE), "D": DecodingConfig(max_new_tokens=25, W=1, N=2, G=0)}
    prompts = {"A": PROMPTS[0], "B": PROMPTS[1], "C": PROMPTS[3], "D": PROMPTS[4]}
    ids, outs = {}, {}

    def join(name):
        return lambda: ids.__setitem__(name, engine.add(prompts[name], cfgs[name]))

    _drain(engine, outs, {0: lambda: (join("A")(), join("B")()), 2: join("C"), 5: join("D")})
    for name in "ABCD":
        assert outs[ids[name]] == hf_greedy(model, prompts[name], cfgs[name].max_new_tokens), name
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["calls_captured"] > 0, "the batched step never ran compiled"
    assert not screen or runner.head_screen.calls > calls, "the compiled head never ran the greedy screen (lp.kernels.head)"
    assert stats["unique_graphs"] <= 2, dict(stats)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    graphs = stats["unique_graphs"]
    ids, outs = {}, {}
    _drain(engine, outs, {0: lambda: (join("C")(), join("D")()), 3: join("A")})
    for name in "ACD":
        assert outs[ids[name]] == hf_greedy(model, prompts[name], cfgs[name].max_new_tokens), name
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "another batch recompiled"


def test_two_compiled_models_of_one_class_each_run_their_own(tiny_factory):
    """The compiled step drops dynamo's guards on modules and parameters (lp.model.runner), so
    nothing in a graph's guards tells two models of one class apart; each runner compiles its
    own copy of the forward's code (``_own_forward``), so the second model never runs the first
    one's graph. The two models here share even lp's kernel switch (one ``SmallRows``: the
    global guard on it, which told the models of this test apart before, is then the same), and
    differ only in what the dropped guards would catch: their weights (and packed copies) and
    the epsilon of their norms. Each decodes == generate; with one code object for both
    (planted), the second model's steps ran the first one's graph (its weights, its epsilon) on
    the second one's cache: from its second token on, neither model's tokens, and this failed."""
    import copy

    import torch._dynamo

    torch._dynamo.reset()
    models = [copy.deepcopy(tiny_factory("llama")), copy.deepcopy(tiny_factory("llama", seed=3, rms_norm_eps=0.3))]
    first = ModelRunner(models[0], small_rows="off", linears="packed", compile="on")
    models[1]._lp_small_rows = models[0]._lp_small_rows  # kernels.install keeps a live switch it finds
    second = ModelRunner(models[1], small_rows="off", linears="packed", compile="on")
    assert second._switch is first._switch
    cfg = DecodingConfig(max_new_tokens=12, mode="ar")  # one-row steps: one graph a runner
    for model, runner in zip(models, (first, second)):
        engine = BatchEngine(runner, kv_tokens=256, block_size=8, max_batch=1)
        rid = engine.add(PROMPTS[0], cfg)
        while engine.has_work:
            engine.step()
        assert engine.result(rid).output_ids == hf_greedy(model, PROMPTS[0], 12)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > 0, "the steps never ran compiled"
    assert first._traced.__func__.__code__ is not second._traced.__func__.__code__
    assert hf_greedy(models[0], PROMPTS[0], 12) != hf_greedy(models[1], PROMPTS[0], 12)


def test_ar_mode_in_a_batch_is_one_token_a_step(tiny_factory):
    """decoding.mode=ar beside a drafting request: both equal generate, the ar one publishes
    exactly one token a step (no drafts, no window); mode=hf has no batched engine."""
    model = tiny_factory("llama")
    dec = LookaheadDecoder(ModelRunner(model), DecodingConfig(max_new_tokens=20))
    cfgs = [DecodingConfig(max_new_tokens=20, mode="ar"), DecodingConfig(max_new_tokens=20, **TREE)]
    ar, tree = generate_batch(dec, [REPETITIVE_PROMPT, REPETITIVE_PROMPT], configs=cfgs)
    want = hf_greedy(model, REPETITIVE_PROMPT, 20)
    assert ar.output_ids == want and tree.output_ids == want
    assert ar.stats.steps == 20 and tree.stats.steps < 20  # the repetitive prompt: drafts land
    with pytest.raises(ValueError, match="decoding.mode must be 'lookahead' or 'ar'"):
        generate_batch(dec, [REPETITIVE_PROMPT], configs=[DecodingConfig(max_new_tokens=4, mode="hf")])


@pytest.mark.parametrize("draft_s", [0.0, 1.0])
def test_batch_cost_prices_a_sequence_that_starts_drafting(tiny_factory, draft_s):
    """The joint budget adds the batched step's own costs (``BatchCost``) to t(rows): on a
    flat curve three repetitive sequences draft; with a draft cost of a second per drafting
    sequence none does (one row per sequence every step: the window rides along only with
    drafts). Outputs == generate either way."""
    from lp.drafts.select import BatchCost

    model = tiny_factory("llama")
    flat = [(1, 0.010), (2, 0.0101), (64, 0.0102)]
    engine = BatchEngine(ModelRunner(model), kv_tokens=2048, block_size=8, max_batch=3, tq_curve=flat,
                         batch_cost=BatchCost(seq_s=0.001, draft_s=draft_s))
    cfg = DecodingConfig(max_new_tokens=24, **{**TREE, "draft_budget": "auto", "window_policy": "with_candidates"})
    prompts = [REPETITIVE_PROMPT, REPETITIVE_PROMPT[3:], REPETITIVE_PROMPT[5:]]
    ids = [engine.add(p, cfg) for p in prompts]
    rows = []
    while engine.has_work:
        before = len(engine.running)
        engine.step()
        rows.append((engine.last_rows, before))
    for i, p in zip(ids, prompts):
        assert engine.result(i).output_ids == hf_greedy(model, p, 24)
    steps = rows[1:]  # after the prefill
    if draft_s:
        assert all(r == n for r, n in steps), steps
    else:
        assert any(r > n for r, n in steps), steps


def test_batch_step_cost_is_measured_once_and_cached(tiny_factory, monkeypatch, tmp_path):
    """lp.engine.batch_cost: a first call measures (non-negative seconds) and writes its own
    file beside the t(Q) one; a second call reads it back without measuring; once the t(Q)
    file is newer (its curve measured again), the next call measures again."""
    import json
    import os

    from lp.engine import batch_cost
    from lp.model.calibrate import cache_path

    monkeypatch.setenv("LP_CACHE", str(tmp_path))
    runner = ModelRunner(tiny_factory("llama"))
    got = batch_cost.batch_step_cost(runner, rounds=1)
    assert got.seq_s >= 0 and got.draft_s >= 0
    path = batch_cost.cache_path(runner)
    assert path.is_file() and path != cache_path(runner) and path.parent == cache_path(runner).parent
    monkeypatch.setattr(batch_cost, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert batch_cost.batch_step_cost(runner) == got
    curve = cache_path(runner)
    curve.write_text(json.dumps({"curve": [[1, 0.001]], "small_rows": []}))
    os.utime(curve, (path.stat().st_mtime + 10,) * 2)
    calls = []
    monkeypatch.setattr(batch_cost, "measure", lambda *a, **k: calls.append(1) or got)
    assert batch_cost.batch_step_cost(runner) == got and calls == [1]


def test_warm_allocates_the_pool_and_leaves_nothing_behind(tiny_factory):
    """lp.serve's start-up step (BatchEngine.warm): the paged pool exists afterwards, and the
    engine is as it was: no blocks in use, no result, nothing in the draft store, no prefix
    block registered; the next requests still equal generate; a second call runs nothing."""
    from lp.drafts.suffix import DraftStore

    model = tiny_factory("llama")
    store = DraftStore(4096)
    engine = BatchEngine(ModelRunner(model), kv_tokens=512, block_size=8, max_batch=2, draft_store=store,
                         prefix_cache=True)
    assert not engine.cache.keys
    assert engine.warm() is True
    assert len(engine.cache.keys) == model.config.num_hidden_layers
    assert engine.blocks_in_use == 0 and not engine.has_work and not engine._results
    assert len(store) == 0 and not engine.cache.blocks.by_digest
    assert len(engine.cache.blocks.free) == engine.cache.blocks.num_blocks
    assert engine.warm() is False
    cfg = DecodingConfig(max_new_tokens=12, **TREE)
    ids = [engine.add(p, cfg) for p in PROMPTS[:2]]
    outs = {}
    _drain(engine, outs, {})
    for rid, prompt in zip(ids, PROMPTS[:2]):
        assert outs[rid] == hf_greedy(model, prompt, 12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeroed_pool_memory_is_zero_and_writable(dtype):
    """lp.model.paged.zeroed: a large CPU tensor from an anonymous mapping (zero pages on first
    touch) reads as zeros, takes writes in place, and outlives every other reference."""
    import gc

    from lp.model.paged import zeroed

    with torch.inference_mode():  # as the pool is made, inside a forward
        big = zeroed((3, 4096, 64), dtype, "cpu")
        small = zeroed((2, 3), dtype, "cpu")
        gc.collect()
        assert big.shape == (3, 4096, 64) and big.dtype == dtype and big.is_contiguous()
        assert not big.any() and not small.any() and small.shape == (2, 3)
        big.index_copy_(1, torch.tensor([7, 4095]), torch.ones(3, 2, 64, dtype=dtype))
        assert big.sum().item() == 3 * 2 * 64 and big[:, 8].abs().sum().item() == 0
