"""Structured output through lp.serve with the real ``openai`` client (SmolLM2, continuous batching).

``response_format`` json_schema / json_object and vLLM's ``structured_outputs`` (regex, choice):
every answer is valid (jsonschema / the regex / the choice), equals transformers ``generate`` with
the same llguidance mask token for token, drafts on == ``lookahead: {"G": 0}`` (every draft
source off), streamed == whole; the grammar's forced drafts were accepted (multi-token steps).
Bad input is a 400 naming the field.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from transformers import LogitsProcessorList

from lp.grammar.matcher import GenerateGrammarProcessor, compile_grammar
from tests.helpers import hf_greedy
from tests.test_serve import start

pytestmark = pytest.mark.slow

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"],
        "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "product": {"type": "string", "maxLength": 20}, "quantity": {"type": "integer", "minimum": 1,
                                                                          "maximum": 99}},
            "required": ["product", "quantity"], "additionalProperties": False}, "minItems": 1, "maxItems": 3},
        "priority": {"enum": ["low", "normal", "high"]}}, "required": ["items", "priority"],
        "additionalProperties": False},
}
PROMPTS = {"person": "Invent a person: name, age and city. Answer in JSON.",
           "order": "A customer orders two apples and a loaf of bread, urgently. Answer in JSON."}
M = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start(tmp_path_factory, "serve_structured", 1, ["server.max_batch=4", "server.kv_tokens=8192"])
    yield srv
    srv.stop()


def chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def reference(smollm2, grammar, text):
    model, tok = smollm2
    prompt = chat_ids(tok, text)
    eos = [tok.eos_token_id]
    proc = GenerateGrammarProcessor(grammar, tok, model.config.vocab_size, len(prompt), eos)
    out = hf_greedy(model, prompt, M, logits_processor=LogitsProcessorList([proc]), eos_token_id=eos,
                    pad_token_id=eos[0])
    return [t for t in out if t != tok.eos_token_id]


def ask(client, text, **kw):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": text}],
                                          max_tokens=M, temperature=0, **kw)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_valid_equals_generate_drafts_on_off(server, smollm2, name):
    schema = SCHEMAS[name]
    client = server.client()
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    on = ask(client, PROMPTS[name], response_format=rf, extra_body={"lookahead": {"return_token_ids": True}})
    off = ask(client, PROMPTS[name], response_format=rf, extra_body={"lookahead": {"G": 0, "return_token_ids": True}})
    text = on.choices[0].message.content
    assert on.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)
    assert text == off.choices[0].message.content
    la_on, la_off = on.model_extra["lookahead"], off.model_extra["lookahead"]
    ref = reference(smollm2, compile_grammar("json_schema", schema), PROMPTS[name])
    assert [t for t in la_on["output_ids"] if t != smollm2[1].eos_token_id] == ref
    assert la_on["steps"] < la_off["steps"], (la_on, la_off)  # the drafts (forced ones first) were accepted
    # streamed == whole
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": PROMPTS[name]}], max_tokens=M, temperature=0,
        response_format=rf, stream=True) if c.choices]
    assert "".join(parts) == text


def test_json_object_and_structured_outputs(server):
    client = server.client()
    r = ask(client, "Describe a cat as a JSON object.", response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert r.choices[0].message.content.startswith("{")
    regex = r"[A-Z][a-z]{1,10}, [0-9]{4}"
    r = ask(client, "Name a city and a year.", extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, r.choices[0].message.content), r.choices[0].message.content
    choices = ["positive", "negative", "neutral"]
    r = ask(client, "Sentiment of 'I love it!'?", extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].message.content in choices
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "The answer is", "max_tokens": 8,
                                                          "structured_outputs": {"regex": "( yes| no)\\."}},
                   timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in (" yes.", " no."), r.text



def assert_400_naming(server, body: dict, param: str) -> None:
    """A chat request with ``body`` is a 400 whose OpenAI error names ``param``."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err

@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_bad_structured_input_is_400_naming_the_field(server, body, param):
    assert_400_naming(server, body, param)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
