"""OpenAI wire format: request models, validation into a DecodingConfig, response bodies, errors.

Contract: ``parse(ChatRequest | CompletionRequest, body_bytes)`` validates a raw request
body (strict JSON types: a string where a number belongs, a bool where an integer belongs,
NaN, ... are rejected) and ``prepare(req, ctx)`` turns it into the prompt's token ids and
a validated ``DecodingConfig``. Every problem is an ``ApiError`` carrying the HTTP status
and OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``; nothing here
touches the model. Request fields not sent take the server's ``decoding`` group values
(so a request without ``temperature`` decodes greedily under the default config);
``temperature: 0`` is greedy, ``> 0`` samples. A sampled request without ``seed`` draws a fresh
one (``draw_seed``, never the server's decoding.seed), so identical requests answer differently;
the response's ``lookahead.seed`` names the seed used (send it back to reproduce the answer).
``lookahead: {W, N, G, return_token_ids}``
is an extension: W/N/G bounded by ``server.max_W/max_N/max_G``; ``return_token_ids`` adds
the completion's token ids (``output_ids``) to the response's ``lookahead`` object.

Every field is honored or refused, none ignored (``FIELD_POLICY``): a field of the OpenAI
API (or a vLLM extension) that lp does not implement gets a 400 naming it
(``unsupported_parameter``) unless it carries its no-op value (``functions: []``, ``n: 1``, ...);
a field neither defines gets OpenAI's ``Unrecognized request argument supplied`` 400.
``response_format`` / vLLM's ``structured_outputs`` become the DecodingConfig's grammar
(lp.server.structured); ``tools`` / ``tool_choice`` a prompt, maybe a grammar, and a ToolPlan the
answer is parsed with (lp.server.tools).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

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
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class LookaheadParams(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid")
    W: int | None = None
    N: int | None = None
    G: int | None = None
    return_token_ids: bool = False  # the completion's token ids in the response's lookahead object


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Any = None  # refused unless false


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: Any = None  # assistant: earlier calls (lp.server.tools renders them)
    tool_call_id: str | None = None  # tool: the call this output answers
    name: str | None = None

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
    top_k: int | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    repetition_penalty: float | None = None  # vLLM extension (transformers' formula)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id: written to the server's request log
    lookahead: LookaheadParams | None = None
    structured_outputs: Any = None  # vLLM extension: json / regex / choice / grammar (lp.server.structured)


class ChatRequest(_Common):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    safety_identifier: str | None = None  # like user: written to the request log
    # OpenAI fields lp does not implement: refused unless they carry their no-op value
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    moderation: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]  # a list of prompts: one (lm-eval sends [[ids]])
    logprobs: int | None = None  # top logprobs per token, 0..20 (0: the chosen token's only)
    echo: bool | None = None
    best_of: Any = None  # refused unless 1
    suffix: Any = None  # refused unless null


# field -> its no-op values: any other value is refused with a 400 naming the field
_NOOP = {
    "functions": (None, []),
    "function_call": (None, "none"), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    "web_search_options": (None,), "store": (None, False), "metadata": (None, {}),
    "service_tier": (None, "auto", "default"), "moderation": (None,), "prompt_cache_key": (None,),
    "prompt_cache_retention": (None,), "prompt_cache_options": (None,), "best_of": (None, 1), "suffix": (None, ""),
}
_WHY = {
    "functions": "function calling is not implemented (use tools)",
    "function_call": "function calling is not implemented",
    "audio": "audio output is not supported", "modalities": "only [\"text\"] is supported",
    "prediction": "predicted outputs are not supported", "reasoning_effort": "this model does not reason",
    "verbosity": "this model does not reason", "web_search_options": "web search is not available",
    "store": "completions are not stored", "metadata": "completions are not stored",
    "service_tier": "there is one service tier", "moderation": "moderation is not available",
    "prompt_cache_key": "there is no cross-request prompt cache",
    "prompt_cache_retention": "there is no cross-request prompt cache",
    "prompt_cache_options": "there is no cross-request prompt cache", "best_of": "only best_of=1 is supported",
    "suffix": "insertion (suffix) is not supported",
}
# every request field of the OpenAI chat / completions APIs and the vLLM extensions lp knows:
# honored (implemented) or refused (400 unless its no-op value); see README "OpenAI fields"
FIELD_POLICY = {
    **{f: "honored" for f in ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
                              "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                              "presence_penalty", "logit_bias", "seed", "stop", "n", "stream", "stream_options",
                              "user", "safety_identifier", "logprobs", "top_logprobs", "echo", "lookahead",
                              "response_format", "structured_outputs", "tools", "tool_choice",
                              "parallel_tool_calls")},
    **{f: "refused" for f in _NOOP},
}


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
    workers: int = 1  # LP workers behind the server
    memory: dict | None = None  # rank 0's memory plan (lp.parallel.memory), shown on /health


@dataclass
class Prepared:
    prompt_ids: list[int]
    decoding: DecodingConfig
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    echo_text: str | None = None  # completions with echo: the prompt text, returned before the completion
    user: str | None = None  # user / safety_identifier, for the request log
    prompt_logprobs: int | None = None  # completions with echo + logprobs: the prompt's own logprobs (top k)
    prompt_only: bool = False  # completions with echo and max_tokens 0: the prompt only, no new token
    n: int = 1  # choices (each its own sequence)
    tools: object = None  # lp.server.tools.ToolPlan: the answer may be a tool call (None for tool_choice "none")


def prepare(req: _Common, ctx: ServingContext) -> Prepared:
    if req.model is not None and req.model != ctx.model_id:
        raise ApiError(f"The model '{req.model}' does not exist; this server serves '{ctx.model_id}'.",
                       param="model", code="model_not_found")
    n = _choices(req, ctx.limits)
    _refuse_unsupported(req)
    from lp.server.structured import FieldError
    from lp.server.tools import tool_plan

    prompt_only = _echo_only(req)
    try:  # tools, response_format, structured_outputs (lp.server.tools / structured): FieldError -> 400
        plan = tool_plan(req) if isinstance(req, ChatRequest) else None
        prompt_ids, prompt_param = _prompt_ids(req, ctx, plan)
        d = _decoding(req.model_copy(update={"max_tokens": 1}) if prompt_only else req, ctx, len(prompt_ids),
                      prompt_param, plan)
    except FieldError as e:
        raise ApiError(str(e), param=e.param, code="invalid_value") from None
    stream = bool(req.stream)
    echo_text, prompt_logprobs = None, None
    if isinstance(req, CompletionRequest) and req.echo:
        if d.logprobs:
            prompt_logprobs = d.top_logprobs
        p = req.prompt
        echo_text = p if isinstance(p, str) else p[0] if p and isinstance(p[0], str) else ctx.tokenizer.decode(prompt_ids)
    user = req.user or getattr(req, "safety_identifier", None)
    return Prepared(prompt_ids, d, stream, bool(stream and req.stream_options and req.stream_options.include_usage),
                    bool(req.lookahead and req.lookahead.return_token_ids), echo_text, user, prompt_logprobs,
                    prompt_only, n, plan if plan is not None and plan.mode != "none" else None)


def _choices(req: _Common, lim) -> int:
    """``n``: choices per request, each decoded as its own sequence (sampled ones with seeds
    seed, seed + 1, ... wrapped into int64, ``choice_seed``), at most server.max_n; streamed too
    (chunks carry their choice's index)."""
    n = 1 if req.n is None else req.n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= getattr(lim, "max_n", 1):
        raise _bad("n", f"expected an integer in [1, {getattr(lim, 'max_n', 1)}]", req.n)
    return n


def _echo_only(req: _Common) -> bool:
    """Completions ``max_tokens: 0`` with ``echo``: score the prompt, generate nothing (what
    lm-eval's loglikelihood sends); 0 without echo stays an error."""
    if not isinstance(req, CompletionRequest) or req.max_tokens != 0 or req.max_completion_tokens is not None:
        return False
    if not req.echo:
        raise _bad("max_tokens", "expected an integer >= 1 (0 only with echo)", req.max_tokens)
    return True


def _refuse_unsupported(req: _Common) -> None:
    for name, ok in _NOOP.items():
        if name in type(req).model_fields:
            v = getattr(req, name)
            if v not in ok:
                raise ApiError(f"'{name}' is not supported by this server: {_WHY[name]} (got {_short(v)}).",
                               param=name, code="unsupported_parameter")
    so = req.stream_options
    if so is not None and so.include_obfuscation not in (None, False):
        raise ApiError("'stream_options.include_obfuscation' is not supported by this server.",
                       param="stream_options.include_obfuscation", code="unsupported_parameter")


def _prompt_ids(req: _Common, ctx: ServingContext, plan=None) -> tuple[list[int], str]:
    tok = ctx.tokenizer
    if isinstance(req, ChatRequest):
        if not req.messages:
            raise ApiError("Invalid value for 'messages': expected a non-empty array.", param="messages",
                           code="empty_array")
        if not getattr(tok, "chat_template", None):
            raise ApiError("This model has no chat template; use /v1/completions.", param="messages",
                           code="no_chat_template")
        from lp.server.tools import render_messages

        msgs, tools_arg = render_messages(req.messages, plan, getattr(tok, "chat_template", None))
        kw = {"tools": tools_arg} if tools_arg else {}
        try:
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw)
        except Exception as e:  # the template itself may reject a conversation (roles, order)
            raise ApiError(f"The chat template rejected these messages: {e}", param="messages",
                           code="invalid_value") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids], "messages"
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
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


