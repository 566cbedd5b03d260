"""What the HTTP side and the decode engine share, and the int64 wire format of requests.

Contract: ``Job`` is one HTTP request on its way through the engine
(``lp.server.batched.BatchedEngine``, in one process and under LP alike): its events reach
its asyncio handler through ``loop.call_soon_threadsafe``: ``("tokens", ids)`` for each
step's verified tokens, then ``("done", Outcome)`` or ``("error", ApiError)``;
``job.cancel()`` (a client went away) stops it at the next step boundary. ``QueueFull`` and
``Unavailable`` are what ``submit`` raises.

Under LP (torchrun) rank 0 hands the batch's changes to every rank through
``lp.parallel.dist.RequestChannel`` as int64s, no pickling: ``pack_request`` (one request: header
fields + prompt ids, stop strings, logit bias) and ``pack_step`` (one step's joins, each a
packed request with rank 0's request id, its aborts and its admissions). A structured request's
grammar (llguidance text, lp.grammar) rides as its UTF-8 bytes, 8 to an int64, so every rank builds the
same matcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import threading
import time
from typing import NamedTuple
from dataclasses import dataclass, field

from lp.config import DecodingConfig


class QueueFull(Exception):
    pass


class Unavailable(Exception):
    pass


@dataclass
class Outcome:
    result: object  # lp.engine.decoder.GenerationResult
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
    prompt_logprobs: int | None = None  # lp.engine.batch's add(prompt_logprobs=...) (completions echo + logprobs)
    prompt_only: bool = False  # add(prompt_only=True): echo with max_tokens 0
    prompt_sent: bool = False  # its ("prompt_logprobs", ...) event went out (lp.server.batched)
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


# ---------------------------------------------------------------------------
# request <-> int64 header fields + payload (no pickling)

_POLICIES = [None, "always", "with_candidates"]


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _i2f(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(i)))[0]


def pack_request(prompt_ids: list[int], d: DecodingConfig) -> tuple[list[int], list[int]]:
    """Header fields and payload for RequestChannel: the per-request decoding settings,
    then the prompt ids followed by each stop string as [byte length, bytes...], the logit
    bias as [token, value bits] pairs and the grammar text (``_pack_text``; None: [-1])."""
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
        int(d.logprobs),
        d.top_logprobs,
    ]
    payload = list(prompt_ids)
    for s in d.stop_strings:
        b = s.encode("utf-8")
        payload += [len(b), *b]
    for t, b in d.logit_bias.items():
        payload += [int(t), _f2i(b)]
    payload += _pack_text(d.grammar)  # structured output: every rank builds the same matcher (lp.grammar)
    return fields, payload


def _pack_text(text: str | None) -> list[int]:
    """[-1] for None, else [byte length, the UTF-8 bytes 8 to an int64 (little-endian, zero-padded)...]."""
    if text is None:
        return [-1]
    b = text.encode("utf-8")
    words = struct.unpack(f"<{-(-len(b) // 8)}q", b.ljust(-(-len(b) // 8) * 8, b"\0"))
    return [len(b), *words]


def _unpack_text(payload: list[int], i: int) -> tuple[str | None, int]:
    """(the text ``_pack_text`` put at ``payload[i]``, the index after it)."""
    n = payload[i]
    if n < 0:
        return None, i + 1
    k = -(-n // 8)
    b = struct.pack(f"<{k}q", *payload[i + 1 : i + 1 + k])[:n]
    return b.decode("utf-8"), i + 1 + k


def unpack_request(fields: list[int], payload: list[int], base: DecodingConfig) -> tuple[list[int], DecodingConfig]:
    n_prompt, max_new, W, N, G, do_sample, temp, top_k, top_p, seed, n_stop, policy, pool = fields[:13]
    rep, freq, pres, min_p, n_bias, logprobs, top_logprobs = fields[13:20]
    prompt_ids = payload[:n_prompt]
    stops, i = [], n_prompt
    for _ in range(n_stop):
        n = payload[i]
        stops.append(bytes(payload[i + 1 : i + 1 + n]).decode("utf-8"))
        i += 1 + n
    bias = {payload[i + 2 * k]: _i2f(payload[i + 2 * k + 1]) for k in range(n_bias)}
    grammar, i = _unpack_text(payload, i + 2 * n_bias)
    assert i == len(payload), (i, len(payload))
    d = dataclasses.replace(
        base, max_new_tokens=max_new, W=None if W < 0 else W, N=None if N < 0 else N, G=None if G < 0 else G,
        do_sample=bool(do_sample), temperature=_i2f(temp), top_k=top_k, top_p=_i2f(top_p), seed=seed,
        stop_strings=stops, window_policy=_POLICIES[policy], prompt_pool=bool(pool),
        repetition_penalty=_i2f(rep), frequency_penalty=_i2f(freq), presence_penalty=_i2f(pres), min_p=_i2f(min_p),
        logprobs=bool(logprobs), top_logprobs=top_logprobs,
        logit_bias=bias, grammar=grammar,
    )
    return prompt_ids, d


class Join(NamedTuple):
    """One joining request of a step message: rank 0's request id, its prompt ids and decoding,
    and the job's lp.engine.batch ``add`` arguments (echo with logprobs / max_tokens 0)."""

    rid: int
    prompt_ids: list[int]
    decoding: DecodingConfig
    prompt_logprobs: int | None = None
    prompt_only: bool = False


