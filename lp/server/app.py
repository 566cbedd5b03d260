"""The FastAPI app: OpenAI-compatible routes over one ``lp.server.batched.BatchedEngine``.

Contract: ``create_app(engine, ctx, metrics)`` returns the app; it never runs torch
itself (decoding happens in the engine's thread). Routes:

    POST /v1/chat/completions, POST /v1/completions   stream true (SSE, ends ``data: [DONE]``) or false
    GET  /v1/models     the served model's id
    GET  /health        200 {"status": "ok", ..., "memory": rank 0's memory plan} while the engine serves, else 503
    GET  /metrics       Prometheus text

Request bodies are read raw and validated by ``lp.server.protocol`` (so invalid JSON and
wrong types are 400s with OpenAI's error body, not FastAPI's 422). A full queue is a 429
with Retry-After; a request that can never fit the K/V pool a 400. With an API key
(``server.api_key`` or env ``LP_API_KEY``) the /v1 routes need ``Authorization: Bearer
<key>`` (401 otherwise). Only verified tokens are streamed; a client that disconnects (streaming:
a failed write, noticed within ~1 s thanks to SSE keep-alive comments; non-streaming:
polled every ~1 s, tokens arriving or not) cancels its job at the next decoding step. ``n`` > 1 submits one job
per choice and answers them together (streamed: their chunks interleaved, each carrying its
choice's ``index``, one usage chunk and one [DONE] at the end). Completions with ``echo`` and
``logprobs`` carry the prompt's own logprobs first (the engine's prompt logprobs; streamed: the
echo chunk carries them); with ``server.prefix_cache``
usage carries ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lp.server.detok import Detokenizer
from lp.server.engine import Job, QueueFull, Unavailable
from lp.server.metrics import ServerMetrics
from lp.engine.decoder import TokenLogprob
from lp.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    ServingContext,
    chat_logprobs,
    choice_seed,
    chunk,
    completion_logprobs,
    full_response,
    lookahead_info,
    new_id,
    parse,
    prepare,
    usage,
    usage_chunk,
)

log = logging.getLogger("lp.serve")
KEEPALIVE_S = 1.0
MAX_BODY_BYTES = 16 * 1024 * 1024


def _error(e: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine, ctx: ServingContext, metrics: ServerMetrics, retry_after_s: int = 1,
               api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="lp.serve", docs_url=None, redoc_url=None)

    if api_key:
        app.add_middleware(_ApiKey, key=api_key)

    @app.get("/health")
    async def health():
        if engine.ready:
            return {"status": "ok", "model": ctx.model_id, "workers": engine.workers,
                    "queue_depth": engine.queue_depth(), "memory": ctx.memory}
        return JSONResponse({"status": "unavailable", "reason": engine.failed or "stopping"}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": ctx.model_id, "object": "model", "created": 0, "owned_by": "lp"}]}

    routes = _Completions(engine, ctx, metrics, retry_after_s)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await routes.complete(request, "chat", ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await routes.complete(request, "completions", CompletionRequest)

    return app


class _ApiKey:
    """Like vLLM's --api-key: the OpenAI routes need ``Authorization: Bearer <key>``, /health
    and /metrics do not. A plain ASGI middleware: Starlette's BaseHTTPMiddleware
    (``@app.middleware``) hides a client's disconnect from ``request.is_disconnected()``, so a
    non-streaming request whose client went away would decode to the end."""

    def __init__(self, app, key: str):
        self.app, self.want = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.want):
                resp = _error(ApiError("Invalid or missing API key (Authorization: Bearer <key>).", status=401,
                                       code="invalid_api_key"))
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)


_CANCELLED = dict(status=503, type="server_error", code="cancelled")  # a generation cut by the server's shutdown


def _prompt_part(tok, prep, prompt_lps) -> tuple[dict, int]:
    """The echoed prompt's logprobs (the first token's logprob and top_logprobs null, as
    OpenAI's) and the text offset after them."""
    first, *rest = prompt_lps
    head = completion_logprobs(tok, [TokenLogprob(prep.prompt_ids[0], None)], 0)
    head["top_logprobs"] = [None]
    offset = len(tok.decode([prep.prompt_ids[0]]))
    body = completion_logprobs(tok, rest, offset)
    offset += sum(len(t) for t in body["tokens"])
    return {k: head[k] + body[k] for k in head}, offset


def _echo_logprobs(tok, prep, res, lps) -> dict:
    """Completions with echo + logprobs: the prompt's tokens first, then the completion's,
    offsets over the echoed text."""
    part, offset = _prompt_part(tok, prep, res.prompt_logprobs)
    body = completion_logprobs(tok, lps, offset)
    return {k: part[k] + body[k] for k in part}


