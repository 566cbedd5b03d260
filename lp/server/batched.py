"""Continuous batching behind lp.serve: one decode thread stepping a ``lp.batch.BatchEngine``.

Contract: the same face to the HTTP side as ``lp.server.engine.Engine`` (``submit``,
``queue_depth``, ``ready``, ``stop``, ``request_stop``, ``workers``, ``max_queue``,
``failed``) and the same job events (``("tokens", ids)`` per step, then ``("done",
Outcome)`` or ``("error", ApiError)``). Scheduling is per iteration: at every step
boundary the thread hands newly submitted jobs to the batch engine (FIFO; they start
when ``server.max_batch`` and the K/V reservation allow, their prompts fed in chunks of
``server.max_prefill_tokens`` rows inside the same forward as the others' decode rows),
aborts cancelled ones (their blocks are freed at once) and runs one batched step.

``submit`` validates a request against the K/V pool at once (``ApiError`` 400 for one
that can never fit ``server.kv_tokens``) and raises ``QueueFull`` when
``server.max_queue`` requests already wait to start. One process only: under LP the
server keeps the one-at-a-time ``Engine``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from lp.batch import BatchEngine
from lp.server.engine import Outcome, QueueFull, Unavailable
from lp.server.protocol import ApiError

log = logging.getLogger("lp.serve")


class BatchedEngine:
    workers = 1

    def __init__(self, runner, tokenizer, eos: list[int], max_queue: int, max_batch: int, kv_tokens: int,
                 max_prefill_tokens: int | None, metrics=None, on_fatal=None, draft_store=None, tq_curve=None):
        self.batch = BatchEngine(runner, kv_tokens, max_batch=max_batch, max_prefill_tokens=max_prefill_tokens,
                                 tq_curve=tq_curve, draft_store=draft_store)
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
        self._thread = threading.Thread(target=self._loop, name="lp-decode", daemon=True)

    # -- API for the HTTP side ---------------------------------------------

    @property
    def ready(self) -> bool:
        return self._thread.is_alive() and not self.stopping and self.failed is None

    def start(self) -> "BatchedEngine":
        self._thread.start()
        return self

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

    def stop(self, timeout: float) -> None:
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("decode thread did not stop within %.0f s", timeout)

    # -- the decode thread ---------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._new and not self.batch.has_work and not self.stopping:
                        self._cond.wait()
                    if self.stopping:
                        break
                    new, self._new = list(self._new), collections.deque()
                for job in new:
                    self._join(job)
                self._reap_cancelled()
                if self.batch.has_work:
                    self._step()
                self._gauges()
        except Exception as e:  # noqa: BLE001  (a bug: never leave the server wedged)
            log.exception("decode thread crashed")
            self.failed = f"decode thread crashed: {type(e).__name__}: {e}"
            if self.on_fatal is not None:
                self.on_fatal()
        finally:
            self._drain("the server is shutting down" if self.failed is None else self.failed)

    def _join(self, job) -> None:
        if job.cancelled:
            self._count(job, "cancelled")
            job.emit("error", ApiError("cancelled", status=499, type="cancelled"))
            return
        try:
            rid = self.batch.add(job.prompt_ids, job.decoding, self.eos, self.tokenizer)
        except ValueError as e:
            job.emit("error", ApiError(str(e), code="invalid_value"))
            return
        self._jobs[rid] = job
        self._cfgs[rid] = self.batch.waiting[-1].decoder.cfg

    def _reap_cancelled(self) -> None:
        """Abort the cancelled jobs (their blocks are free at once), update the gauges, then
        answer them: a running one with its partial result (finish_reason "cancelled")."""
        reaped = []
        for rid, job in list(self._jobs.items()):
            if job.cancelled:
                running = any(r.id == rid for r in self.batch.running)
                self.batch.abort(rid)
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

    def _step(self) -> None:
        outs = self.batch.step()
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