def pack_step(joins: list[tuple[int, list[int], DecodingConfig]], aborts: list[int], admits: list[int],
              run: bool, cached: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Header fields and payload of one step's changes (rank 0 -> every rank): ``joins`` =
    [(request id, prompt ids, decoding[, prompt_logprobs, prompt_only])] (the last two: the job's
    lp.engine.batch ``add`` arguments, echo with logprobs / max_tokens 0), the aborted ids, the
    ids the step admits, the prompt rows each admitted one finds in rank 0's prefix cache
    (``cached``, None: none, lp.engine.batch ``cached_rows``), and whether a step runs. Payload:
    per join [id, n_fields, fields..., n_payload, payload..., prompt_logprobs (-1: None),
    prompt_only], then the aborted ids, then the admitted ids, then their cached rows."""
    cached = [0] * len(admits) if cached is None else list(cached)
    assert len(cached) == len(admits), (admits, cached)
    payload = []
    for rid, prompt_ids, d, prompt_logprobs, prompt_only in (Join(*j) for j in joins):
        fields, body = pack_request(prompt_ids, d)
        payload += [rid, len(fields), *fields, len(body), *body, -1 if prompt_logprobs is None else prompt_logprobs,
                    int(prompt_only)]
    payload += list(aborts) + list(admits) + cached
    return [len(joins), len(aborts), len(admits), int(run)], payload


def unpack_step(fields: list[int], payload: list[int], base: DecodingConfig):
    """-> (joins [Join], aborted ids, admitted ids, their cached rows, run)."""
    n_joins, n_aborts, n_admits, run = fields[:4]
    joins, i = [], 0
    for _ in range(n_joins):
        rid, nf = payload[i], payload[i + 1]
        req_fields = payload[i + 2 : i + 2 + nf]
        nb = payload[i + 2 + nf]
        body = payload[i + 3 + nf : i + 3 + nf + nb]
        plp, only = payload[i + 3 + nf + nb], bool(payload[i + 4 + nf + nb])
        joins.append(Join(rid, *unpack_request(req_fields, body, base), None if plp < 0 else plp, only))
        i += 5 + nf + nb
    aborts = payload[i : i + n_aborts]
    admits = payload[i + n_aborts : i + n_aborts + n_admits]
    cached = payload[i + n_aborts + n_admits : i + n_aborts + 2 * n_admits]
    assert i + n_aborts + 2 * n_admits == len(payload), (i, n_aborts, n_admits, len(payload))
    return joins, aborts, admits, cached, bool(run)