def _usage(ctx, prep, res) -> dict:
    """OpenAI's usage; with server.prefix_cache also prompt_tokens_details.cached_tokens (the
    prompt rows whose K/V came from the prefix cache)."""
    use = usage(len(prep.prompt_ids), len(res.output_ids))
    if getattr(ctx.limits, "prefix_cache", False):
        use["prompt_tokens_details"] = {"cached_tokens": res.stats.cached_tokens}
    return use


def _as_tool_calls(body: dict, prep, text: str) -> dict:
    """A chat answer that is a call (lp.server.tools.answer: a complete call of an allowed tool,
    finish_reason "tool_calls"; a required / named call cut short, its finish reason kept) as
    OpenAI's ``message.tool_calls``; any other answer as it is."""
    if prep.tools is None:
        return body
    from lp.server.tools import answer

    choice = body["choices"][0]
    calls, choice["finish_reason"] = answer(prep.tools, text, choice["finish_reason"])
    if calls is not None:
        choice["message"] = {"role": "assistant", "content": None,
                             "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]}
    return body


class _Completions:
    """The two OpenAI completion routes: parse and check the request, submit its job to
    the engine, answer whole or as a stream of server-sent events."""

    def __init__(self, engine, ctx: ServingContext, metrics: ServerMetrics, retry_after_s: int):
        self.engine, self.ctx, self.metrics, self.retry_after_s = engine, ctx, metrics, retry_after_s

    async def complete(self, request: Request, kind: str, cls):
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            body = await request.body()
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(f"The request body is larger than {MAX_BODY_BYTES} bytes.", code="body_too_large",
                               status=413)
            prep = prepare(parse(cls, body), self.ctx)
        except ApiError as e:
            self.metrics.requests.labels(endpoint, "invalid").inc()
            log.info("%d %s: %s", e.status, endpoint, e.message)
            return _error(e)
        except Exception as e:  # noqa: BLE001  (e.g. a tokenizer refusing some input): still the client's input
            self.metrics.requests.labels(endpoint, "invalid").inc()
            log.warning("400 %s: %s: %s", endpoint, type(e).__name__, e)
            return _error(ApiError(f"The input could not be processed: {type(e).__name__}: {e}", code="invalid_value"))
        if prep.n > 1 and prep.stream:
            return self._stream_choices(kind, endpoint, prep)
        if prep.n > 1:
            return await self._choices(request, kind, endpoint, prep)
        job = self._job(endpoint, prep, prep.decoding)
        refused = self._submit(job, endpoint)
        if refused is not None:
            return refused
        rid = new_id(kind)
        if prep.user:
            log.info("%s for user %r", rid, prep.user)
        detok = Detokenizer(self.ctx.tokenizer, prep.decoding.stop_strings)
        if prep.stream:
            return StreamingResponse(self._stream(job, kind, rid, detok, prep), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, job, kind, rid, detok, prep)

    def _job(self, endpoint: str, prep, decoding) -> Job:
        return Job(endpoint, prep.prompt_ids, decoding, loop=asyncio.get_running_loop(), events=asyncio.Queue(),
                   prompt_logprobs=prep.prompt_logprobs, prompt_only=prep.prompt_only)

    async def _choices(self, request, kind, endpoint, prep):
        """``n`` > 1 (not streamed): one job per choice (choice i sampled with seed + i wrapped
        into int64, ``choice_seed``; greedy ones are alike), answered together: choices in order,
        usage counting the prompt once."""
        jobs, refused = self._choice_jobs(endpoint, prep)
        if refused is not None:
            return refused
        rid = new_id(kind)
        try:
            answers = await asyncio.gather(*(self._whole(request, job, kind, rid, Detokenizer(
                self.ctx.tokenizer, prep.decoding.stop_strings), prep) for job in jobs))
        finally:
            for job in jobs:
                job.cancel()
        bad = next((a for a in answers if a.status_code != 200), None)
        if bad is not None:
            return bad
        bodies = [json.loads(a.body) for a in answers]
        out = bodies[0]
        out["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
        use = out["usage"]
        use["completion_tokens"] = sum(b["usage"]["completion_tokens"] for b in bodies)
        use["total_tokens"] = use["prompt_tokens"] + use["completion_tokens"]
        out["lookahead"] = {**out["lookahead"], "choices": [b["lookahead"] for b in bodies]}
        return JSONResponse(out)

    def _choice_jobs(self, endpoint, prep):
        """One job per choice (choice i sampled with ``choice_seed(seed, i)``; greedy ones alike), all
        submitted; -> (jobs, None) or (None, the refusal) with the submitted ones cancelled."""
        jobs = [self._job(endpoint, prep, dataclasses.replace(prep.decoding, seed=choice_seed(prep.decoding.seed, i))
                          if prep.decoding.do_sample else prep.decoding) for i in range(prep.n)]
        for k, job in enumerate(jobs):
            refused = self._submit(job, endpoint)
            if refused is not None:
                for j in jobs[:k]:
                    j.cancel()
                return None, refused
        return jobs, None

    def _stream_choices(self, kind, endpoint, prep):
        """``n`` > 1 streamed: the choices' streams interleaved as their tokens come, every chunk
        carrying its choice's ``index``; one usage chunk (the prompt once, every choice's
        completion tokens) and one ``[DONE]`` at the end."""
        jobs, refused = self._choice_jobs(endpoint, prep)
        if refused is not None:
            return refused
        rid = new_id(kind)

        async def merged():
            queue, ends = asyncio.Queue(), [None] * len(jobs)

            async def pump(i, job):
                try:
                    detok = Detokenizer(self.ctx.tokenizer, prep.decoding.stop_strings)
                    async for event in self._stream(job, kind, rid, detok, prep, index=i, ends=ends):
                        await queue.put(event)
                finally:
                    await queue.put(None)

            tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
            try:
                left = len(tasks)
                while left:
                    event = await queue.get()
                    if event is None:
                        left -= 1
                    else:
                        yield event
                results = [e for e in ends if e is not None]
                if prep.include_usage and len(results) == len(jobs):
                    use = _usage(self.ctx, prep, results[0])
                    use["completion_tokens"] = sum(len(r.output_ids) for r in results)
                    use["total_tokens"] = use["prompt_tokens"] + use["completion_tokens"]
                    yield _sse(usage_chunk(kind, rid, self.ctx.model_id, use))
                yield "data: [DONE]\n\n"
            finally:
                for t in tasks:
                    t.cancel()
                for job in jobs:
                    job.cancel()

        return StreamingResponse(merged(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _submit(self, job: Job, endpoint: str):
        """Queue the job; None, or the error response when the engine refuses it."""
        try:
            self.engine.submit(job)
        except QueueFull:
            self.metrics.requests.labels(endpoint, "rejected_queue_full").inc()
            return _error(ApiError(f"The server's queue is full ({self.engine.max_queue} waiting); retry later.",
                                   status=429, type="rate_limit_exceeded", code="queue_full"),
                          headers={"Retry-After": str(self.retry_after_s)})
        except Unavailable as e:
            return _error(ApiError(f"The server is unavailable: {e}", status=503, type="server_error",
                                   code="unavailable"))
        except ApiError as e:  # the batched engine refuses a request that can never fit its K/V pool
            self.metrics.requests.labels(endpoint, "invalid").inc()
            log.info("%d %s: %s", e.status, endpoint, e.message)
            return _error(e)
        return None

    def _logprobs(self, kind, lps, offset):
        if kind == "chat":
            return chat_logprobs(self.ctx.tokenizer, lps)
        return completion_logprobs(self.ctx.tokenizer, lps, offset)

    def _info(self, out, prep) -> dict:
        """The response's ``lookahead`` object (and ``output_ids`` when asked for)."""
        la = lookahead_info(out.result, out.decoding, self.engine.workers, out.ttft_s, out.queue_s)
        if prep.return_token_ids:
            la["output_ids"] = list(out.result.output_ids)
        return la

    async def _whole(self, request, job, kind, rid, detok, prep):
        lps = []
        clock = asyncio.get_running_loop().time
        poll_at = clock() + KEEPALIVE_S
        try:
            while True:
                try:
                    ev, data = await asyncio.wait_for(job.events.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    ev, data = None, None
                if ev is None or clock() >= poll_at:  # every ~KEEPALIVE_S, however often tokens arrive
                    poll_at = clock() + KEEPALIVE_S
                    if await request.is_disconnected():
                        log.info("client of %s went away; cancelling", rid)
                        job.cancel()
                        return Response(status_code=499)
                    if ev is None:
                        continue
                if ev == "tokens":
                    detok.ids.extend(data)
                elif ev == "logprobs":
                    lps.extend(data)
                elif ev == "error":
                    return _error(data)
                elif ev == "done":
                    res = data.result
                    if res.finish_reason == "cancelled":
                        return _error(ApiError("The request was cancelled (server shutting down).", **_CANCELLED))
                    text = detok.content()
                    logprobs = self._logprobs(kind, lps[: len(res.output_ids)], 0) if prep.decoding.logprobs else None
                    if prep.echo_text is not None:
                        if res.prompt_logprobs is not None:
                            logprobs = _echo_logprobs(self.ctx.tokenizer, prep, res, lps[: len(res.output_ids)])
                        text = prep.echo_text + text
                    body = full_response(kind, rid, self.ctx.model_id, text, res.finish_reason,
                                         _usage(self.ctx, prep, res), self._info(data, prep), logprobs)
                    return JSONResponse(_as_tool_calls(body, prep, text))
        finally:
            job.cancel()  # no-op once done; stops the decode if this handler is torn down

    async def _stream(self, job, kind, rid, detok, prep, index: int = 0, ends: list | None = None):
        """One choice's server-sent events. ``index``: the choice's index in every chunk;
        ``ends`` (n > 1): no usage chunk and no [DONE] here (the merged stream sends them),
        the result goes to ``ends[index]``. Echo with logprobs: the echoed prompt's chunk waits
        for the prompt's logprobs (the ``prompt_logprobs`` event, before any token)."""
        model_id = self.ctx.model_id
        done = False
        lps, offset = [], 0  # logprobs waiting for their tokens' chunk; completions' text offset
        held = [] if prep.tools is not None else None  # tools: the answer is text or a call, known at the end

        def sse(obj) -> str:
            for c in obj.get("choices", ()):
                c["index"] = index
            return _sse(obj)

        try:
            yield sse(chunk(kind, rid, model_id, "", role=True))
            if prep.echo_text is not None and prep.prompt_logprobs is None:
                yield sse(chunk(kind, rid, model_id, prep.echo_text))
            while True:
                try:
                    ev, data = await asyncio.wait_for(job.events.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"  # a write to a vanished client fails here
                    continue
                if ev == "prompt_logprobs":  # echo + logprobs: the prompt, with its logprobs, first
                    part, offset = _prompt_part(self.ctx.tokenizer, prep, data)
                    yield sse(chunk(kind, rid, model_id, prep.echo_text, logprobs=part))
                elif ev == "logprobs":
                    lps = data
                elif ev == "tokens":
                    delta = detok.push(data)
                    if held is not None:
                        held.append(delta)
                    elif lps:
                        yield sse(chunk(kind, rid, model_id, delta, logprobs=self._logprobs(kind, lps, offset)))
                        offset += sum(len(self.ctx.tokenizer.decode([t.token])) for t in lps)
                        lps = []
                    elif delta:
                        yield sse(chunk(kind, rid, model_id, delta))
                elif ev == "error":
                    done = True
                    yield _sse(data.body())
                    if ends is None:
                        yield "data: [DONE]\n\n"
                    return
                elif ev == "done":
                    done = True
                    if ends is not None and data.result.finish_reason != "cancelled":
                        ends[index] = data.result
                    for event in self._stream_end(data, kind, rid, detok, prep, held, sse, ends is None):
                        yield event
                    return
        finally:
            if not done:
                log.info("client of %s went away; cancelling its generation", rid)
            job.cancel()

    def _stream_end(self, out, kind, rid, detok, prep, held=None, sse=_sse, last: bool = True):
        """The last events of a stream: the text's tail, the finish chunk, then (``last``: not
        one choice of several) usage and [DONE]."""
        model_id, res = self.ctx.model_id, out.result
        if res.finish_reason == "cancelled":
            yield _sse(ApiError("The request was cancelled (server shutting down).", **_CANCELLED).body())
            if last:
                yield "data: [DONE]\n\n"
            return
        tail = detok.finish()
        finish = res.finish_reason
        if held is not None:  # tools: one delta with the call (OpenAI's delta.tool_calls), or the text
            from lp.server.tools import answer

            text = "".join(held) + tail
            calls, finish = answer(prep.tools, text, finish)
            if calls is not None:
                if calls:
                    c = chunk(kind, rid, model_id, None)
                    c["choices"][0]["delta"]["tool_calls"] = calls
                    yield sse(c)
                tail = ""
            else:
                tail = text
        if tail:
            yield sse(chunk(kind, rid, model_id, tail))
        yield sse(chunk(kind, rid, model_id, None if kind == "chat" else "", finish,
                        lookahead=self._info(out, prep)))
        if not last:
            return
        if prep.include_usage:
            yield _sse(usage_chunk(kind, rid, model_id, _usage(self.ctx, prep, res)))
        yield "data: [DONE]\n\n"
