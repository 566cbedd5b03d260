"""Batched lookahead steps over a paged K/V cache: the engine a server drives.

Contract: ``BatchEngine(runner, kv_tokens)`` holds many sequences at once. ``add`` queues
a request with its own ``DecodingConfig``, eos ids and tokenizer (a ValueError at once
if it can never fit the K/V pool); ``step`` admits waiting requests FIFO while
``max_batch`` and the K/V reservation allow, runs ONE forward over every running
sequence's rows, and returns each sequence's newly verified tokens and whether it
finished; ``abort`` drops a request and frees its blocks. Token ids only.

Every request keeps the state of a one-sequence run (lp.engine.decoder's ``_Run``: suffix
index, window and pool, acceptance model, stop rules, sampling seed) and its own
``LookaheadDecoder`` for the stages that are per sequence (propose, lay out, verify,
publish, collect). What is shared is the step:

    admit     FIFO; a request waits until its worst case (prompt + max_new_tokens + its
              largest step) can be reserved in the paged cache (lp.model.paged); with
              ``prefix_cache`` the longest cached block-aligned prefix of its prompt is
              reused (those rows start committed, only the rest is fed) and only the
              blocks past it are booked, and a request whose next prompt block another
              request is prefilling now waits for it (n > 1 choices, clients sharing a
              system prompt arriving together: the prompt is computed once)
    propose   each sequence's drafts; ONE draft budget over all of them
              (lp.drafts.select.select_trees on the measured t(Q), Q = every row of the step;
              a batch of one uses the decoder's own budget, today's step)
    lay out   each sequence's rows (lp.lookahead.layout), concatenated; a joining sequence's
              prompt is fed in chunks of at most ``max_prefill_tokens`` rows per step,
              in the same forward as the others' decode rows; a request asking for
              prompt logprobs also keeps the logits of its prompt rows (read before its
              verdict's rows), and a ``prompt_only`` one finishes when its prompt is in
              the cache, with no new token
    forward   one packed forward: the paged cache writes the rows into their slots; with
              sdpa each layer's attention is one lp::paged_attention call (every
              sequence's rows against its own keys in the pool, where they are given by
              tensors), with eager / flex the used slots are gathered and the mask lets a
              row see its own sequence's prefix and its own ancestors only; under
              ``model.compile=on`` this forward runs compiled (two graphs:
              ``compile_batched_step`` builds them before serving)
    verify    ONE device->host read (the argmaxes of every kept row; sampled sequences
              read their rows' probabilities), then each sequence's verdict
    commit    accepted rows compacted next to each prefix, the rest freed (one
              gather/scatter per layer for the batch); finished sequences release
              their blocks

Under Lookahead Parallelism (``group``: a ``lp.parallel.dist.WorkerGroup``, every rank builds the
engine and makes the same calls) every worker holds every running sequence and its whole
prefix K/V; each sequence's decoder is built for the group, so a step lays out only this
rank's shard of each sequence's plan (lp.lookahead.shard: its subtrees and window columns; pending
rows on every rank). After verify, ONE fixed-shape exchange carries every sequence's
verdict (lp.parallel.dist ``exchange_batch``: the sequences' frames in the running order, the same
on every rank), each sequence merges it as a one-sequence run would (lp.engine.decoder
``payload`` / ``merge_rows``), and commits by re-feed: its cache is cut back to the
committed prefix and the emitted tokens are its next step's pending rows. Joins, aborts
and admissions must be the same on every rank: ``admissions()`` says which waiting ids
the next step admits, ``step(admit=ids)`` replays a decision made elsewhere (lp.server
sends rank 0's with the step); offline, every rank's identical calls decide alike. With
``prefix_cache`` every rank registers, hits and evicts the same blocks (the same commits in
the same order), and rank 0's hits ride with its admissions (``cached_rows``,
``step(admit=ids, cached=rows)``): a rank whose tables would hit otherwise stops with a
RuntimeError instead of decoding from different K/V.

Legend: Q rows of the step (all sequences), K gathered key rows, V vocabulary.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lp.kernels import attention
from lp.kernels.attention import BATCH_SDPA, FIRST, KEYS, MASK, QO, ROWS, SLIDING, SLOTS
from lp.config import DecodingConfig
from lp.engine.decoder import (
    GenerationResult,
    GenerationStats,
    LookaheadDecoder,
    StepRecord,
    TokenLogprob,
    _finish_stats,
    _logprobs,
    _record,
    _select_candidates,
    argmax_only,
)
from lp.drafts.budget import GainCalibration
from lp.drafts.select import BatchCost, TreeRequest, select_tree, select_trees
from lp.lookahead.layout import build_tree_layout
from lp.kernels.head import argmax_rows
from lp.model.runner import ATTN_IMPLS, ModelRunner
from lp.model.paged import BLOCK_SIZE, PagedCache, SeqView, blocks_for
from lp.lookahead.processors import row_extras


DRAFT_POLICIES = ("budget", "static", "none")


@dataclass
class StepOutput:
    request_id: int
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" once finished
    logprobs: list | None = None  # lp.engine.decoder.TokenLogprob per new token when the request asks for them


@dataclass
class _Request:
    id: int
    decoder: LookaheadDecoder
    prompt: list[int]
    eos: set[int]
    tokenizer: object
    need: int  # K/V rows reserved: prompt + max_new_tokens + the largest step
    run: object = None  # lp.engine.decoder._Run once admitted
    stats: GenerationStats = field(default_factory=GenerationStats)
    t_start: float = 0.0
    prompt_logprobs: int | None = None  # top count when the prompt's own logprobs are asked for
    prompt_only: bool = False  # prefill the prompt and finish with no new token (echo, max_tokens 0)
    prompt_lps: list = field(default_factory=list)


@dataclass
class _Item:
    """One running sequence's part of a step."""

    req: _Request
    chunk: int = 0  # > 0: a prefill chunk of this many prompt rows, nothing verified
    opts: object = None
    prop: object = None
    layout: object = None
    raw: object = None  # this sequence's raw logits [kept rows, V] (for logprobs)
    prompt_rows: int = 0  # leading rows whose logits give prompt logprobs (kept before the layout's own)
    new_tokens: list[int] = field(default_factory=list)