FLIGHTS = {"type": "function", "function": {
    "name": "search_flights", "description": "Flights between two cities",
    "parameters": {"type": "object", "properties": {"origin": {"type": "string", "maxLength": 30},
                                                    "destination": {"type": "string", "maxLength": 30}},
                   "required": ["origin", "destination"], "additionalProperties": False}}}
TOOLS = [WEATHER, FLIGHTS]
ASK = "What is the weather in Paris right now, in celsius?"


DIGITS = "[0-9]{4}( [0-9]{4}){5}"  # the regex case of the LP and TP server tests


def assert_same_structured_answer(kw: dict, a, b) -> tuple[dict, dict]:
    """The one-process server's answer ``a`` and another layout's ``b`` (LP workers, a TP mesh) to the
    chat request ``kw``: the same token ids, text, finish reason and tool calls, and ``b`` valid
    for what ``kw`` asked (a get_weather call, the DIGITS regex, or the person schema, ended by
    "stop"). Returns both ``lookahead`` objects."""
    la_a, la_b = a.model_extra["lookahead"], b.model_extra["lookahead"]
    assert la_b["output_ids"] == la_a["output_ids"], (a.choices[0].message, b.choices[0].message)
    ca, cb = a.choices[0], b.choices[0]
    assert (cb.message.content, cb.finish_reason) == (ca.message.content, ca.finish_reason)
    calls = [[(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []] for ch in (ca, cb)]
    assert calls[0] == calls[1]
    if "tools" in kw:
        assert cb.finish_reason == "tool_calls" and calls[1][0][0] == "get_weather", cb
    elif "structured_outputs" in kw.get("extra_body", {}):
        assert re.fullmatch(DIGITS, cb.message.content), cb
    else:
        assert cb.finish_reason == "stop", cb
        jsonschema.validate(json.loads(cb.message.content), SCHEMAS["person"])
    return la_a, la_b


def params_of(name):
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_tool_calls_named_and_required_streamed_equals_whole(server, tool_choice):
    client = server.client()
    r = ask(client, ASK, tools=TOOLS, tool_choice=tool_choice)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params_of(call.function.name))
    # streamed: OpenAI's delta.tool_calls, accumulated as the openai client's users do
    name, args, finish = None, "", None
    for c in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASK}],
                                            max_tokens=M, temperature=0, tools=TOOLS, tool_choice=tool_choice,
                                            stream=True):
        if not c.choices:
            continue
        d = c.choices[0].delta
        assert not d.content
        for tc in d.tool_calls or []:
            name = tc.function.name or name
            args += tc.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    assert (name, args, finish) == (call.function.name, call.function.arguments, "tool_calls")


def test_tool_auto_and_multi_turn_with_tool_messages(server):
    client = server.client()
    r = ask(client, ASK, tools=TOOLS, tool_choice="auto")
    ch = r.choices[0]
    if ch.finish_reason == "tool_calls":
        jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments),
                            params_of(ch.message.tool_calls[0].function.name))
    else:
        assert ch.message.content and not ch.message.tool_calls
    msgs = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0, tools=TOOLS,
                                       tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400_naming_the_field(server, body, param):
    assert_400_naming(server, body, param)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_required_call_cut_by_max_tokens_is_a_partial_call(server, smollm2_tok, tool_choice):
    """A required / named call cut by max_tokens: tool_calls with the call as far as it got (the
    name once the output determines it, the arguments' JSON text so far), finish_reason "length",
    never content; streamed alike."""
    client = server.client()
    whole = ask(client, ASK, tools=TOOLS, tool_choice=tool_choice).choices[0].message.tool_calls[0].function
    head = '{"name": "get_weather", "arguments": '
    for cut in (4, 7, 14):  # the name not begun or not through; into the arguments
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASK}],
                                           max_tokens=cut, temperature=0, tools=TOOLS, tool_choice=tool_choice,
                                           extra_body={"lookahead": {"return_token_ids": True}})
        ch = r.choices[0]
        text = smollm2_tok.decode(r.model_extra["lookahead"]["output_ids"])
        assert head.startswith(text) or text.startswith(head), text
        assert ch.finish_reason == "length" and ch.message.content is None, ch
        # named: the name is known; required: once the text rules out search_flights
        if isinstance(tool_choice, dict) or len(text) > len('{"name": "'):
            (call,) = ch.message.tool_calls
            assert call.function.name == whole.name == "get_weather" and call.id.startswith("call_")
            assert call.function.arguments == text[len(head):]
            assert whole.arguments.startswith(call.function.arguments)
        else:
            assert ch.message.tool_calls == []
        name, args, finish = None, "", None
        for c in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASK}],
                                                max_tokens=cut, temperature=0, tools=TOOLS, tool_choice=tool_choice,
                                                stream=True):
            if c.choices:
                assert not c.choices[0].delta.content
                for tc in c.choices[0].delta.tool_calls or []:
                    name, args = tc.function.name or name, args + (tc.function.arguments or "")
                finish = c.choices[0].finish_reason or finish
        got = ch.message.tool_calls[0].function if ch.message.tool_calls else None
        assert (name, args, finish) == ((got.name, got.arguments) if got else (None, "")) + ("length",)


