"""The decode engine: one decode thread, a bounded FIFO, and the LP worker-side loop.

Contract: rank 0 builds ``Engine(...)``, ``start()``s it and ``submit()``s ``Job``s from
the HTTP handlers; one sequence decodes at a time, in one background thread (torch work
stays off the event loop). ``submit`` raises ``QueueFull`` when ``server.max_queue``
requests already wait behind the running one, ``Unavailable`` once the engine failed or
is stopping. A job's events reach its asyncio handler through
``loop.call_soon_threadsafe``: ``("tokens", ids)`` for each step's verified tokens,
then ``("done", Outcome)`` or ``("error", ApiError)``. ``job.cancel()`` (a client went
away) stops its generation at the next step through ``generate(cancel=...)``; a queued
cancelled job is dropped without decoding.

Under LP (torchrun, ``group`` set) rank 0's decode thread hands every request to all
ranks through ``lp.dist.RequestChannel`` (header fields + token ids, see
``pack_request``), sends an IDLE header every ``heartbeat_s`` while nothing is queued,
and a SHUTDOWN header on ``stop()``. The other ranks run ``worker_loop`` and decode the
same request in step. A dead or stuck worker surfaces as ``WorkerFailure`` on rank 0
within ``parallel.timeout_s``: the engine logs it, fails the running and queued
requests with 503, and calls ``on_fatal`` so the HTTP server exits.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import struct
import threading
import time
from dataclasses import dataclass, field

from lp.config import DecodingConfig
from lp.dist import RequestChannel, WorkerFailure
from lp.server.protocol import ApiError

log = logging.getLogger("lp.serve")


class QueueFull(Exception):
    pass


class Unavailable(Exception):
    pass


@dataclass
class Outcome:
    result: object  # lp.decoding.GenerationResult
    decoding: DecodingConfig  # W/N/G resolved for the hardware
    ttft_s: float | None
    queue_s: float


@dataclass(eq=False)
class Job:
    endpoint: str
    prompt_ids: list[int]
    decoding: DecodingConfig
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, kind: str, data) -> None:
        if self.loop is None or self.events is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, data))
        except RuntimeError:  # the event loop is closed (server shut down)
            pass


class _Streamer:
    """generate()'s streamer: drops the prompt, forwards each step's verified tokens."""

    def __init__(self, job: Job):
        self.job = job
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        ids = [int(t) for t in (value.reshape(-1).tolist() if hasattr(value, "reshape") else value)]
        if ids:
            if self.job.first_token is None:
                self.job.first_token = time.perf_counter()
            self.job.emit("tokens", ids)

    def end(self) -> None:
        pass


# ---------------------------------------------------------------------------
# request <-> int64 header fields + payload (no pickling)

_POLICIES = [None, "always", "with_candidates"]


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _i2f(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(i)))[0]


def pack_request(prompt_ids: list[int], d: DecodingConfig) -> tuple[list[int], list[int]]:
    """Header fields and payload for RequestChannel: the per-request decoding settings,
    then the prompt ids followed by each stop string as [byte length, bytes...]."""
    fields = [
        len(prompt_ids),
        d.max_new_tokens,
        -1 if d.W is None else d.W,
        -1 if d.N is None else d.N,
        -1 if d.G is None else d.G,
        int(d.do_sample),
        _f2i(d.temperature),
        d.top_k,
        _f2i(d.top_p),
        d.seed,
        len(d.stop_strings),
        _POLICIES.index(d.window_policy),
        int(d.prompt_pool),
        _f2i(d.repetition_penalty),
        _f2i(d.frequency_penalty),
        _f2i(d.presence_penalty),
        _f2i(d.min_p),
        len(d.logit_bias),
    ]
    payload = list(prompt_ids)
    for s in d.stop_strings:
        b = s.encode("utf-8")
        payload += [len(b), *b]
    for t, b in d.logit_bias.items():
        payload += [int(t), _f2i(b)]
    return fields, payload


def unpack_request(fields: list[int], payload: list[int], base: DecodingConfig) -> tuple[list[int], DecodingConfig]:
    n_prompt, max_new, W, N, G, do_sample, temp, top_k, top_p, seed, n_stop, policy, pool = fields[:13]
    rep, freq, pres, min_p, n_bias = fields[13:18]
    prompt_ids = payload[:n_prompt]
    stops, i = [], n_prompt
    for _ in range(n_stop):
        n = payload[i]
        stops.append(bytes(payload[i + 1 : i + 1 + n]).decode("utf-8"))
        i += 1 + n
    bias = {payload[i + 2 * k]: _i2f(payload[i + 2 * k + 1]) for k in range(n_bias)}
    d = dataclasses.replace(
        base, max_new_tokens=max_new, W=None if W < 0 else W, N=None if N < 0 else N, G=None if G < 0 else G,
        do_sample=bool(do_sample), temperature=_i2f(temp), top_k=top_k, top_p=_i2f(top_p), seed=seed,
        stop_strings=stops, window_policy=_POLICIES[policy], prompt_pool=bool(pool),
        repetition_penalty=_i2f(rep), frequency_penalty=_i2f(freq), presence_penalty=_i2f(pres), min_p=_i2f(min_p),
        logit_bias=bias,
    )
    return prompt_ids, d


# ---------------------------------------------------------------------------
# rank 0


class Engine:
    def __init__(self, runner, tokenizer, eos: list[int], group, max_queue: int, heartbeat_s: float,
                 metrics=None, on_fatal=None, draft_store=None):
        self.runner = runner
        self.draft_store = draft_store  # lp.suffix.DraftStore shared by all requests, or None
        self.tokenizer = tokenizer
        self.eos = eos
        self.group = group
        self.workers = group.lp_size if group is not None else 1  # LP workers (x parallel.tp processes)
        self.channel = RequestChannel(group) if group is not None else None
        self.max_queue = max_queue
        self.heartbeat_s = heartbeat_s
        self.metrics = metrics
        self.on_fatal = on_fatal
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self.running: Job | None = None
        self.stopping = False
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._loop, name="lp-decode", daemon=True)

    # -- API for the HTTP side ---------------------------------------------

    @property
    def ready(self) -> bool:
        return self._thread.is_alive() and not self.stopping and self.failed is None

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.failed is not None or self.stopping:
                raise Unavailable(self.failed or "the server is shutting down")
            busy = 1 if self.running is not None else 0
            if len(self._waiting) + busy >= self.max_queue + 1:
                raise QueueFull()
            self._waiting.append(job)
            self._set_depth()
            self._cond.notify()

    def queue_depth(self) -> int:
        return len(self._waiting)

    def request_stop(self) -> None:
        """Stop taking requests and cancel the running one at its next step (a signal handler)."""
        with self._cond:
            self.stopping = True
            if self.running is not None:
                self.running.cancel()
            self._cond.notify()

    def stop(self, timeout: float) -> None:
        """Cancel the running request, fail the queued ones, send SHUTDOWN to the workers."""
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("decode thread did not stop within %.0f s", timeout)

    # -- the decode thread ---------------------------------------------------

    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.running.set(1 if self.running is not None else 0)

    def _loop(self) -> None:
        last = time.monotonic()
        try:
            while True:
                with self._cond:
                    while not self._waiting and not self.stopping:
                        left = self.heartbeat_s - (time.monotonic() - last)
                        if self.channel is not None and left <= 0:
                            break
                        self._cond.wait(timeout=left if self.channel is not None else None)
                    if self.stopping:
                        break
                    job = self._waiting.popleft() if self._waiting else None
                    self.running = job
                    self._set_depth()
                if job is None:  # idle: heartbeat to the workers
                    self.channel.send(RequestChannel.IDLE)
                    last = time.monotonic()
                    continue
                try:
                    if job.cancelled:  # its client went away while it waited
                        if self.metrics is not None:
                            self.metrics.requests.labels(job.endpoint, "cancelled").inc()
                        job.emit("error", ApiError("cancelled", status=499, type="cancelled"))
                        continue
                    self._decode(job)
                finally:
                    with self._cond:
                        self.running = None
                        self._set_depth()
                last = time.monotonic()
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

    def _decode(self, job: Job) -> None:
        from lp.decoding import LookaheadDecoder

        job.started = time.perf_counter()
        try:
            decoder = LookaheadDecoder(self.runner, job.decoding, self.group, draft_store=self.draft_store)
        except ValueError as e:
            job.emit("error", ApiError(str(e), code="invalid_value"))
            return
        if self.channel is not None:
            fields, payload = pack_request(job.prompt_ids, job.decoding)
            self.channel.send(RequestChannel.REQUEST, fields, payload)
        try:
            def on_emit(tokens, logprobs):
                if logprobs is not None:
                    job.emit("logprobs", logprobs)  # before their tokens: the stream attaches them to that chunk

            res = decoder.generate(job.prompt_ids, self.eos, streamer=_Streamer(job), tokenizer=self.tokenizer,
                                   cancel=lambda: job.cancelled, on_emit=on_emit)
        except WorkerFailure as e:
            job.emit("error", ApiError(f"an LP worker failed: {e}", status=503, type="server_error",
                                       code="worker_failure"))
            raise
        except ValueError as e:  # rejected before the first step, on every rank alike
            job.emit("error", ApiError(str(e), code="invalid_value"))
            return
        except Exception as e:
            job.emit("error", ApiError(f"internal error: {type(e).__name__}", status=500, type="server_error"))
            if self.group is not None:
                raise  # the ranks may be out of step: stop the server
            log.exception("request failed")
            return
        ttft = None if job.first_token is None else job.first_token - job.arrived
        if self.metrics is not None:
            self.metrics.observe_result(job.endpoint, res, len(job.prompt_ids), ttft)
        job.emit("done", Outcome(res, decoder.cfg, ttft, job.started - job.arrived))

    def _drain(self, why: str) -> None:
        with self._cond:
            jobs, self._waiting = list(self._waiting), collections.deque()
            self._set_depth()
        for job in jobs:
            job.emit("error", ApiError(why, status=503, type="server_error", code="unavailable"))

    def _fatal(self, msg: str) -> None:
        log.error("[lp.serve] %s; shutting down the server", msg)
        with self._cond:
            self.failed = msg
        self._drain(msg)
        if self.on_fatal is not None:
            self.on_fatal()


# ---------------------------------------------------------------------------
# ranks 1..K-1


def worker_loop(runner, tokenizer, eos: list[int], group, base: DecodingConfig, draft_store=None) -> None:
    """Decode every request rank 0 announces, until SHUTDOWN. Raises WorkerFailure when rank 0
    stays silent past parallel.timeout_s or a collective fails."""
    from lp.decoding import LookaheadDecoder

    channel = RequestChannel(group)
    served = 0
    while True:
        kind, fields, payload = channel.recv()
        if kind == RequestChannel.IDLE:
            continue
        if kind == RequestChannel.SHUTDOWN:
            log.info("rank %d: shutdown from rank 0 after %d request(s)", group.rank, served)
            return
        prompt_ids, d = unpack_request(fields, payload, base)
        try:
            LookaheadDecoder(runner, d, group, draft_store=draft_store).generate(prompt_ids, eos, tokenizer=tokenizer)
        except ValueError as e:  # rank 0 rejected it at the same point, before any exchange
            log.warning("rank %d: request rejected: %s", group.rank, e)
        served += 1