def _argmax_only(it: _Item) -> bool:
    """Whether this item's logits feed only an argmax (lp.kernels.head): a prefill chunk's are
    never read; a greedy row's are unless processors, logprobs or prompt logprobs read them."""
    if it.prompt_rows:
        return False
    return bool(it.chunk) or argmax_only(it.req.decoder.cfg, it.req.run)


class BatchEngine:
    """Continuous batching of lookahead decoding, in one process or on every LP rank (see
    module doc).

    ``kv_tokens``: slots of the paged cache per layer (``block_size`` rows a block);
    ``max_prefill_tokens``: most prompt rows a step feeds (None: whole prompts);
    ``tq_curve``: [(Q, seconds)] row costs for the draft budget (None: measured once and
    cached, lp.model.calibrate, when a request asks for ``draft_budget=auto``);
    ``draft_store``: a ``lp.drafts.suffix.DraftStore`` every request drafts from;
    ``draft_policy``: ``budget`` (one draft budget for the batch, the default), or the
    baselines it is measured against: ``static`` (vLLM's / TensorRT-LLM's kind of rule:
    each sequence drafts as if alone while at most ``static_batch`` decode, none above),
    ``none`` (plain batched decoding); ``group``: the LP worker group (None: one process);
    ``prefix_cache``: automatic prefix caching over the paged pool (lp.model.paged; under a
    group every rank holds the same block tables, rank 0's hits ride with its admissions:
    ``cached_rows`` / ``step(admit, cached)``)."""

    def __init__(self, runner: ModelRunner, kv_tokens: int, block_size: int = BLOCK_SIZE, max_batch: int = 8,
                 max_prefill_tokens: int | None = None, tq_curve=None, draft_store=None, draft_policy: str = "budget",
                 static_batch: int = 4, group=None, prefix_cache: bool = False, batch_cost: BatchCost | None = None):
        if runner._static is not None:
            raise ValueError("batched steps need model.attention=sdpa, eager or flex without static shapes / "
                             "CUDA graphs (model.cuda_graphs=false)")
        if runner.attention == "flash":  # the cascade has no batched form (model.attention=auto picks it on CUDA)
            from lp.kernels.attention import batch_attention

            runner.attention = batch_attention(runner.attention, runner.device)
            runner.attn_impl = ATTN_IMPLS[runner.attention]
        if max_batch < 1:
            raise ValueError(f"server.max_batch must be an integer >= 1, got {max_batch}")
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise ValueError(f"server.max_prefill_tokens must be an integer >= 1, got {max_prefill_tokens}")
        if draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"draft_policy must be one of {', '.join(DRAFT_POLICIES)}, got {draft_policy!r}")
        if not isinstance(static_batch, int) or static_batch < 1:
            raise ValueError(f"static_batch must be an integer >= 1, got {static_batch!r}")
        self.draft_policy = draft_policy
        self.static_batch = static_batch
        self.runner = runner
        if runner.attention == "sdpa":
            from lp.kernels import attention

            attention.register(runner.device)  # lp's C++ attention on a CPU model only
        self.cache = PagedCache(kv_tokens, block_size, prefix_cache)
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.tq = tq_curve
        # a batched step's own costs for the joint budget (lp.engine.batch_cost measures them;
        # lp.serve passes them): none unless given
        self.batch_cost = batch_cost or BatchCost()
        self.draft_store = draft_store
        # realized / predicted draft tokens over every request's drafting steps (lp.drafts.budget):
        # one for the engine, so a workload's requests calibrate the next ones
        self.calibration = GainCalibration()
        self.group = group  # lp.parallel.dist.WorkerGroup: every rank builds this engine and runs the same steps
        self.workers = group.lp_size if group is not None else 1
        if group is not None:
            self._share_curve()
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self._next_id = 0
        self.last_rows = 0  # rows of the last step (metrics)
        self.steps = 0
        self._results: dict[int, GenerationResult] = {}

    def _share_curve(self) -> None:
        """Under a group: rank 0's t(Q) curve and small-row kernel choice on every rank, once,
        while every rank builds the engine (the joint draft budget must agree; a request
        joining later must not start a collective of its own)."""
        from lp.model.calibrate import row_cost_curve

        curve = self.tq if self.tq is not None else row_cost_curve(self.runner)
        self.tq, small = self.group.share_curve(curve, self.runner.small_rows)
        if self.runner.small_rows_mode == "auto":
            self.runner.small_rows = small
        self.batch_cost = BatchCost(*self.group.share_floats([self.batch_cost.seq_s, self.batch_cost.draft_s]))

    # -- requests -----------------------------------------------------------------

    def add(self, prompt_ids: Sequence[int], cfg: DecodingConfig, eos_token_ids: Sequence[int] | int | None = None,
            tokenizer=None, request_id: int | None = None, prompt_logprobs: int | None = None,
            prompt_only: bool = False) -> int:
        """Queue a request; returns its id. ValueError for a bad request or one whose worst
        case (prompt + max_new_tokens + its largest step) exceeds the whole K/V pool.
        ``request_id``: the id rank 0 gave it (a worker rank replaying rank 0's joins).
        ``prompt_logprobs`` (k >= 0): the result's ``prompt_logprobs``, the raw log-softmax
        of each prompt token given the ones before it and the top k there (the prompt is
        computed whole: no prefix-cache hit); ``prompt_only``: finish once the prompt is in
        the cache, with no new token (finish_reason "length")."""
        if prompt_logprobs is not None and not (isinstance(prompt_logprobs, int) and 0 <= prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20], got {prompt_logprobs!r}")
        prompt = [int(t) for t in prompt_ids]
        dec, need = self.check(prompt, cfg, tokenizer)
        if dec.cfg.drafts == "suffix" and dec.cfg.draft_budget == "auto" and self.tq is None:
            from lp.model.calibrate import row_cost_curve

            self.tq = row_cost_curve(self.runner)
        dec.tq = self.tq
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        rid = self._next_id if request_id is None else request_id
        assert all(r.id != rid for r in [*self.waiting, *self.running]), rid
        self._next_id = max(self._next_id, rid + 1)
        self.waiting.append(_Request(rid, dec, prompt, set(eos_token_ids or []), tokenizer, need,
                                     prompt_logprobs=prompt_logprobs, prompt_only=prompt_only,
                                     prompt_lps=[None] if prompt_logprobs is not None else []))
        return rid

    def check(self, prompt: list[int], cfg: DecodingConfig, tokenizer=None) -> tuple[LookaheadDecoder, int]:
        """Validate a request without queueing it (no state changes; a server calls it from
        its HTTP thread): its decoder and the K/V rows it reserves, or a ValueError."""
        if cfg.mode not in ("lookahead", "ar"):
            raise ValueError(f"decoding.mode must be 'lookahead' or 'ar' for a batched engine, got {cfg.mode!r}")
        dec = LookaheadDecoder(self.runner, cfg, self.group, draft_store=self.draft_store, tq_curve=self.tq,
                               calibration=self.calibration)
        dec._check_request(prompt)
        if dec.cfg.stop_strings and tokenizer is None:
            raise ValueError("decoding.stop_strings needs a tokenizer to decode the output")
        if dec.grammar_text is not None and tokenizer is None:
            raise ValueError("structured output (decoding.json_schema / grammar) needs the tokenizer")
        need = len(prompt) + dec.cfg.max_new_tokens + dec.max_step_rows()
        blocks = self.cache.blocks
        if blocks_for(need, blocks.block_size) > blocks.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({dec.cfg.max_new_tokens}) + the largest step "
                f"({dec.max_step_rows()} rows) needs {need} K/V slots; server.kv_tokens holds {self.cache.kv_tokens}"
            )
        return dec, need

    def abort(self, request_id: int) -> bool:
        """Drop a waiting or running request and free its blocks; False if unknown."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                return True
        for req in self.running:
            if req.id == request_id:
                if not req.run.done:
                    req.run.done, req.run.finish = True, "cancelled"
                self._leave(req)
                return True
        return False

    def warm(self) -> bool:
        """Before serving: one throwaway one-token request through a step, so the first real
        request does not pay the paged pool's allocation and the step's first-call costs (on
        the CPU the pool's pages are zeroed as they are first written, lp.model.paged.zeroed;
        elsewhere it is zeroed at once here). Every rank calls it at
        the same point (under LP the step is collective). It leaves nothing behind: no draft-store
        entry, no result, its blocks freed. False (nothing run) once the pool exists or while
        requests are queued."""
        if self.cache.keys or self.has_work:
            return False
        store, self.draft_store = self.draft_store, None
        try:
            rid = self.add([0], DecodingConfig(mode="ar", max_new_tokens=1))
        finally:
            self.draft_store = store
        while self.has_work:
            self.step()
        self._results.pop(rid, None)
        assert self.cache.blocks.blocks_in_use == 0, self.cache.blocks.blocks_in_use
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def blocks_in_use(self) -> int:
        return self.cache.blocks.blocks_in_use

    def prompt_logprobs(self, request_id: int) -> list | None:
        """The prompt logprobs computed so far for a request asking for them (running or
        finished, its result not yet taken); None otherwise."""
        for req in self.running:
            if req.id == request_id:
                return list(req.prompt_lps) if req.prompt_logprobs is not None else None
        res = self._results.get(request_id)
        return None if res is None or res.prompt_logprobs is None else list(res.prompt_logprobs)

    def result(self, request_id: int) -> GenerationResult | None:
        """A finished request's output and stats (kept until taken once)."""
        return self._results.pop(request_id, None)

    # -- the step -----------------------------------------------------------------------

    def admissions(self) -> list[int]:
        """Ids of the waiting requests the next step admits (FIFO while ``max_batch`` and the
        K/V reservation allow); no state changes. Under LP rank 0 decides, the others replay."""
        blocks, ids = self.cache.blocks, []
        free, claimed = blocks.available, set()
        coming = self._coming() if blocks.prefix_cache else set()
        for req in self.waiting:
            if len(self.running) + len(ids) >= self.max_batch:
                break
            if coming and self._waits_for_prefix(req, coming):
                break  # FIFO: its prompt's next blocks are being computed by another request
            need = blocks.cost(req.need, self._lookup_ids(req), claimed)  # new blocks, less the cached prefix's
            if need > free:
                break
            free -= need
            ids.append(req.id)
            if blocks.prefix_cache:
                coming.update(blocks.chain(req.prompt, len(req.prompt) // blocks.block_size))
        return ids

    def _coming(self) -> set[bytes]:
        """Prefix cache: the chain digests of the full prompt blocks that running prefills will
        register once their prompts are in (lp.model.paged)."""
        blocks, out = self.cache.blocks, set()
        for req in self.running:
            if req.run.step == 0 and not req.run.done:
                out.update(blocks.chain(req.prompt, len(req.prompt) // blocks.block_size))
        return out

    def _waits_for_prefix(self, req: _Request, coming: set[bytes]) -> bool:
        """Whether ``req`` should wait: the first block of its prompt past what is cached now is
        one a running prefill (or a request admitted before it this round) is computing, so it
        hits that block a few steps later instead of computing it again (``n`` > 1 choices of
        one prompt, clients sharing a system prompt arriving together)."""
        if req.prompt_logprobs is not None:
            return False
        blocks = self.cache.blocks
        hit = len(blocks.lookup(req.prompt))
        chain = list(blocks.chain(req.prompt, (len(req.prompt) - 1) // blocks.block_size))
        return hit < len(chain) and chain[hit] in coming

    def cached_rows(self, ids: Sequence[int]) -> list[int]:
        """The prompt rows each of these waiting requests finds in the prefix cache if the
        next step admits them (``admissions()``'s ids); no state changes. Under LP rank 0 sends
        them with the admissions, the other ranks check their own tables agree (``step``)."""
        bs = self.cache.blocks.block_size
        reqs = {r.id: r for r in self.waiting}
        return [len(self.cache.blocks.lookup(self._lookup_ids(reqs[rid]))) * bs for rid in ids]

    def step(self, admit: Sequence[int] | None = None, cached: Sequence[int] | None = None) -> list[StepOutput]:
        """Admit (``admit``: exactly these waiting ids, rank 0's decision replayed on a worker
        rank; None: ``admissions()``; ``cached``: rank 0's ``cached_rows`` of them, the prefix-cache
        hit each must find here: a RuntimeError when this rank's block tables disagree), then
        one batched forward over every running sequence; per-sequence outputs."""
        self._admit(self.admissions() if admit is None else admit, cached)
        if not self.running:
            return []
        t0 = time.perf_counter()
        items = self._schedule()
        self._propose([it for it in items if not it.chunk], sum(it.chunk for it in items), len(items))
        for it in items:
            run = it.req.run
            if it.chunk:
                it.layout = build_tree_layout(run.pending[: it.chunk], [], range(0), [])
            else:
                it.layout = it.req.decoder.lay_out(run, it.prop)
            if it.req.prompt_logprobs is not None and run.step == 0:  # rows predicting a prompt token
                it.prompt_rows = min(it.chunk or len(run.pending), len(run.pending) - 1)
        t1 = time.perf_counter()
        logits_KV = self.forward(items)
        verdicts = self._verify(items, logits_KV)
        t2 = time.perf_counter()
        merged = self._merge(items, verdicts)
        t_x = time.perf_counter()
        outputs, edits = [], []
        for it, verdict in zip(items, merged):
            out = self._finish(it, verdict, edits)
            if out is not None:
                outputs.append(out)
        self.cache.commit(edits)
        if self.cache.blocks.prefix_cache:
            for it in items:
                if not it.req.run.done:
                    self.cache.blocks.register(it.req.id, it.req.run.tokens)
        t3 = time.perf_counter()
        rows = sum(it.layout.num_rows for it in items)
        self.last_rows, self.steps = rows, self.steps + 1
        for it in items:
            if not it.chunk:  # rows: the whole step's (what it cost); rows_per_rank: the sequence's own
                own = [s.rows for s in it.prop.plan] if self.workers > 1 else [it.layout.num_rows]
                rec = StepRecord(len(it.new_tokens), rows, own, t2 - t1, t_x - t2, (t1 - t0) + (t3 - t_x))
                _record(it.req.stats, rec)
            if it.req.run.done:
                self._leave(it.req)
        return outputs

    def _admit(self, ids: Sequence[int], want: Sequence[int] | None = None) -> None:
        blocks = self.cache.blocks
        reqs = [next(r for r in self.waiting if r.id == rid) for rid in ids]
        assert len(self.running) + len(reqs) <= self.max_batch, ids
        assert want is None or len(want) == len(reqs), (ids, want)
        # rank 0's hit (``want``) bounds the lookup: prompt[:hit + 1] finds at most hit rows
        prompts = [self._lookup_ids(r) if want is None else self._lookup_ids(r)[: w + 1]
                   for r, w in zip(reqs, want or [None] * len(reqs))]
        got = blocks.reserve_round([(r.id, r.need, p) for r, p in zip(reqs, prompts)])
        if want is not None and list(got) != list(want):
            raise RuntimeError(f"prefix cache diverged from rank 0: requests {list(ids)} hit {list(got)} cached "
                               f"rows here, {list(want)} on rank 0 (block tables must be identical on every rank)")
        for req, cached in zip(reqs, got):
            self.waiting.remove(req)
            req.run = req.decoder._start(req.prompt, req.eos, cache=SeqView(self.cache, req.id),
                                         tokenizer=req.tokenizer)
            req.run.pending = req.prompt[cached:]  # the cached rows are committed already
            req.stats.cached_tokens = cached
            req.t_start = time.perf_counter()
            self.running.append(req)

    @staticmethod
    def _lookup_ids(req: _Request) -> list[int]:
        """What the prefix cache is searched with: the prompt, or nothing when the request
        needs the logits of every prompt row (prompt logprobs)."""
        return [] if req.prompt_logprobs is not None else req.prompt

    def _schedule(self) -> list[_Item]:
        """Who runs this step: every decoding sequence, and prompts within the prefill budget
        (FIFO; a prompt longer than what is left is fed in chunks over several steps). A
        decoding sequence always runs whole (under LP its pending rows are the re-fed tokens)."""
        items, budget = [], self.max_prefill_tokens
        for req in self.running:
            pending = len(req.run.pending)
            if req.prompt_only:  # the prompt in chunks to its end, nothing decoded
                chunk = pending if budget is None else min(pending, budget)
                if chunk:
                    items.append(_Item(req, chunk=chunk))
                    budget = None if budget is None else budget - chunk
            elif budget is None or pending == 1 or req.run.step > 0:
                items.append(_Item(req))
            elif pending <= budget:
                budget -= pending
                items.append(_Item(req))
            elif budget > 0:
                items.append(_Item(req, chunk=budget))
                budget = 0
        return items

    def _propose(self, items: list[_Item], chunk_rows: int, seqs: int) -> None:
        """Each sequence's proposal; one draft budget over the batch's budgeted trees
        (``chunk_rows``: the step's prefill-chunk rows, priced with the rest; ``seqs``: the
        step's sequences, prefill chunks included, for ``batch_cost``). The
        ``draft_policy`` alternatives (bench/batch.py compares them): ``static`` drafts as a
        batch of one while at most ``static_batch`` sequences decode and not at all above;
        ``none`` never drafts."""
        policy = self.draft_policy
        # a prompt whose own logprobs are asked for is scored without drafts after it: the rows of its
        # step, so its logits, are then the same however many drafts the store or the budget would add
        # (attention over a longer step's keys need not round alike: a request and its streamed twin differed)
        scored = [it for it in items if it.req.prompt_logprobs is not None and it.req.run.step == 0]
        for it in scored:
            it.opts = it.req.decoder.draft_options(it.req.run)
            it.prop = it.req.decoder.proposal(it.req.run, it.opts, [])
        items = [it for it in items if it not in scored]
        if not items:
            return
        if policy == "budget" and len(items) == 1 and len(self.running) == 1:
            it = items[0]
            it.prop = it.req.decoder.propose(it.req.run)  # a batch of one is today's step
            return
        drafts = policy == "budget" or (policy == "static" and len(items) <= self.static_batch)
        joint, fixed = [], chunk_rows + sum(it.prop.plan[0].rows for it in scored)
        for it in items:
            dec, run = it.req.decoder, it.req.run
            c = dec.cfg
            if drafts and policy == "static":
                it.prop = dec.propose(run)  # its own budget, priced as if alone
                continue
            it.opts = dec.draft_options(run)
            if not drafts:
                it.prop = dec.proposal(run, it.opts, [])
            elif c.drafts == "pool":
                it.prop = dec.proposal(run, it.opts, _select_candidates(run.pool, run.context, it.opts.x, c.G, c.N - 1))
                fixed += it.prop.plan[0].rows
            elif c.draft_budget != "auto" or self.tq is None:
                cands = select_tree(it.opts.scored, run.acceptance, it.opts.base, None, dec.draft_rows)
                it.prop = dec.proposal(run, it.opts, cands)
                fixed += it.prop.plan[0].rows
            else:
                joint.append(it)
        if joint:
            reqs = [TreeRequest(it.opts.scored, it.req.run.acceptance, it.opts.base, it.req.decoder.draft_rows,
                                it.opts.extra, it.req.decoder.gain()) for it in joint]
            for it, cands in zip(joint, select_trees(reqs, self.tq, fixed, pad=True, batch=self.batch_cost, seqs=seqs)):
                it.prop = it.req.decoder.proposal(it.req.run, it.opts, cands)

    @torch.inference_mode()
    def forward(self, items: list[_Item]) -> torch.Tensor:
        """One packed forward over every item's rows; logits [sum of kept rows, V] (float32)."""
        runner = self.runner
        ids_1Q = torch.tensor([[t for it in items for t in it.layout.tokens]], dtype=torch.long).to(runner.device)
        keep, pos, qo = [], [], 0
        for it in items:
            depths_Q, keep_t, _, _ = runner._tensors(it.layout.skeleton)
            if it.prompt_rows:
                keep.append(torch.arange(it.prompt_rows, device=keep_t.device) + qo)
            keep.append(keep_t + qo)
            qo += it.layout.num_rows
        if runner.attention == "sdpa":
            # one lp::paged_attention call per layer: each sequence's sdpa over its own keys, read in
            # place from the paged pool (lp.kernels.attention); the model's mask argument is a placeholder
            mask, extra, impl = self._placeholder, self._sdpa_spans(items, pos), BATCH_SDPA
        else:  # eager and flex: one call over the gathered keys, the mask hiding other sequences
            mask, extra, impl = self._gathered_mask(items, pos), {}, None
        keep_K, pos_1Q = torch.cat(keep), torch.cat(pos)[None]
        kept = keep_K.numel()
        # model.compile=on: the compiled forward once the pool exists (the first step allocates it
        # eagerly); the span tensors keep its graph the same from step to step, and a step that
        # keeps one row keeps it twice (torch.compile would specialize a graph on the size 1)
        compiled = runner.compiled and impl == BATCH_SDPA and bool(self.cache.keys)
        if compiled:
            if kept == 1:
                keep_K = keep_K.repeat(2)
            _mark_dynamic(ids_1Q, pos_1Q, keep_K, extra)
        with runner._kernel(qo, impl, argmax_only=all(map(_argmax_only, items))), attention.step_spans(extra):
            out = (runner._forward if compiled else runner.fused or runner.model)(
                input_ids=ids_1Q, position_ids=pos_1Q, attention_mask=mask,
                **{runner._cache_kw: self.cache}, use_cache=True, logits_to_keep=keep_K, **extra)
        return out.logits[0, :kept].float()

    def _sdpa_spans(self, items: list[_Item], pos: list) -> dict:
        """The span table, flat masks and flat slots of lp.kernels.attention.paged_attention: per
        sequence its rows, where its keys are in the pool and its (full, sliding) additive masks
        (none where every key is visible: a one-row step). Every tensor holds at least two
        entries (a padding span of 0 rows, zeros), so a compiled step never meets the sizes 0 and
        1 that torch.compile would specialize on."""
        runner, dev = self.runner, self.runner.device
        places = self.cache.plan([(it.req.id, it.layout.num_rows) for it in items], dev, gather=False)
        rows, masks, slots, qo, at = [], [], [], 0, 0
        for it, (length, where) in zip(items, places):
            sk = it.layout.skeleton
            q, k = sk.num_rows, length + sk.num_rows
            depths_Q, _, local_add_QQ, _ = runner._tensors(sk)
            pos_Q = depths_Q + length
            pos.append(pos_Q)
            span = [0] * 7
            span[QO], span[ROWS], span[KEYS], span[MASK], span[SLIDING], span[SLOTS] = qo, q, k, -1, -1, -1
            if isinstance(where, int):
                span[FIRST] = where
            else:
                span[FIRST], span[SLOTS] = -1, sum(t.numel() for t in slots)
                slots.append(where)
            full = None
            if q > 1:
                full = torch.zeros((q, k), dtype=runner.dtype, device=dev)
                full[:, length:] = local_add_QQ
                span[MASK], at = at, at + q * k
                masks.append(full.view(-1))
            if runner.sliding_window is not None:
                key_pos = torch.cat([torch.arange(length, device=dev), pos_Q])
                far = (pos_Q[:, None] - key_pos[None, :]) >= runner.sliding_window
                base = full if full is not None else torch.zeros((q, k), dtype=runner.dtype, device=dev)
                span[SLIDING], at = at, at + q * k
                masks.append(base.masked_fill(far, torch.finfo(runner.dtype).min).view(-1))
            rows.append(span)
            qo += q
        rows += [[qo, 0, 0, 0, -1, -1, -1]] * max(0, 2 - len(rows))
        masks.append(torch.zeros(2, dtype=runner.dtype, device=dev))
        slots.append(torch.zeros(2, dtype=torch.long, device=dev))
        return {"lp_spans": torch.tensor(rows, dtype=torch.long), "lp_masks": torch.cat(masks),
                "lp_slots": torch.cat(slots)}

    @functools.cached_property
    def _placeholder(self) -> torch.Tensor:
        """A 4-D mask transformers passes through untouched (lp_batch_sdpa reads the spans)."""
        return torch.zeros((1, 1, 1, 1), dtype=self.runner.dtype, device=self.runner.device)

    def _gathered_mask(self, items: list[_Item], pos: list):
        """The [Q, K] mask over the gathered keys (eager, flex): a row sees its own
        sequence's prefix and its own ancestors."""
        runner, dev = self.runner, self.runner.device
        places = self.cache.plan([(it.req.id, it.layout.num_rows) for it in items], dev)
        q_total = sum(it.layout.num_rows for it in items)
        allowed_QK = torch.zeros(q_total, int(self.cache._read.numel()), dtype=torch.bool, device=dev)
        key_pos, qo = [], 0
        for it, (length, ko) in zip(items, places):
            sk = it.layout.skeleton
            q = sk.num_rows
            depths_Q, _, _, local_QQ = runner._tensors(sk)
            allowed_QK[qo : qo + q, ko : ko + length] = True
            allowed_QK[qo : qo + q, ko + length : ko + length + q] = local_QQ
            pos.append(depths_Q + length)
            if runner.sliding_window is not None:
                key_pos += [torch.arange(length, device=dev), depths_Q + length]
            qo += q
        return self._mask(allowed_QK, torch.cat(pos), torch.cat(key_pos) if key_pos else None)

    def _mask(self, allowed_QK, pos_Q, key_pos_K):
        runner = self.runner
        masks = {"full_attention": allowed_QK}
        if runner.sliding_window is not None:
            near = (pos_Q[:, None] - key_pos_K[None, :]) < runner.sliding_window
            masks["sliding_attention"] = allowed_QK & near
        if runner.attention == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            q, k = allowed_QK.shape

            def block(allowed):
                return create_block_mask(lambda b, h, qi, kv: allowed[qi, kv], None, None, q, k, device=runner.device)

            masks = {name: block(m) for name, m in masks.items()}
        else:
            neg = torch.finfo(runner.dtype).min
            masks = {name: torch.zeros(m.shape, dtype=runner.dtype, device=runner.device)
                     .masked_fill_(~m, neg)[None, None] for name, m in masks.items()}
        if runner.sliding_window is None:
            return masks["full_attention"]
        if runner.mixed_layers:
            return masks
        return masks["sliding_attention"]

    def _verify(self, items: list[_Item], logits_KV: torch.Tensor) -> list:
        """ONE device->host read of every kept row's argmax, then each sequence's verdict."""
        greedy = any(not it.req.decoder.cfg.do_sample for it in items if not it.chunk)
        argmax = argmax_rows(logits_KV) if greedy else None
        verdicts, ko = [], 0
        for it in items:
            if it.prompt_rows:
                self._prompt_logprobs(it, logits_KV[ko : ko + it.prompt_rows])
                ko += it.prompt_rows
            n = len(it.layout.skeleton.keep)
            if not it.chunk:
                dec, run = it.req.decoder, it.req.run
                rows = argmax[ko : ko + n] if argmax is not None and not dec.cfg.do_sample else None
                logits = it.raw = logits_KV[ko : ko + n]
                if run.proc is not None:  # logit_bias / penalties along the tree (lp.lookahead.processors)
                    logits, rows = run.proc.apply(logits, row_extras(it.layout)), None
                verdicts.append(dec.verify(run, it.prop, it.layout, logits, rows))
                run.lp_local = dec.local_logprobs(it.prop, it.layout, it.raw, verdicts[-1])  # LP + logprobs
            else:
                verdicts.append(None)
            ko += n
        return verdicts

    @staticmethod
    def _prompt_logprobs(it: _Item, logits_PV: torch.Tensor) -> None:
        """Raw logprobs of the prompt tokens these rows predict (row j: pending[j + 1])."""
        req = it.req
        targets = req.run.pending[1 : it.prompt_rows + 1]
        lp_PV = torch.log_softmax(logits_PV.float(), dim=-1)
        chosen = lp_PV.gather(1, torch.tensor(targets, device=lp_PV.device)[:, None])[:, 0].tolist()
        if req.prompt_logprobs:
            vals, ids = lp_PV.topk(req.prompt_logprobs, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        else:
            tops = [()] * len(targets)
        req.prompt_lps += [TokenLogprob(t, c, tp) for t, c, tp in zip(targets, chosen, tops)]

    def _merge(self, items: list[_Item], verdicts: list) -> list:
        """Each decoding sequence's (path over all its candidates, z of every column): its own
        verdict in one process; under a group ONE exchange for the whole step, every sequence's
        frame in the batch's order (the same on every rank), then each unpacked as one
        sequence's would be (lp.engine.decoder: payload / merge_rows)."""
        if self.group is None:
            return [None if v is None else it.req.decoder.merge_verdicts(it.req.run, it.prop, v, False)[:2]
                    for it, v in zip(items, verdicts)]
        live = [(it, v) for it, v in zip(items, verdicts) if v is not None]
        if not live:  # prefill chunks only: nothing to agree on
            return verdicts
        frames = []
        for it, v in live:
            dec = it.req.decoder
            frames.append((dec.merge.frame, dec.payload(it.prop, v, it.req.run.lp_local), dec._state_hash(it.req.run)))
        rows = iter(self.group.exchange_batch(frames))
        return [None if v is None else it.req.decoder.merge_rows(it.prop, next(rows))
                for it, v in zip(items, verdicts)]

    def _finish(self, it: _Item, merged, edits: list) -> StepOutput | None:
        """Publish, collect and book the cache edit of one sequence (its decoder's commit:
        compaction in one process, crop and re-feed under LP)."""
        req, run = it.req, it.req.run
        cache_len = self.cache.blocks.lengths[req.id]
        if it.chunk:
            edits.append((req.id, cache_len + it.chunk, []))
            run.pending = run.pending[it.chunk :]
            if req.prompt_only and not run.pending:  # echo with max_tokens 0: the prompt is all
                run.done, run.finish = True, "length"
                return StepOutput(req.id, [], True, "length")
            return None
        dec = req.decoder
        path, z_all = merged
        emitted = dec.publish(run, path.emitted, False, req.tokenizer)
        dec.collect(run, it.prop, z_all, emitted)
        if run.proc is not None:
            run.proc.extend(emitted)
        dec.grammar_commit(run, it.prop, emitted)  # lp.grammar: forced-draft count, dead end
        _count_drafts(req.stats, it.prop.candidates, len(emitted))
        lps = None
        if dec.cfg.logprobs:
            lps = _logprobs(it.raw, it.layout, path, len(emitted), dec.cfg.top_logprobs)
            run.logprobs.extend(lps)
        run.step += 1
        it.new_tokens = emitted
        if not run.done:
            keep_len, rows, run.pending = dec.commit.plan(cache_len, it.layout, path, emitted)
            edits.append((req.id, keep_len, rows))
        return StepOutput(req.id, emitted, run.done, run.finish if run.done else None, lps)

    def _leave(self, req: _Request) -> None:
        """A finished or aborted sequence: its blocks back to the pool, its result kept."""
        self.running.remove(req)
        self.cache.blocks.release(req.id)
        if req.run is not None and req.run.done and req.decoder.draft_store is not None:
            req.decoder.draft_store.add(req.prompt[-64:] + req.run.out)
        stats = req.stats
        stats.decode_time_s = time.perf_counter() - req.t_start
        stats.workers = self.workers
        stats.forced_tokens = req.run.forced_tokens if req.run is not None else 0
        if stats.records:
            _finish_stats(stats, len(req.run.out), self.workers)
        self._results[req.id] = GenerationResult(list(req.run.out), stats, req.run.finish,
                                                 list(req.run.logprobs) if req.decoder.cfg.logprobs else None,
                                                 list(req.prompt_lps) if req.prompt_logprobs is not None else None)


def _count_drafts(stats: GenerationStats, candidates, emitted: int) -> None:
    """One decode step's speculative-decoding counters (GenerationStats: num_drafts, ...)."""
    if candidates:
        stats.num_drafts += 1
        stats.num_draft_tokens += max(len(c) for c in candidates)
    accepted = max(emitted - 1, 0)
    stats.num_accepted_tokens += accepted
    if len(stats.accepted_per_pos) < accepted:
        stats.accepted_per_pos.extend([0] * (accepted - len(stats.accepted_per_pos)))
    for i in range(accepted):
        stats.accepted_per_pos[i] += 1


def _mark_dynamic(ids_1Q, pos_1Q, keep_K, extra: dict) -> None:
    """The sizes that change from step to step, dynamic in the compiled graph from its first
    compile (not only after a recompile): the rows (from two on; one-row steps get their own
    graph), the kept rows, the span table, the flat masks and slots."""
    import torch._dynamo

    if ids_1Q.shape[1] > 1:
        torch._dynamo.maybe_mark_dynamic(ids_1Q, 1)
        torch._dynamo.maybe_mark_dynamic(pos_1Q, 1)
    torch._dynamo.maybe_mark_dynamic(keep_K, 0)
    for t in extra.values():
        torch._dynamo.maybe_mark_dynamic(t, 0)


def generate_batch(decoder: LookaheadDecoder, prompts: Sequence[Sequence[int]], eos_token_ids=None, tokenizer=None,
                   configs: Sequence[DecodingConfig] | None = None, max_batch: int | None = None,
                   kv_tokens: int | None = None, max_prefill_tokens: int | None = None) -> list[GenerationResult]:
    """Decode several prompts in batched steps over one paged K/V cache, each with
    ``decoder``'s config or its own (``configs``, one per prompt); one result per prompt, in
    order. ``kv_tokens`` None: room for all of them at once. Under a group (LP) every rank
    calls it with the same prompts and settings: each sequence's rows are sharded over the
    workers, one exchange per step carries every sequence's verdict. (A module-level
    function, not a decoder method: the batch engine is built over the one-sequence decoder,
    never the reverse.)"""
    cfgs = list(configs) if configs is not None else [decoder.cfg] * len(prompts)
    if len(cfgs) != len(prompts):
        raise ValueError(f"configs must give one DecodingConfig per prompt ({len(prompts)}), got {len(cfgs)}")
    if kv_tokens is None:  # room for every prompt at once (a block of slack each)
        rows = [LookaheadDecoder(decoder.runner, c, tq_curve=decoder.tq).max_step_rows() for c in cfgs]
        kv_tokens = sum(len(p) + c.max_new_tokens + r + 16 for p, c, r in zip(prompts, cfgs, rows))
    engine = BatchEngine(decoder.runner, kv_tokens, max_batch=max_batch or max(len(prompts), 1),
                         max_prefill_tokens=max_prefill_tokens, tq_curve=decoder.tq, draft_store=decoder.draft_store,
                         group=decoder.group)
    ids = [engine.add(p, c, eos_token_ids, tokenizer) for p, c in zip(prompts, cfgs)]
    while engine.has_work:
        engine.step()
    return [engine.result(i) for i in ids]


def compile_batched_step(runner: ModelRunner, max_prefill_tokens: int = 64) -> float:
    """model.compile=on: compile the batched step's graphs now (a multi-row step and a one-row
    step, over a small pool of their own: pool sizes are dynamic) so the first requests do not
    wait for them; returns the seconds it took (0 when the runner is not compiled)."""
    if not runner.compiled:
        return 0.0
    t0 = time.perf_counter()
    prompt = [10 + i % 7 for i in range(40)]  # repetitive: tree drafts, hence multi-row steps
    engine = BatchEngine(runner, kv_tokens=512, max_batch=1, max_prefill_tokens=max_prefill_tokens)
    tree = DecodingConfig(max_new_tokens=8, drafts="suffix", draft_budget="all", max_draft_rows=8, W=2, N=3, G=3)
    for cfg in (tree, DecodingConfig(max_new_tokens=4, W=1, N=2, G=0)):  # then one-row steps
        engine.add(prompt, cfg)
        while engine.has_work:
            engine.step()
    return time.perf_counter() - t0
