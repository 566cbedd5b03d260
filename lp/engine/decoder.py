"""The lookahead decoding loop, in one process or as one worker of Lookahead Parallelism.

Contract: ``LookaheadDecoder(runner, cfg, group).generate(prompt_ids)`` returns the
new token ids and the stats. It knows token ids only (no tokenizer, except to
check stop strings). A step is a chain of named stages, each a small method:

    propose   drafts for the current token x (suffix index over prompt + output, the
              cross-request store, the window's n-gram pool, the grammar's forced continuation
              with acceptance 1 when the request is structured (lp.grammar); or the paper's pooled
              candidates), cut to the draft budget (lp.drafts.select, lp.drafts.budget), the shard plan
    lay_out   the packed rows (lp.lookahead.layout: the drafts as one token trie, a row per node;
              the skeleton is cached by shape)
    forward   one packed forward (lp.model.runner), logits of the kept rows on the device;
              logit_bias and penalties applied per row with its own history (lp.lookahead.processors),
              then the grammar mask of each row's own path (lp.grammar.matcher.RowGrammar)
    verify    walk the candidate trie (lp.lookahead.verify; greedy argmax with ONE device->host
              read per step, or the exact sampler of lp.lookahead.sampling)
    merge     combine the workers' verdicts (identity in one process; one
              fixed-shape all_gather under LP, lp.parallel.dist)
    publish   truncate by max_new_tokens / eos / stop strings / cancel, stream
    collect   harvest the window's n-grams into the pool and advance the window; extend
              the suffix index; update the acceptance model with what was verified
    commit    publish the K/V of the accepted rows

The one-process / LP difference is two strategies chosen once per decoder, never a
branch in the loop: ``merge`` (``LocalMerge`` / ``GatherMerge``: this worker's verdict
packed by ``payload``, every worker's unpacked by ``merge_rows``; lp.engine.batch calls the two
around one exchange for all its sequences) and ``commit`` (its ``plan``: what the
cache keeps, lp.engine.batch books it in its paged cache; ``CompactCommit``: move the
accepted candidate rows next to the prefix in place, the last emitted token is the
next step's only pending row; ``RefeedCommit``: no K/V
crosses workers, every worker crops back to the committed prefix and re-feeds the
emitted tokens as the next step's pending rows).

Legend: Q packed rows, V vocabulary, R = N - 1.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lp.drafts.budget import AcceptanceModel, GainCalibration
from lp.config import DecodingConfig
from lp.parallel.dist import (Frame, greedy_payload, read_greedy, read_logprobs, read_sampled, sampled_payload,
                              with_logprobs)
from lp.drafts.select import FORCED, Scored, observe, predicted_gain, select_tree, suffix_drafts
from lp.lookahead.layout import build_tree_layout
from lp.kernels.head import argmax_rows
from lp.model.runner import ModelRunner
from lp.lookahead.pool import ContextIndex, NGramPool
from lp.lookahead.processors import RowProcessor, row_extras, wants_processing
from lp.lookahead.sampling import sample_at, warp
from lp.lookahead.shard import Shard, column_rows, plan_tree_shards
from lp.drafts.suffix import DraftStore, SuffixIndex
from lp.lookahead.tree import merge_trie
from lp.lookahead.verify import Path, children, greedy_walk, sharing_prefix, walk
from lp.lookahead.window import Window


@dataclass
class StepRecord:
    emitted: int  # tokens published this step (after truncation)
    rows: int  # packed rows this worker ran
    rows_per_rank: list[int]
    forward_s: float
    exchange_s: float
    host_s: float


@dataclass
class GenerationStats:
    steps: int = 0
    new_tokens: int = 0
    decode_time_s: float = 0.0
    forward_time_s: float = 0.0
    exchange_time_s: float = 0.0
    host_time_s: float = 0.0
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[k]: steps publishing k tokens
    mean_rows: float = 0.0
    mean_rows_per_rank: list[float] = field(default_factory=list)
    workers: int = 1
    records: list[StepRecord] = field(default_factory=list)
    cached_tokens: int = 0  # prompt rows reused from lp.engine.batch's prefix cache (not computed)
    forced_tokens: int = 0  # output tokens accepted from the grammar's forced drafts (lp.grammar)
    # speculative-decoding counters as vLLM's (lp.engine.batch fills them): a "draft" is a step that
    # verified at least one candidate, its draft tokens the longest candidate's length (the most it
    # could accept); accepted: the published tokens past the step's own one, accepted_per_pos[i]:
    # steps that accepted at least i + 1 of them
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def compression_ratio(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_time_s if self.decode_time_s > 0 else 0.0

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "compression_ratio": round(self.compression_ratio, 4),
            "decode_time_s": round(self.decode_time_s, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "forward_time_s": round(self.forward_time_s, 4),
            "exchange_time_s": round(self.exchange_time_s, 4),
            "host_time_s": round(self.host_time_s, 4),
            "accept_hist": self.accept_hist,
            "mean_rows": round(self.mean_rows, 2),
            "mean_rows_per_rank": [round(r, 2) for r in self.mean_rows_per_rank],
            "workers": self.workers,
            "forced_tokens": self.forced_tokens,
        }


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float  # raw: log-softmax of the model's logits at the row that verified the token
    top: tuple[tuple[int, float], ...] = ()  # the position's top_logprobs (token, logprob), most likely first


@dataclass
class GenerationResult:
    output_ids: list[int]
    stats: GenerationStats
    # "stop": an eos id or a stop string ended it; "length": max_new_tokens;
    # "cancelled": the caller's ``cancel()`` returned True (rank 0's decides under LP)
    finish_reason: str = "length"
    logprobs: list[TokenLogprob] | None = None  # one per output token when cfg.logprobs
    # lp.engine.batch's prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


# ---------------------------------------------------------------------------
# strategies chosen once per decoder


class LocalMerge:
    """One process: the local verdict is the verdict."""

    workers, rank = 1, 0
    frame = None

    def begin(self, frame: Frame) -> None:
        pass

    def share_curve(self, curve, small_rows):
        return curve, small_rows

    def __call__(self, dec: "LookaheadDecoder", run: "_Run", prop: "_Proposal", verdict, cancel: bool):
        if dec.cfg.do_sample:  # one process walked the trie itself
            return verdict[0], verdict[1], cancel
        local, z_local = verdict
        own = prop.plan[0].candidates
        winner = own[local.winner] if local.winner is not None else None
        return Path(local.emitted, winner, local.hits), z_local, cancel


class GatherMerge:
    """LP (and TP: any process group): one fixed-shape int64 all_gather per step
    (lp.parallel.dist.WorkerGroup); the decoder sees LP workers, not processes. The verdict is
    packed (``LookaheadDecoder.payload``) and every worker's payload unpacked
    (``LookaheadDecoder.merge_rows``) by the same code in one sequence and in a batch
    (lp.engine.batch gathers every sequence's frame at once)."""

    def __init__(self, group):
        self.group = group
        self.workers = group.lp_size
        self.rank = group.lp_rank
        self.frame: Frame | None = None

    def begin(self, frame: Frame) -> None:
        self.frame = frame
        self.group.begin(frame)

    def share_curve(self, curve, small_rows):
        """Rank 0's t(Q) curve and small-row kernel choice on every rank: the budget's
        decisions must agree."""
        return self.group.share_curve(curve, small_rows)

    def __call__(self, dec: "LookaheadDecoder", run: "_Run", prop: "_Proposal", verdict, cancel: bool):
        rows, cancelled = self.group.exchange(dec.payload(prop, verdict, run.lp_local), cancel, dec._state_hash(run))
        path, z_all = dec.merge_rows(prop, rows)
        return path, z_all, cancelled


class CompactCommit:
    """One process: accepted candidate rows move next to the prefix; x' is the only pending row."""

    def plan(self, cache_len: int, layout, path: Path, emitted: list[int]) -> tuple[int, list[int], list[int]]:
        """(rows of the cache kept, cache rows moved right after them, next step's pending tokens)."""
        hits = path.hits if path.winner is not None else 0
        rows = layout.cand_rows[path.winner][:hits] if hits else ()
        return cache_len + layout.num_pending, [cache_len + r for r in rows], [emitted[-1]]

    def __call__(self, runner, cache, cache_len: int, layout, path: Path, emitted: list[int]) -> list[int]:
        keep_len, rows, pending = self.plan(cache_len, layout, path, emitted)
        runner.compact(cache, keep_len, rows)
        return pending


class RefeedCommit:
    """LP: crop to the committed prefix, re-feed the emitted tokens next step."""

    def plan(self, cache_len: int, layout, path: Path, emitted: list[int]) -> tuple[int, list[int], list[int]]:
        return cache_len + layout.num_pending, [], list(emitted)

    def __call__(self, runner, cache, cache_len: int, layout, path: Path, emitted: list[int]) -> list[int]:
        keep_len, _, pending = self.plan(cache_len, layout, path, emitted)
        runner.crop(cache, keep_len)
        return pending


# ---------------------------------------------------------------------------
# one generation's state


@dataclass
class _Run:
    tokens: list[int]  # committed sequence
    pending: list[int]  # committed tokens not yet in the cache
    window: Window
    pool: NGramPool
    context: ContextIndex | None
    cache: object
    eos: set[int]
    index: SuffixIndex | None = None  # prompt + output (drafts=suffix)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    proc: RowProcessor | None = None  # logit_bias / penalties (and the grammar mask) along the tree
    grammar: object = None  # lp.grammar.matcher.RowGrammar when the request is structured
    forced_tokens: int = 0  # emitted tokens that came from the grammar's forced draft
    out: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    lp_local: list | None = None  # LP + logprobs: this rank's own walk's TokenLogprobs this step (``local_logprobs``)
    step: int = 0
    done: bool = False
    finish: str = "length"


@dataclass
class _Proposal:
    x: int
    candidates: list[tuple[int, ...]]
    use_window: bool
    plan: tuple[Shard, ...]
    cache_len: int
    scored: list = field(default_factory=list)  # the drafts before the budget cut (suffix mode)


@dataclass
class _Options:
    x: int
    cache_len: int
    p: int  # position of x
    window_fits: bool
    scored: list = field(default_factory=list)
    base: int = 0  # rows the step runs with or without drafts (suffix mode)
    extra: int = 0  # window rows that ride along only with drafts


class LookaheadDecoder:
    """``draft_store``: a ``lp.drafts.suffix.DraftStore`` shared across requests (a server passes
    its own); with ``cfg.draft_store`` and none given, the decoder owns one. ``tq_curve``:
    [(Q, seconds)] row costs for the draft budget; None: measured once and cached
    (lp.model.calibrate) when ``cfg.draft_budget == "auto"``."""

    def __init__(self, runner: ModelRunner, cfg: DecodingConfig, group=None, draft_store: DraftStore | None = None,
                 tq_curve=None, calibration: GainCalibration | None = None):
        self.runner = runner
        from lp.model.loader import cpu_has_amx_bf16

        dtype_name = str(runner.dtype).replace("torch.", "")
        cfg = cfg.validate()
        if cfg.mode == "ar":  # lp's own one-token steps: no window, no drafts, whatever else is set
            cfg = cfg.plain()
        self.cfg = cfg.with_hardware_defaults(runner.device.type, dtype_name, cpu_has_amx_bf16())
        self.group = group  # lp.parallel.dist.WorkerGroup or None
        from lp.grammar.matcher import grammar_of

        self.grammar_text = grammar_of(self.cfg)  # llguidance grammar text or None (compiled once, cached)
        self.merge = GatherMerge(group) if group is not None else LocalMerge()
        self.commit = RefeedCommit() if group is not None and group.lp_size > 1 else CompactCommit()
        self.workers = self.merge.workers
        self.rank = self.merge.rank
        c = self.cfg
        if draft_store is None and c.draft_store and c.drafts == "suffix":
            draft_store = DraftStore(c.draft_store_tokens)
        self.draft_store = draft_store
        self.tq = tq_curve
        # realized / predicted draft tokens across this decoder's runs (a BatchEngine passes one
        # for all its requests): the budget's P scaled by it (decoding.draft_calibration)
        self.calibration = calibration if calibration is not None else GainCalibration()
        # most trie rows a step may verify (all workers together)
        self.draft_rows = c.max_draft_rows if c.drafts == "suffix" else c.G * (c.N - 1)
        self.max_draft = max(c.max_draft_len, c.N - 1) if c.drafts == "suffix" else c.N - 1

    # -- validation ---------------------------------------------------------

    def _check_request(self, prompt_ids: Sequence[int]) -> None:
        if len(prompt_ids) == 0:
            raise ValueError("prompt must not be empty (got 0 token ids)")
        vocab = self.runner.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt ids must be integers in [0, {vocab})")
        bad = [t for t in self.cfg.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"decoding.logit_bias keys must be token ids in [0, {vocab}), got {bad[0]}")
        limit = self.runner.max_positions
        need = len(prompt_ids) + self.cfg.max_new_tokens
        if limit is not None and need > limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + decoding.max_new_tokens "
                f"({self.cfg.max_new_tokens}) = {need} exceeds the model's context of {limit} positions"
            )

    def max_step_rows(self) -> int:
        """Most rows a decode step (not the prefill) can pack: the longest accepted run
        + 1 pending (LP re-feed), the warm-up window (its widest shape), the draft tree."""
        W, N = self.cfg.W, self.cfg.N
        window = (W + N - 3) + (W + N - 2) * (N - 2)
        return self.max_draft + 1 + window + self.draft_rows

    # -- the loop -----------------------------------------------------------

    def generate(
        self,
        prompt_ids: Sequence[int],
        eos_token_ids: Sequence[int] | int | None = None,
        streamer=None,
        tokenizer=None,
        on_step=None,
        cancel=None,
        on_emit=None,
    ) -> GenerationResult:
        """Decode up to ``cfg.max_new_tokens`` tokens after ``prompt_ids``.

        ``cancel``: a callable polled once per step; when it returns True the step's
        verified tokens are still published and generation ends (finish_reason
        "cancelled"). Under LP only rank 0's answer counts; it rides in the per-step
        exchange so every rank stops at the same step. ``on_emit(tokens, logprobs)``: called
        each step with the published tokens and, when ``cfg.logprobs``, their TokenLogprobs
        (else None)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self._check_request(prompt_ids)
        cfg = self.cfg
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        if cfg.stop_strings and tokenizer is None:
            raise ValueError("decoding.stop_strings needs a tokenizer to decode the output")
        if self.grammar_text is not None and tokenizer is None:
            raise ValueError("structured output (decoding.json_schema / grammar) needs the tokenizer")
        run = self._start(prompt_ids, set(eos_token_ids or []), tokenizer=tokenizer)
        stats = GenerationStats(workers=self.workers)
        if streamer is not None:
            streamer.put(torch.tensor([prompt_ids]))
        t_start = time.perf_counter()
        greedy_only = argmax_only(cfg, run)
        while not run.done:
            t0 = time.perf_counter()
            prop = self.propose(run)
            layout = self.lay_out(run, prop)
            t1 = time.perf_counter()
            raw_KV = self.runner.forward(layout, run.cache, argmax_only=greedy_only)
            logits_KV = raw_KV if run.proc is None else run.proc.apply(raw_KV, row_extras(layout))
            verdict = self.verify(run, prop, layout, logits_KV)  # the step's one device->host read
            run.lp_local = self.local_logprobs(prop, layout, raw_KV, verdict)
            t2 = time.perf_counter()
            asked = self.rank == 0 and cancel is not None and bool(cancel())
            path, z_all, cancelled = self.merge_verdicts(run, prop, verdict, asked)
            t3 = time.perf_counter()
            emitted = self.publish(run, path.emitted, cancelled, tokenizer)
            if run.proc is not None:
                run.proc.extend(emitted)
            self.grammar_commit(run, prop, emitted)
            lps = _logprobs(raw_KV, layout, path, len(emitted), cfg.top_logprobs) if cfg.logprobs else None
            if lps:
                run.logprobs.extend(lps)
            if on_emit is not None and emitted:
                on_emit(emitted, lps)
            if streamer is not None and emitted:
                streamer.put(torch.tensor(emitted))
            self.collect(run, prop, z_all, emitted)
            if not run.done:
                run.pending = self.commit(self.runner, run.cache, prop.cache_len, layout, path, emitted)
            t4 = time.perf_counter()
            rec = StepRecord(len(emitted), layout.num_rows, [s.rows for s in prop.plan], t2 - t1, t3 - t2,
                             (t1 - t0) + (t4 - t3))
            _record(stats, rec)
            if self.draft_store is not None and run.done:
                # the prompt's tail too, so a later request's context can match into the output
                self.draft_store.add(prompt_ids[-64:] + run.out)
            if on_step is not None:
                on_step(run.step, rec)
            run.step += 1
        stats.decode_time_s = time.perf_counter() - t_start
        if streamer is not None:
            streamer.end()
        _finish_stats(stats, len(run.out), self.workers)
        stats.forced_tokens = run.forced_tokens
        return GenerationResult(run.out, stats, run.finish, run.logprobs if cfg.logprobs else None)

    def _start(self, prompt_ids: list[int], eos: set[int], cache=None, tokenizer=None) -> _Run:
        """A run's state; ``cache``: the run's K/V (lp.engine.batch passes a view of its paged cache)."""
        cfg = self.cfg
        rng = random.Random(cfg.seed)
        window = Window(cfg.W, cfg.N, [rng.choice(prompt_ids) for _ in range(Window.seed_size(cfg.W, cfg.N))])
        pool = NGramPool(cfg.N, cfg.G)
        # the paper's prompt pool (drafts=pool); the suffix index covers prompt + output itself
        prompt_pool = cfg.prompt_pool and cfg.drafts == "pool"
        context = ContextIndex(prompt_ids) if prompt_pool else None
        if prompt_pool:
            pool.add_sequence(prompt_ids)
        index = SuffixIndex(prompt_ids) if cfg.drafts == "suffix" else None
        if index is not None and cfg.draft_budget == "auto" and self.tq is None:
            from lp.model.calibrate import row_cost_curve

            # every rank measures (or reads its cache) at the same time, so none waits out
            # parallel.timeout_s in the broadcast; rank 0's curve and kernel choice are used
            curve = row_cost_curve(self.runner)
            self.tq, small = self.merge.share_curve(curve, self.runner.small_rows)
            if self.runner.small_rows_mode == "auto":
                self.runner.small_rows = small  # rank 0's choice of kernel on every rank
        if cache is None:
            rows = self.max_step_rows()
            cache = self.runner.new_cache(len(prompt_ids) + cfg.max_new_tokens + rows, rows)
        lp_slots = 1 + 2 * cfg.top_logprobs if cfg.logprobs and self.workers > 1 else 0  # logprobs ride along
        self.merge.begin(Frame(self.max_draft + 1, self.draft_rows, cfg.W + cfg.N - 2, lp_slots))
        proc = RowProcessor(cfg, prompt_ids, self.runner.vocab_size, self.runner.device) if wants_processing(cfg) \
            else None
        grammar = None
        if self.grammar_text is not None:
            from lp.grammar.matcher import Chain, RowGrammar

            grammar = RowGrammar(self.grammar_text, tokenizer, self.runner.vocab_size, self.runner.device, sorted(eos))
            proc = grammar if proc is None else Chain([proc, grammar])  # the mask after bias / penalties
        return _Run(list(prompt_ids), list(prompt_ids), window, pool, context, cache, eos, index, proc=proc,
                    grammar=grammar)

    # -- stages -------------------------------------------------------------

    def propose(self, run: _Run) -> _Proposal:
        """Candidates keyed by x, whether the window rides along, and the shard plan."""
        opts = self.draft_options(run)
        cfg = self.cfg
        if cfg.drafts == "pool":
            candidates = _select_candidates(run.pool, run.context, opts.x, cfg.G, cfg.N - 1)
        else:
            # one process pads the step to the cheapest measured size (lp.drafts.budget.envelope);
            # LP workers hold different row counts, so they price the curve as measured
            candidates = select_tree(opts.scored, run.acceptance, opts.base, self.tq, self.draft_rows, opts.extra,
                                     self.workers, pad=self.workers == 1, gain=self.gain())
        return self.proposal(run, opts, candidates)

    def gain(self) -> float:
        """The factor the budget scales every node's P by (1.0 with decoding.draft_calibration off)."""
        return self.calibration.factor() if self.cfg.draft_calibration else 1.0

    def draft_options(self, run: _Run) -> "_Options":
        """What the budget chooses from: the scored drafts (suffix mode), the step's base rows
        and the window rows that ride along only with drafts (lp.engine.batch shares this stage)."""
        cfg = self.cfg
        x = run.pending[-1]
        window = run.window
        cache_len = run.cache.get_seq_length()
        p = cache_len + len(run.pending) - 1
        limit = self.runner.max_positions
        # near the end of the context, leave out rows whose positions would pass it
        # (models with learned position tables cannot embed them)
        window_fits = limit is None or p + window.depth + window.num_columns - 1 < limit
        opts = _Options(x, cache_len, p, window_fits)
        if cfg.drafts == "suffix":
            opts.scored = suffix_drafts(run.index, self.draft_store, run.tokens, cfg.max_draft_len, cfg.G,
                                        cfg.draft_alpha)
            opts.scored += [Scored(s, 0, 1.0) for s in run.pool.get(x, cfg.G)]
            if run.grammar is not None and cfg.G > 0:  # G = 0 turns every draft source off
                forced = run.grammar.forced(self.max_draft)
                if forced:
                    opts.scored.insert(0, Scored(forced, FORCED, 1.0))
            w_rows = 0
            if window_fits and cfg.window_policy != "off":
                w_rows = -(-column_rows(range(window.num_columns), window.depth) // self.workers)
            always = cfg.window_policy == "always" or len(run.pending) > 1
            opts.base = len(run.pending) + (w_rows if always else 0)
            opts.extra = 0 if always else w_rows
        return opts

    def proposal(self, run: _Run, opts: "_Options", candidates) -> _Proposal:
        """The step's proposal from the chosen candidates: context cut, window, shard plan."""
        cfg = self.cfg
        limit = self.runner.max_positions
        if limit is not None:
            room = limit - opts.p - 1
            candidates = list(dict.fromkeys(tuple(c[:room]) for c in candidates if room > 0))
        # window_policy=with_candidates: on hardware where any extra row is dear, the window
        # rows ride only on steps that verify candidates anyway (or prefill); other steps
        # are plain one-row decodes and leave the window as it is.
        use_window = (cfg.window_policy == "always" or bool(candidates) or len(run.pending) > 1) and opts.window_fits
        use_window = use_window and cfg.window_policy != "off"
        num_columns = run.window.num_columns if use_window else 0
        plan = plan_tree_shards(self.workers, len(run.pending), num_columns, run.window.depth, tuple(candidates))
        return _Proposal(opts.x, candidates, use_window, plan, opts.cache_len, opts.scored)

    def lay_out(self, run: _Run, prop: _Proposal):
        mine = prop.plan[self.rank]
        own = [prop.candidates[c] for c in mine.candidates]
        return build_tree_layout(run.pending, run.window.levels, mine.columns, own)

    def verify(self, run: _Run, prop: _Proposal, layout, logits_KV, argmax: list[int] | None = None):
        """The local verdict: greedy (Path over own candidates, z) or sampled (root, outcomes, z).
        ``argmax``: the kept rows' argmaxes when the caller read them already (lp.engine.batch)."""
        sk = layout.skeleton
        row_of = _row_index(sk)
        if not self.cfg.do_sample:
            if argmax is None:
                argmax = argmax_rows(logits_KV)  # the one device->host transfer
            z_local = [argmax[row_of[r]] for r in sk.z_rows]
            mine = prop.plan[self.rank]
            own = [prop.candidates[c] for c in mine.candidates]
            cand_argmax = [[argmax[row_of[r]] for r in rows] for rows in layout.cand_rows]
            return greedy_walk(own, argmax[row_of[sk.num_pending - 1]], cand_argmax), z_local
        return self._verify_sampled(run, prop, layout, logits_KV, row_of)

    def merge_verdicts(self, run: _Run, prop: _Proposal, verdict, cancel: bool):
        """(path over all candidates, z of every column in order, cancelled)."""
        return self.merge(self, run, prop, verdict, cancel)

    def payload(self, prop: _Proposal, verdict, lps: list[TokenLogprob] | None = None) -> list[int]:
        """This worker's verdict as its int64 exchange payload (lp.parallel.dist, this run's frame);
        ``lps``: its own walk's logprobs (``local_logprobs``) when the frame carries them."""
        frame = self.merge.frame
        if not self.cfg.do_sample:
            local, z_local = verdict
            own = prop.plan[self.rank].candidates
            winner = own[local.winner] if local.winner is not None else -1
            out = greedy_payload(frame, local.hits, winner, local.emitted, z_local)
        else:
            root, outcomes, z_local = verdict
            out = sampled_payload(frame, root, outcomes, z_local)
        if frame.logprobs:
            out = with_logprobs(frame, out, [(x.logprob, x.top) for x in lps])
        return out

    def local_logprobs(self, prop: _Proposal, layout, raw_KV: torch.Tensor, verdict) -> list[TokenLogprob] | None:
        """LP with logprobs: the raw logprobs of this worker's own walk (greedy: its local path;
        sampled: the walk from its own root through its own subtrees), read from its own rows;
        the exchange carries them to every rank (``payload`` / ``merge_rows``). None otherwise."""
        frame = self.merge.frame
        if frame is None or not frame.logprobs:
            return None
        if not self.cfg.do_sample:
            local = verdict[0]
        else:
            root, outcomes, _ = verdict
            own = [prop.candidates[c] for c in prop.plan[self.rank].candidates]
            local = walk(own, root, lambda depth, i: outcomes[layout.paths[i][depth - 1]])
        return _logprobs(raw_KV, layout, local, len(local.emitted), self.cfg.top_logprobs)

    def merge_rows(self, prop: _Proposal, rows: list[list[int]]) -> tuple[Path, list[int]]:
        """Every LP worker's payload (``rows[k]``) -> (path over all candidates, z of every
        column in order); the same on every rank."""
        frame = self.merge.frame
        if not self.cfg.do_sample:
            table = read_greedy(frame, rows, prop.plan)
            kb = max(range(len(table)), key=lambda k: (table[k].hits, -k))  # longest, lowest rank
            best = table[kb]
            z_all = [t for hit in table for t in hit.z]
            path = Path(best.emitted, best.winner if best.winner >= 0 else None, best.hits)
            return _with_logprobs(frame, path, rows[kb], rows[kb]), z_all
        roots, nodes, zs = read_sampled(frame, rows, prop.plan)
        owner = {c: (k, i) for k, s in enumerate(prop.plan) for i, c in enumerate(s.candidates)}
        tries = [merge_trie([prop.candidates[c] for c in s.candidates]) for s in prop.plan]

        def outcome(depth: int, c: int) -> int:
            k, i = owner[c]
            return nodes[k][tries[k].paths[i][depth - 1]]

        path = walk(prop.candidates, roots[0], outcome)
        k = owner[path.winner][0] if path.winner is not None else 0
        # the owner walked from its own root: the same path when its root is rank 0's
        return _with_logprobs(frame, path, rows[0], rows[k] if roots[k] == roots[0] else None), \
            [t for z in zs for t in z]

    def publish(self, run: _Run, emitted: list[int], cancelled: bool, tokenizer) -> list[int]:
        """Truncate by max_new_tokens, eos, stop strings; append; decide whether to stop."""
        cfg = self.cfg
        emitted = emitted[: cfg.max_new_tokens - len(run.out)]
        for i, t in enumerate(emitted):
            if t in run.eos:
                emitted = emitted[: i + 1]
                run.done, run.finish = True, "stop"
                break
        if cfg.stop_strings:
            emitted, hit = _cut_at_stop_string(tokenizer, run.out, emitted, cfg.stop_strings)
            if hit:
                run.done, run.finish = True, "stop"
        run.out.extend(emitted)
        run.tokens.extend(emitted)
        if not run.done and len(run.out) >= cfg.max_new_tokens:
            run.done, run.finish = True, "length"
        if not run.done and cancelled:
            run.done, run.finish = True, "cancelled"
        return emitted

    def collect(self, run: _Run, prop: _Proposal, z_all: list[int], emitted: list[int]) -> None:
        """Pool and window updates (identical on every worker: z_all and the path are shared)."""
        if prop.use_window:
            run.pool.add_ngrams(run.window.update(prop.x, z_all))
        if run.index is not None:
            if self.cfg.draft_calibration:  # before observe: the P the budget priced
                predicted = predicted_gain(prop.scored, prop.candidates, run.acceptance)
                if predicted is not None:
                    self.calibration.observe(predicted, max(0, len(emitted) - 1))
                elif not prop.candidates:  # no draft verified: the evidence fades toward the prior
                    self.calibration.idle()
            observe(run.acceptance, prop.scored, prop.candidates, emitted)
            run.index.extend(emitted)
        if run.context is not None:
            run.pool.add_sequence(run.tokens, start=len(run.tokens) - len(emitted) - (self.cfg.N - 1))
            run.context.extend(emitted)

    def grammar_commit(self, run: _Run, prop: _Proposal, emitted: list[int]) -> None:
        """Count the emitted tokens the grammar's forced draft gave; a matcher with no valid
        continuation ends the run with finish_reason "length" (never invalid output as valid)."""
        g = run.grammar
        if g is None:
            return
        forced = next((s.tokens for s in prop.scored if s.match_len == FORCED), ())
        k = 0  # the draft's accepted prefix (the step's last token is the model's own)
        while k < len(emitted) - 1 and k < len(forced) and emitted[k] == forced[k]:
            k += 1
        run.forced_tokens += k
        if g.dead and not run.done:
            run.done, run.finish = True, "length"

    # -- helpers ------------------------------------------------------------

    def _state_hash(self, run: _Run) -> int:
        if self.group is None or not self.group.check_divergence:
            return 0
        return (run.pool.fingerprint() ^ run.window.fingerprint() ^ hash(tuple(run.out))) & 0x7FFFFFFFFFFF

    def _draw(self, run: _Run, probs_V: torch.Tensor, position: int, kids) -> int:
        """The sampled token at output ``position`` (lp.lookahead.sampling.sample_at): a function of
        the seed, the position and the target distribution alone. ``kids``, the drafts tested at
        this node, never enter the draw (one is accepted iff it equals the token, by the walk):
        they are passed so that a test can plant a verifier that lets them in."""
        return sample_at(probs_V, self.cfg.seed, position)

    def _verify_sampled(self, run: _Run, prop: _Proposal, layout, logits_KV, row_of):
        cfg = self.cfg
        sk = layout.skeleton
        mine = prop.plan[self.rank]
        candidates = prop.candidates
        z_local = logits_KV[[row_of[r] for r in sk.z_rows]].argmax(-1).tolist() if sk.z_rows else []

        def probs(row: int) -> torch.Tensor:
            return warp(logits_KV[row_of[row]], cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)

        first = len(run.out)  # the output position the root row predicts
        root = self._draw(run, probs(sk.num_pending - 1), first, children(candidates, range(len(candidates)), 0))

        cand_rows = layout.cand_rows

        def outcome_of(local_c: int, depth: int) -> int:
            c = mine.candidates[local_c]
            kids = children(candidates, sharing_prefix(candidates, c, depth), depth)
            return self._draw(run, probs(cand_rows[local_c][depth - 1]), first + depth, kids)

        if self.group is None:
            return walk(candidates, root, lambda depth, c: outcome_of(c, depth)), z_local
        # LP: the outcome at every node of this worker's subtrees, by local trie node
        # (candidates sharing a node share its row, so any of them gives its outcome)
        nodes = len(sk.tree_rows)
        outcomes = [0] * nodes
        done = [False] * nodes
        for i, path in enumerate(layout.paths):
            for depth, node in enumerate(path, start=1):
                if not done[node]:
                    outcomes[node], done[node] = outcome_of(i, depth), True
        return root, outcomes, z_local


def argmax_only(cfg: DecodingConfig, run: _Run) -> bool:
    """Whether a run's step logits feed only their argmax (lp.kernels.head may screen the LM head):
    greedy, no processor (logit bias, penalties, grammar), no logprobs."""
    return not cfg.do_sample and run.proc is None and not cfg.logprobs


@functools.lru_cache(maxsize=4096)
def _row_index(sk) -> dict[int, int]:
    """Row -> index among the kept rows (the logits' first dimension)."""
    return {row: i for i, row in enumerate(sk.keep)}


@dataclass(frozen=True)
class MergedPath(Path):
    """LP with logprobs: the merged path and its tokens' logprobs, from the rank that verified them."""

    logprobs: tuple = ()


def _with_logprobs(frame: Frame, path: Path, first: list[int], rest: list[int] | None) -> Path:
    """``path`` with its logprobs when the frame carries them: the first token's from the payload
    ``first``, the accepted ones' from ``rest`` (None: that rank walked another way, only reached
    if two ranks' root rows differ in their last bits; those tokens' logprobs are NaN)."""
    if not frame.logprobs:
        return path
    entries = read_logprobs(frame, first, 1)
    entries += read_logprobs(frame, rest, len(path.emitted))[1:] if rest is not None else \
        [(float("nan"), ())] * (len(path.emitted) - 1)
    lps = tuple(TokenLogprob(t, c, top) for t, (c, top) in zip(path.emitted, entries))
    return MergedPath(path.emitted, path.winner, path.hits, lps)


def _logprobs(raw_KV: torch.Tensor, layout, path: Path, count: int, top: int) -> list[TokenLogprob]:
    """Raw logprobs of the first ``count`` emitted tokens, read from the rows that verified them:
    the ordinary row, then the accepted candidate's rows (one process: candidate = own candidate);
    under LP the merged path carries them (``MergedPath``, from the exchange)."""
    if count == 0:
        return []
    if isinstance(path, MergedPath):
        return list(path.logprobs[:count])
    row_of = _row_index(layout.skeleton)
    rows = [layout.skeleton.num_pending - 1]
    if path.winner is not None:
        rows += list(layout.cand_rows[path.winner][: path.hits])
    rows = rows[:count]
    lp_RV = torch.log_softmax(raw_KV[[row_of[r] for r in rows]].float(), dim=-1)
    tokens = path.emitted[:count]
    chosen = lp_RV.gather(1, torch.tensor(tokens, device=lp_RV.device)[:, None])[:, 0].tolist()
    if top:
        vals, ids = lp_RV.topk(top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [()] * len(rows)
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(tokens, chosen, tops)]


def _record(stats: GenerationStats, rec: StepRecord) -> None:
    stats.steps += 1
    n = rec.emitted
    if len(stats.accept_hist) <= n:
        stats.accept_hist.extend([0] * (n + 1 - len(stats.accept_hist)))
    stats.accept_hist[n] += 1
    stats.records.append(rec)


def _finish_stats(stats: GenerationStats, new_tokens: int, workers: int) -> None:
    stats.new_tokens = new_tokens
    stats.forward_time_s = sum(r.forward_s for r in stats.records)
    stats.exchange_time_s = sum(r.exchange_s for r in stats.records)
    stats.host_time_s = sum(r.host_s for r in stats.records)
    decode_records = stats.records[1:] or stats.records  # the first step also prefills the prompt
    stats.mean_rows = sum(r.rows for r in decode_records) / len(decode_records)
    stats.mean_rows_per_rank = [
        sum(r.rows_per_rank[k] for r in decode_records) / len(decode_records) for k in range(workers)
    ]


def _select_candidates(pool: NGramPool, context: ContextIndex | None, x: int, G: int, R: int) -> list:
    """Up to G suffixes keyed by ``x``: prompt/output n-grams ranked by shared left context
    first (when the prompt pool is on), then the pool's most recent entries."""
    if G == 0:
        return []
    if context is None:
        return pool.get(x, G)
    out = context.lookup(R, G)
    for suffix in pool.get(x):
        if len(out) == G:
            break
        if suffix not in out:
            out.append(suffix)
    return out


def _cut_at_stop_string(tokenizer, out: list[int], emitted: list[int], stop_strings) -> tuple[list[int], bool]:
    """Keep ``emitted`` up to (and including) the token that completes a stop string.

    Earlier output holds no stop string (generation would have ended), so any
    occurrence in the decoded tail was completed by one of the new tokens."""
    tail = out[-32:]
    for i in range(len(emitted)):
        text = tokenizer.decode(tail + emitted[: i + 1])
        if any(s in text for s in stop_strings):
            return emitted[: i + 1], True
    return emitted, False