def _decoding(req: _Common, ctx: ServingContext, prompt_len: int, prompt_param: str, plan=None) -> DecodingConfig:
    """The request's DecodingConfig: the server's base with each field the request sets,
    every field checked (ApiError naming the parameter) in stages."""
    upd: dict = {"max_new_tokens": _max_new_tokens(req, ctx, prompt_len, prompt_param)}
    upd.update(_sampling_fields(req))
    if req.logit_bias is not None:
        upd["logit_bias"] = _logit_bias(req.logit_bias, ctx.vocab_size)
    upd.update(_logprobs_fields(req))
    upd.update(_stop_seed_lookahead(req, ctx.limits))
    from lp.server.structured import grammar_fields

    upd.update(grammar_fields(req))  # response_format / structured_outputs -> a grammar (lp.grammar)
    from lp.server import tools

    calls = tools.grammar_fields(plan)  # tool_choice required / named: one call of an allowed function
    if calls and "grammar" in upd:
        raise ApiError("Invalid value for 'tool_choice': a required or named tool call cannot be combined with "
                       "response_format / structured_outputs.", param="tool_choice", code="invalid_value")
    upd.update(calls)
    d = dataclasses.replace(ctx.base, **upd)
    if d.do_sample and req.seed is None:  # unseeded: fresh randomness per request (lookahead.seed reports it)
        d = dataclasses.replace(d, seed=draw_seed())
    try:
        return d.validate()
    except ValueError as e:  # should not happen after the checks above; still a client error
        raise ApiError(str(e), code="invalid_value") from None


