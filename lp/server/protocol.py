"""OpenAI wire format: request models, validation into a DecodingConfig, response bodies, errors.

Contract: ``parse(ChatRequest | CompletionRequest, body_bytes)`` validates a raw request
body (strict JSON types: a string where a number belongs, a bool where an integer belongs,
NaN, ... are rejected) and ``prepare(req, ctx)`` turns it into the prompt's token ids and
a validated ``DecodingConfig``. Every problem is an ``ApiError`` carrying the HTTP status
and OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``; nothing here
touches the model. Request fields not sent take the server's ``decoding`` group values
(so a request without ``temperature`` decodes greedily under the default config);
``temperature: 0`` is greedy, ``> 0`` samples. ``lookahead: {W, N, G, return_token_ids}``
is an extension: W/N/G bounded by ``server.max_W/max_N/max_G``; ``return_token_ids`` adds
the completion's token ids (``output_ids``) to the response's ``lookahead`` object.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from lp.config import DecodingConfig
from lp.server.config import ServerConfig

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------
# request models (strict: no coercion between JSON types)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class LookaheadParams(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid")
    W: int | None = None
    N: int | None = None
    G: int | None = None
    return_token_ids: bool = False  # the completion's token ids in the response's lookahead object


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    lookahead: LookaheadParams | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]


def parse(cls: type[_Common], body: bytes) -> _Common:
    import json

    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"We could not parse the JSON body of your request ({e}).", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError("The request body must be a JSON object.", code="invalid_json")
    try:  # JSON may escape lone surrogates (\ud800) that no tokenizer or UTF-8 encoder accepts
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError("The request contains invalid Unicode (a lone surrogate).", code="invalid_json") from None
    try:
        return cls.model_validate(data, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if not _is_type_tag(x)]
        param = ".".join(loc) or None
        got = err.get("input")
        if err["type"] == "missing":
            msg = f"Missing required parameter: '{param}'."
            code = "missing_required_parameter"
        elif err["type"] == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: '{param}'."
            code = "unknown_parameter"
        else:
            msg = f"Invalid value for '{param}': {err['msg']} (got {_short(got)})."
            code = "invalid_type" if err["type"].endswith("_type") or err["type"] == "model_type" else "invalid_value"
        raise ApiError(msg, param=param, code=code) from None


def _is_type_tag(x) -> bool:
    # pydantic puts the union member's type in the location ("stop.str", "prompt.list[int]")
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "none") or x.startswith("list[")
                                   or x.startswith("function-"))


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# ---------------------------------------------------------------------------
# validation into a decode job


@dataclass
class ServingContext:
    """What validation needs to know about the served model and the server's limits."""
    model_id: str
    tokenizer: object
    vocab_size: int
    max_positions: int | None
    base: DecodingConfig  # the server's decoding group: every request's defaults
    limits: ServerConfig


@dataclass
class Prepared:
    prompt_ids: list[int]
    decoding: DecodingConfig
    stream: bool
    include_usage: bool
    return_token_ids: bool = False


def prepare(req: _Common, ctx: ServingContext) -> Prepared:
    if req.model is not None and req.model != ctx.model_id:
        raise ApiError(f"The model '{req.model}' does not exist; this server serves '{ctx.model_id}'.",
                       param="model", code="model_not_found")
    if req.n is not None and req.n != 1:
        raise ApiError(f"Invalid value for 'n': only n=1 is supported (got {req.n}).", param="n", code="invalid_value")
    prompt_ids, prompt_param = _prompt_ids(req, ctx)
    d = _decoding(req, ctx, len(prompt_ids), prompt_param)
    stream = bool(req.stream)
    return Prepared(prompt_ids, d, stream, bool(stream and req.stream_options and req.stream_options.include_usage),
                    bool(req.lookahead and req.lookahead.return_token_ids))


def _prompt_ids(req: _Common, ctx: ServingContext) -> tuple[list[int], str]:
    tok = ctx.tokenizer
    if isinstance(req, ChatRequest):
        if not req.messages:
            raise ApiError("Invalid value for 'messages': expected a non-empty array.", param="messages",
                           code="empty_array")
        if not getattr(tok, "chat_template", None):
            raise ApiError("This model has no chat template; use /v1/completions.", param="messages",
                           code="no_chat_template")
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # the template itself may reject a conversation (roles, order)
            raise ApiError(f"The chat template rejected these messages: {e}", param="messages",
                           code="invalid_value") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids], "messages"
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise ApiError("Invalid value for 'prompt': only one prompt per request is supported.",
                           param="prompt", code="invalid_value")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise ApiError("Invalid value for 'prompt': expected a non-empty string.", param="prompt",
                           code="invalid_value")
        return [int(t) for t in tok(p)["input_ids"]], "prompt"
    if not p:
        raise ApiError("Invalid value for 'prompt': expected a non-empty string or array of token ids.",
                       param="prompt", code="invalid_value")
    if any(t < 0 or t >= ctx.vocab_size for t in p):
        raise ApiError(f"Invalid value for 'prompt': token ids must be in [0, {ctx.vocab_size}).",
                       param="prompt", code="invalid_value")
    return list(p), "prompt"