@pytest.fixture(scope="module")
def smollm2_tok():
    from lp.model.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2", None))


def forced(client, text: str, tool_choice, stream: bool = False):
    """A chat answer forced to be ``text`` (a one-choice structured output) with TOOLS offered."""
    kw = dict(model="smollm2", messages=[{"role": "user", "content": ASK}], max_tokens=M, temperature=0, tools=TOOLS,
              tool_choice=tool_choice, extra_body={"structured_outputs": {"choice": [text]}})
    if not stream:
        return client.chat.completions.create(**kw).choices[0]
    content, calls, finish = "", [], None
    for c in client.chat.completions.create(stream=True, **kw):
        if c.choices:
            content += c.choices[0].delta.content or ""
            calls += [(tc.function.name, tc.function.arguments) for tc in c.choices[0].delta.tool_calls or []]
            finish = c.choices[0].finish_reason or finish
    return content, calls, finish


BAD_CALL = json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}})
GOOD_CALL = json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}})


def test_auto_malformed_call_is_content_and_none_never_calls(server):
    """auto: a call whose arguments break the parameters schema is the answer's text, a valid one a
    call; tool_choice none: the tools are in the prompt (more prompt tokens) and even a valid call's
    JSON is text. Whole and streamed."""
    client = server.client()
    ch = forced(client, BAD_CALL, "auto")
    assert ch.message.content == BAD_CALL and not ch.message.tool_calls and ch.finish_reason == "stop"
    assert forced(client, BAD_CALL, "auto", stream=True) == (BAD_CALL, [], "stop")
    ch = forced(client, GOOD_CALL, "auto")
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert json.loads(ch.message.tool_calls[0].function.arguments) == json.loads(GOOD_CALL)["arguments"]
    assert forced(client, GOOD_CALL, "auto", stream=True)[1:] == (
        [("get_weather", ch.message.tool_calls[0].function.arguments)], "tool_calls")
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASK}], max_tokens=M,
                                       temperature=0, tools=TOOLS, tool_choice="none",
                                       extra_body={"structured_outputs": {"choice": [GOOD_CALL]}})
    ch = r.choices[0]
    assert ch.message.content == GOOD_CALL and not ch.message.tool_calls and ch.finish_reason == "stop"
    assert forced(client, GOOD_CALL, "none", stream=True) == (GOOD_CALL, [], "stop")
    plain = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASK}], max_tokens=1)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the two tools' definitions


def test_sampled_structured_valid_and_seeded(server):
    """Sampled structured output through the server: valid for its schema, the same seed twice gives
    the same answer; n = 3 choices, every one valid."""
    client = server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS["person"]}}
    kw = dict(model="smollm2", messages=[{"role": "user", "content": PROMPTS["person"]}], max_tokens=128,
              temperature=1.0, response_format=rf)
    a, b = (client.chat.completions.create(seed=11, **kw).choices[0].message.content for _ in range(2))
    jsonschema.validate(json.loads(a), SCHEMAS["person"])
    assert a == b
    r = client.chat.completions.create(seed=5, n=3, **kw)
    assert len(r.choices) == 3
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch.message.content
        jsonschema.validate(json.loads(ch.message.content), SCHEMAS["person"])
    assert len({ch.message.content for ch in r.choices} | {a}) >= 3, [ch.message.content for ch in r.choices]