def draw_seed() -> int:
    """A fresh seed in [0, 2**63) from the OS's randomness, for a sampled request that sends no
    ``seed`` (as OpenAI's API, vLLM and llama.cpp draw fresh randomness per request). Drawn on
    rank 0 only: under LP it rides with the request to every rank (lp.server.engine.pack_request)."""
    return secrets.randbits(63)


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed of an ``n`` > 1 request: seed + i wrapped into the signed 64-bit range
    (two's complement, so 2**63 - 1 is followed by -2**63): every choice's seed stays a valid
    request seed and fits the LP request channel's int64 fields.

        >>> choice_seed(5, 2), choice_seed(2**63 - 1, 1), choice_seed(-1, 1)
        (7, -9223372036854775808, 0)
    """
    return (seed + i - INT64_MIN) % 2**64 + INT64_MIN


def _bad(param: str, what: str, got) -> ApiError:
    return ApiError(f"Invalid value for '{param}': {what} (got {_short(got)}).", param=param, code="invalid_value")


def _max_new_tokens(req: _Common, ctx: ServingContext, prompt_len: int, prompt_param: str) -> int:
    """max_completion_tokens (current name) wins over max_tokens (legacy); the default and
    every value bounded by the server's limit and the model's context."""
    lim, base = ctx.limits, ctx.base
    max_new = None
    for name in ("max_tokens", "max_completion_tokens"):
        v = getattr(req, name)
        if v is None:
            continue
        if v < 1:
            raise _bad(name, "expected an integer >= 1", v)
        if v > lim.max_tokens:
            raise _bad(name, f"this server allows at most {lim.max_tokens}", v)
        max_new = v
    room = None if ctx.max_positions is None else ctx.max_positions - prompt_len
    if room is not None and room < 1:
        raise ApiError(f"This model's maximum context length is {ctx.max_positions} tokens; your prompt has "
                       f"{prompt_len} tokens.", param=prompt_param, code="context_length_exceeded")
    if max_new is None:
        return min(base.max_new_tokens, lim.max_tokens, room if room is not None else base.max_new_tokens)
    if room is not None and max_new > room:
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise ApiError(f"This model's maximum context length is {ctx.max_positions} tokens; you requested "
                       f"{prompt_len + max_new} tokens ({prompt_len} in the prompt, {max_new} for the completion).",
                       param=param, code="context_length_exceeded")
    return max_new


def _sampling_fields(req: _Common) -> dict:
    """temperature (0: greedy), top_p, top_k, min_p and the penalties."""
    upd: dict = {}
    if req.temperature is not None:
        if not 0 <= req.temperature <= 2:
            raise _bad("temperature", "expected a number in [0, 2]", req.temperature)
        if req.temperature == 0:
            upd["do_sample"] = False
        else:
            upd.update(do_sample=True, temperature=float(req.temperature))
    if req.top_p is not None:
        if not 0 < req.top_p <= 1:
            raise _bad("top_p", "expected a number in (0, 1]", req.top_p)
        upd["top_p"] = float(req.top_p)
    if req.top_k is not None:
        if req.top_k < 0:
            raise _bad("top_k", "expected an integer >= 0 (0: off)", req.top_k)
        upd["top_k"] = req.top_k
    if req.min_p is not None:
        if not 0 <= req.min_p <= 1:
            raise _bad("min_p", "expected a number in [0, 1]", req.min_p)
        upd["min_p"] = float(req.min_p)
    if req.repetition_penalty is not None:
        if not 0 < req.repetition_penalty <= 10:
            raise _bad("repetition_penalty", "expected a number in (0, 10]", req.repetition_penalty)
        upd["repetition_penalty"] = float(req.repetition_penalty)
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(req, name)
        if v is not None:
            if not -2 <= v <= 2:
                raise _bad(name, "expected a number in [-2, 2]", v)
            upd[name] = float(v)
    return upd


def _logit_bias(logit_bias: dict, vocab_size: int) -> dict[int, float]:
    bias = {}
    if len(logit_bias) > 300:
        raise _bad("logit_bias", "at most 300 tokens", f"{len(logit_bias)} entries")
    for key, b in logit_bias.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise _bad("logit_bias", f"keys must be token ids in [0, {vocab_size})", key)
        if not -100 <= b <= 100:
            raise _bad("logit_bias", "biases must be in [-100, 100]", b)
        bias[int(key)] = float(b)
    return bias


def _logprobs_fields(req: _Common) -> dict:
    """Chat: logprobs (bool) + top_logprobs; completions: logprobs (int). Under LP workers too: the
    verifying rank's values ride the step's exchange (lp.engine.decoder ``local_logprobs``)."""
    upd: dict = {}
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise _bad("top_logprobs", "expected an integer in [0, 20]", req.top_logprobs)
        if req.top_logprobs and not req.logprobs:
            raise ApiError("Invalid value for 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set.",
                           param="top_logprobs", code="invalid_value")
        if req.logprobs:
            upd.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    elif req.logprobs is not None:
        if not 0 <= req.logprobs <= 20:
            raise _bad("logprobs", "expected an integer in [0, 20]", req.logprobs)
        upd.update(logprobs=True, top_logprobs=req.logprobs)
    return upd


def _stop_seed_lookahead(req: _Common, lim) -> dict:
    """seed, stop sequences and the per-request lookahead shape (within the server's limits)."""
    upd: dict = {}
    if req.seed is not None:
        if not INT64_MIN <= req.seed <= INT64_MAX:
            raise _bad("seed", "expected a 64-bit integer", req.seed)
        upd["seed"] = req.seed
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if len(stops) > lim.max_stop:
            raise _bad("stop", f"at most {lim.max_stop} stop sequences", req.stop)
        if any(s == "" for s in stops):
            raise _bad("stop", "stop sequences must be non-empty", req.stop)
        upd["stop_strings"] = stops
    if req.lookahead is not None:
        la = req.lookahead
        for name, lo, hi in (("W", 1, lim.max_W), ("N", 2, lim.max_N), ("G", 0, lim.max_G)):
            v = getattr(la, name)
            if v is None:
                continue
            if not lo <= v <= hi:
                raise _bad(f"lookahead.{name}", f"this server allows {lo} <= {name} <= {hi}", v)
            upd[name] = v
    return upd


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
        "forced_tokens": st.forced_tokens,  # output tokens from the grammar's forced drafts (lp.grammar)
        "seed": decoding.seed if decoding.do_sample else None,  # the request's, or the one drawn for it
    }


def full_response(kind: str, rid: str, model: str, text: str, finish: str, use: dict, la: dict,
                  logprobs: dict | None = None) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": use, "lookahead": la}


def chunk(kind: str, rid: str, model: str, text: str | None, finish: str | None = None, role: bool = False,
          logprobs: dict | None = None, **extra) -> dict:
    if kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice], **extra}


def usage_chunk(kind: str, rid: str, model: str, use: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}


# ---------------------------------------------------------------------------
# logprobs (raw: log-softmax of the model's logits at the verifying row)


def _token_text(tok, token_id: int) -> str:
    return tok.decode([token_id])


def chat_logprobs(tok, lps) -> dict:
    """OpenAI chat ``logprobs`` object for a list of lp.engine.decoder.TokenLogprob."""
    def entry(t: int, lp: float) -> dict:
        s = _token_text(tok, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                        for x in lps], "refusal": None}


def completion_logprobs(tok, lps, offset: int) -> dict:
    """Legacy completions ``logprobs`` object; ``offset``: characters of text before these tokens."""
    tokens, offsets = [], []
    for x in lps:
        s = _token_text(tok, x.token)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{_token_text(tok, t): v for t, v in x.top} for x in lps],
            "text_offset": offsets}