def _decoding(req: _Common, ctx: ServingContext, prompt_len: int, prompt_param: str) -> DecodingConfig:
    lim, base = ctx.limits, ctx.base

    def bad(param: str, what: str, got) -> ApiError:
        return ApiError(f"Invalid value for '{param}': {what} (got {_short(got)}).", param=param, code="invalid_value")

    # max tokens: max_completion_tokens (current name) wins over max_tokens (legacy)
    max_new = None
    for name in ("max_tokens", "max_completion_tokens"):
        v = getattr(req, name)
        if v is None:
            continue
        if v < 1:
            raise bad(name, "expected an integer >= 1", v)
        if v > lim.max_tokens:
            raise bad(name, f"this server allows at most {lim.max_tokens}", v)
        max_new = v
    room = None if ctx.max_positions is None else ctx.max_positions - prompt_len
    if room is not None and room < 1:
        raise ApiError(f"This model's maximum context length is {ctx.max_positions} tokens; your prompt has "
                       f"{prompt_len} tokens.", param=prompt_param, code="context_length_exceeded")
    if max_new is None:
        max_new = min(base.max_new_tokens, lim.max_tokens, room if room is not None else base.max_new_tokens)
    elif room is not None and max_new > room:
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise ApiError(f"This model's maximum context length is {ctx.max_positions} tokens; you requested "
                       f"{prompt_len + max_new} tokens ({prompt_len} in the prompt, {max_new} for the completion).",
                       param=param, code="context_length_exceeded")

    upd: dict = {"max_new_tokens": max_new}
    if req.temperature is not None:
        if not 0 <= req.temperature <= 2:
            raise bad("temperature", "expected a number in [0, 2]", req.temperature)
        if req.temperature == 0:
            upd["do_sample"] = False
        else:
            upd.update(do_sample=True, temperature=float(req.temperature))
    if req.top_p is not None:
        if not 0 < req.top_p <= 1:
            raise bad("top_p", "expected a number in (0, 1]", req.top_p)
        upd["top_p"] = float(req.top_p)
    if req.top_k is not None:
        if req.top_k < 0:
            raise bad("top_k", "expected an integer >= 0 (0: off)", req.top_k)
        upd["top_k"] = req.top_k
    if req.seed is not None:
        if not INT64_MIN <= req.seed <= INT64_MAX:
            raise bad("seed", "expected a 64-bit integer", req.seed)
        upd["seed"] = req.seed
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if len(stops) > lim.max_stop:
            raise bad("stop", f"at most {lim.max_stop} stop sequences", req.stop)
        if any(s == "" for s in stops):
            raise bad("stop", "stop sequences must be non-empty", req.stop)
        upd["stop_strings"] = stops
    if req.lookahead is not None:
        la = req.lookahead
        for name, lo, hi in (("W", 1, lim.max_W), ("N", 2, lim.max_N), ("G", 0, lim.max_G)):
            v = getattr(la, name)
            if v is None:
                continue
            if not lo <= v <= hi:
                raise bad(f"lookahead.{name}", f"this server allows {lo} <= {name} <= {hi}", v)
            upd[name] = v
    d = dataclasses.replace(base, **upd)
    try:
        return d.validate()
    except ValueError as e:  # should not happen after the checks above; still a client error
        raise ApiError(str(e), code="invalid_value") from None


# ---------------------------------------------------------------------------
# response bodies


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def lookahead_info(result, decoding: DecodingConfig, workers: int, ttft_s: float | None, queue_s: float) -> dict:
    st = result.stats
    return {
        "steps": st.steps,
        "compression_ratio": round(st.compression_ratio, 4),
        "decode_time_s": round(st.decode_time_s, 4),
        "tokens_per_second": round(st.tokens_per_second, 3),
        "time_to_first_token_s": None if ttft_s is None else round(ttft_s, 4),
        "queue_time_s": round(queue_s, 4),
        "W": decoding.W, "N": decoding.N, "G": decoding.G, "workers": workers,
    }


def full_response(kind: str, rid: str, model: str, text: str, finish: str, use: dict, la: dict) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": use, "lookahead": la}


def chunk(kind: str, rid: str, model: str, text: str | None, finish: str | None = None, role: bool = False,
          **extra) -> dict:
    if kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice], **extra}


def usage_chunk(kind: str, rid: str, model: str, use: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}
