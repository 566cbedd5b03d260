"""Continuous batching behind lp.serve: one decode loop (``run``, on the thread that loaded the
model) stepping a ``lp.engine.batch.BatchEngine``, in one process or as rank 0 of Lookahead
Parallelism.

Contract: ``BatchedEngine`` faces the HTTP side with ``submit``, ``queue_depth``, ``ready``,
``request_stop``, ``workers``, ``max_queue``, ``failed`` and the job events of
``lp.server.engine.Job`` (``("prompt_logprobs", [TokenLogprob])`` once the prompt is in for a
job asking for them, ``("logprobs", ...)`` and ``("tokens", ids)`` per step, then
``("done", Outcome)`` or ``("error", ApiError)``). Scheduling is per iteration: at every step boundary the thread
hands newly submitted jobs to the batch engine (FIFO; they start when ``server.max_batch``
and the K/V reservation allow, their prompts fed in chunks of ``server.max_prefill_tokens``
rows inside the same forward as the others' decode rows), aborts cancelled ones (their
blocks are freed at once) and runs one batched step.

``submit`` validates a request against the K/V pool at once (``ApiError`` 400 for one
that can never fit ``server.kv_tokens``) and raises ``QueueFull`` when
``server.max_queue`` requests already wait to start.

Under LP (``group``) every rank holds the same batch: joins, aborts and admissions are
decided by rank 0 only and ride with the step. Before each step rank 0 sends one STEP
message through ``lp.parallel.dist.RequestChannel`` (``lp.server.engine.pack_step``: the requests
that joined, each with rank 0's request id, the ids aborted, the ids the step admits and the
prompt rows each finds in rank 0's prefix cache; every rank holds the same block tables and
checks its own hits agree),
then every rank runs the same ``BatchEngine.step``; the other ranks run ``worker_loop``,
which replays the message and steps. With nothing to do rank 0 sends an IDLE header every
``heartbeat_s``, and SHUTDOWN once ``request_stop`` ends the loop. A dead or stuck worker surfaces as
``WorkerFailure`` on rank 0 within ``parallel.timeout_s`` (the step's exchange or the
channel): the engine logs it, fails every request with 503 and calls ``on_fatal``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from lp.engine.batch import BatchEngine
from lp.model.gguf import trim_heap
from lp.model.paged import BLOCK_SIZE
from lp.parallel.dist import RequestChannel, WorkerFailure
from lp.server.engine import Outcome, QueueFull, Unavailable, pack_step, unpack_step
from lp.server.protocol import ApiError

log = logging.getLogger("lp.serve")

GRAMMAR_IDLE_S = 2.0  # seconds without requests after which rank 0 builds the grammar matcher (BatchedEngine)


class BatchedEngine:
    def __init__(self, runner, tokenizer, eos: list[int], max_queue: int, max_batch: int, kv_tokens: int,
                 max_prefill_tokens: int | None, metrics=None, on_fatal=None, draft_store=None, tq_curve=None,
                 group=None, heartbeat_s: float = 5.0, prefix_cache: bool = False, batch_cost=None,
                 kv_block: int = BLOCK_SIZE):
        self.batch = BatchEngine(runner, kv_tokens, block_size=kv_block, max_batch=max_batch,
                                 max_prefill_tokens=max_prefill_tokens,
                                 tq_curve=tq_curve, draft_store=draft_store, group=group, prefix_cache=prefix_cache,
                                 batch_cost=batch_cost)
        self.group = group
        self.workers = self.batch.workers  # LP workers (x parallel.tp processes)
        self.channel = RequestChannel(group) if group is not None else None
        self.heartbeat_s = heartbeat_s
        self._joined: list = []  # (id, prompt ids, decoding, prompt_logprobs, prompt_only) since the last STEP (LP)
        self._aborted: list[int] = []  # ids aborted since the last STEP message (LP)
        self.tokenizer = tokenizer
        self.eos = eos
        self.max_queue = max_queue
        self.metrics = metrics
        self.on_fatal = on_fatal
        self._new: collections.deque = collections.deque()  # submitted, not yet handed to the batch engine
        self._jobs: dict[int, object] = {}  # batch request id -> Job (queued in the engine or running)
        self._cfgs: dict[int, object] = {}  # batch request id -> its DecodingConfig, resolved for the hardware
        self._cond = threading.Condition()
        self.stopping = False
        self.failed: str | None = None
        self._thread: threading.Thread | None = None  # the thread in run()
        # the grammar matcher's one-time set-up (llguidance's tokenizer: 0.3 s for SmolLM2's 49,152 tokens,
        # 1.2 s for Gemma-3's 262,144), paid before the first structured request but never beside serving
        # (the build holds the GIL: beside the first requests it stalled their steps). Under LP every rank
        # builds its own before serving (worker_loop); alone, the loop builds it once the server has been
        # idle GRAMMAR_IDLE_S (a restart answers sooner; a grammar request arriving first builds it itself)
        self._warm_later = None
        if tokenizer is not None:
            if group is not None:
                _warm_grammar(tokenizer, runner.vocab_size, eos)
            else:
                self._warm_later = lambda: _warm_grammar(tokenizer, runner.vocab_size, eos)

    # -- API for the HTTP side ---------------------------------------------

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.stopping and self.failed is None

    def run(self) -> None:
        """Run the decode loop in the calling thread until ``request_stop`` or a failure
        (lp.serve: the main thread, where the model was loaded and its t(Q) timed). Measured
        on this project's 2-core EPYC: torch's OpenMP matmuls in a second thread, while the
        thread that loaded the model keeps its own OpenMP pool, ran 30% slower (SmolLM2's
        linears at 8 rows: 44.8 ms against 34.2; 33 against 50 tok/s decoding), so the
        decode loop stays on the thread that owns the pool and HTTP runs beside it."""
        self._thread = threading.current_thread()
        self._loop()

    def submit(self, job) -> None:
        try:
            self.batch.check(job.prompt_ids, job.decoding, self.tokenizer)
        except ValueError as e:
            raise ApiError(str(e), code="invalid_value") from None
        with self._cond:
            if self.failed is not None or self.stopping:
                raise Unavailable(self.failed or "the server is shutting down")
            if self.queue_depth() >= self.max_queue:
                raise QueueFull()
            self._new.append(job)
            self._cond.notify()

    def queue_depth(self) -> int:
        """Requests waiting to start: submitted or queued in the batch engine, less those the
        running batch has room for (they join at the next step boundary)."""
        pending = len(self._new) + len(self.batch.waiting)
        room = max(0, self.batch.max_batch - len(self.batch.running))
        return max(0, pending - room)

    def request_stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify()

    # -- the decode thread ---------------------------------------------------

    def _loop(self) -> None:
        last = time.monotonic()  # the last message to the workers (LP)
        try:
            while True:
                warm = False
                with self._cond:
                    while not self._new and not self.batch.has_work and not self.stopping:
                        if self.channel is None:
                            if self._warm_later is None:
                                self._cond.wait()
                            elif not self._cond.wait(timeout=GRAMMAR_IDLE_S) and not self._new:
                                warm = True  # idle that long: the grammar matcher's set-up now
                                break
                            continue
                        left = self.heartbeat_s - (time.monotonic() - last)
                        if left <= 0:
                            break
                        self._cond.wait(timeout=left)
                    if self.stopping:
                        break
                    new, self._new = list(self._new), collections.deque()
                if warm:
                    self._warm_later, build = None, self._warm_later
                    build()
                    continue
                for job in new:
                    self._join(job)
                self._reap_cancelled()
                admit = cached = None
                if self.channel is not None:
                    admit, cached = self._announce()
                    last = time.monotonic()
                if self.batch.has_work:
                    self._step(admit, cached)
                    if not self.batch.has_work:  # the burst is over: its activations' heap back to the OS
                        trim_heap()
                self._gauges()
        except WorkerFailure as e:
            self._fatal(f"worker failure: {e}")
        except Exception as e:  # noqa: BLE001  (a bug: never leave the server wedged)
            log.exception("decode thread crashed")
            self._fatal(f"decode thread crashed: {type(e).__name__}: {e}")
        finally:
            self._drain("the server is shutting down" if self.failed is None else self.failed)
            if self.channel is not None and self.failed is None:
                try:
                    self.channel.send(RequestChannel.SHUTDOWN)
                    log.info("sent shutdown to %d other rank(s)", self.group.world_size - 1)
                except WorkerFailure as e:
                    log.error("could not send shutdown to the workers: %s", e)

    def _announce(self) -> tuple[list[int], list[int] | None]:
        """LP: the step's joins, aborts and admissions (with their prefix-cache hits) to every
        rank (one STEP message), or an IDLE heartbeat when nothing changed and nothing runs.
        -> the ids the step admits and their cached rows."""
        run = self.batch.has_work
        admit = self.batch.admissions() if run else []
        if not (run or self._joined or self._aborted):
            self.channel.send(RequestChannel.IDLE)
            return admit, None
        cached = self.batch.cached_rows(admit)  # rank 0's prefix-cache hits ride with the admissions
        fields, payload = pack_step(self._joined, self._aborted, admit, run, cached)
        self._joined, self._aborted = [], []
        self.channel.send(RequestChannel.STEP, fields, payload)
        return admit, cached

    def _fatal(self, msg: str) -> None:
        log.error("[lp.serve] %s; shutting down the server", msg)
        with self._cond:
            self.failed = msg
        if self.on_fatal is not None:
            self.on_fatal()

    def _join(self, job) -> None:
        if job.cancelled:
            self._count(job, "cancelled")
            job.emit("error", ApiError("cancelled", status=499, type="cancelled"))
            return
        try:
            rid = self.batch.add(job.prompt_ids, job.decoding, self.eos, self.tokenizer,
                                 prompt_logprobs=job.prompt_logprobs, prompt_only=job.prompt_only)
        except ValueError as e:
            job.emit("error", ApiError(str(e), code="invalid_value"))
            return
        self._jobs[rid] = job
        self._cfgs[rid] = self.batch.waiting[-1].decoder.cfg
        if self.channel is not None:
            self._joined.append((rid, job.prompt_ids, job.decoding, job.prompt_logprobs, job.prompt_only))

    def _reap_cancelled(self) -> None:
        """Abort the cancelled jobs (their blocks are free at once), update the gauges, then
        answer them: a running one with its partial result (finish_reason "cancelled")."""
        reaped = []
        for rid, job in list(self._jobs.items()):
            if job.cancelled:
                running = any(r.id == rid for r in self.batch.running)
                self.batch.abort(rid)
                if self.channel is not None:
                    self._aborted.append(rid)
                del self._jobs[rid]
                reaped.append((rid, job, self.batch.result(rid) if running else None))
        if not reaped:
            return
        self._gauges()
        for rid, job, res in reaped:
            if res is not None:
                self._done(rid, job, res)
            else:
                self._cfgs.pop(rid, None)
                self._count(job, "cancelled")
                job.emit("error", ApiError("cancelled", status=499, type="cancelled"))

    def _step(self, admit: list[int] | None, cached: list[int] | None = None) -> None:
        outs = self.batch.step(admit, cached)
        now = time.perf_counter()
        for r in self.batch.running:
            job = self._jobs.get(r.id)
            if job is not None and job.started is None:
                job.started = now
        for o in outs:
            job = self._jobs.get(o.request_id)
            if job is None:
                continue
            if job.started is None:
                job.started = now
            if job.prompt_logprobs is not None and not job.prompt_sent:  # the prompt is in: its logprobs first
                job.prompt_sent = True
                job.emit("prompt_logprobs", self.batch.prompt_logprobs(o.request_id))
            if o.new_tokens:
                if job.first_token is None:
                    job.first_token = now
                if o.logprobs is not None:
                    job.emit("logprobs", o.logprobs)  # before their tokens: the stream attaches them to that chunk
                job.emit("tokens", list(o.new_tokens))
            if o.finished:
                del self._jobs[o.request_id]
                self._done(o.request_id, job, self.batch.result(o.request_id))
        if self.metrics is not None:
            self.metrics.step_rows.observe(self.batch.last_rows)

    def _gauges(self) -> None:
        if self.metrics is not None:
            m = self.metrics
            m.queue_depth.set(self.queue_depth())
            m.running.set(len(self.batch.running))
            m.batch_running.set(len(self.batch.running))
            m.kv_blocks.set(self.batch.blocks_in_use)
            m.prefix_cached_blocks.set(len(self.batch.cache.blocks.digest_of))
            m.observe_evictions(self.batch.cache.blocks.evictions)

    def _done(self, rid: int, job, res) -> None:
        ttft = None if job.first_token is None else job.first_token - job.arrived
        if self.metrics is not None:
            self.metrics.observe_result(job.endpoint, res, len(job.prompt_ids), ttft)
        started = job.started if job.started is not None else time.perf_counter()
        job.emit("done", Outcome(res, self._cfgs.pop(rid, job.decoding), ttft, started - job.arrived))

    def _count(self, job, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(job.endpoint, outcome).inc()

    def _drain(self, why: str) -> None:
        with self._cond:
            jobs = list(self._new) + list(self._jobs.values())
            self._new, self._jobs = collections.deque(), {}
        for job in jobs:
            job.emit("error", ApiError(why, status=503, type="server_error", code="unavailable"))


def _warm_grammar(tokenizer, vocab_size: int, eos) -> None:
    from lp.grammar.matcher import warm

    try:
        log.info("[lp.serve] the grammar matcher (llguidance's tokenizer) ready in %.1f s",
                 warm(tokenizer, vocab_size, eos))
        trim_heap()  # the build's copies of the vocabulary (Gemma-3's 262,144 tokens: ~180 MB) back to the OS
    except Exception:  # noqa: BLE001 - the first grammar request builds it again and reports its error
        log.exception("[lp.serve] warming the grammar matcher failed; the first grammar request will build it")


# ---------------------------------------------------------------------------
# ranks 1..K-1


def worker_loop(engine: BatchEngine, tokenizer, eos: list[int], base, group) -> None:
    """Replay rank 0's batch until SHUTDOWN: each STEP message's joins (with rank 0's ids),
    aborts, then the step with rank 0's admissions. ``base``: the server's decoding config
    (the per-request fields ride in the message). Raises WorkerFailure when rank 0 stays
    silent past parallel.timeout_s or a collective fails."""
    channel = RequestChannel(group)
    if tokenizer is not None:  # the grammar matcher's set-up, as rank 0's BatchedEngine does (lp.grammar)
        _warm_grammar(tokenizer, engine.runner.vocab_size, eos)
    steps = 0
    while True:
        kind, fields, payload = channel.recv()
        if kind == RequestChannel.IDLE:
            continue
        if kind == RequestChannel.SHUTDOWN:
            log.info("rank %d: shutdown from rank 0 after %d step(s)", group.rank, steps)
            return
        joins, aborts, admits, cached, run = unpack_step(fields, payload, base)
        for rid, prompt_ids, d, prompt_logprobs, prompt_only in joins:  # rank 0 accepted them: the same checks pass
            engine.add(prompt_ids, d, eos, tokenizer, request_id=rid, prompt_logprobs=prompt_logprobs,
                       prompt_only=prompt_only)
        for rid in aborts:
            engine.abort(rid)
            engine.result(rid)
        assert run == engine.has_work, (run, engine.has_work)
        if run:
            for out in engine.step(admits, cached):  # rank 0's prefix-cache hits: a RuntimeError if not ours
                if out.finished:
                    engine.result(out.request_id)  # rank 0 answers; nothing kept here
            steps += 1
