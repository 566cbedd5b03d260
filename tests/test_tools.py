"""Tool calling's request side and answer side (lp.server.tools, lp.server.protocol.prepare,
lp.server.app's answer shaping) on SmolLM2's tokenizer, no model: ``tool_choice: "none"`` keeps
the tools in the rendered prompt and never answers with ``tool_calls``; in ``auto`` mode a call
whose ``arguments`` do not validate against the function's ``parameters`` is text, not a call; a
``required`` / named call cut short is a (partial) call with its finish reason, never content.
The same three behaviours through lp.serve with the openai client: tests/test_structured_serve.py.
"""

from __future__ import annotations

import json

import pytest

from lp.config import DecodingConfig
from lp.server.app import _as_tool_calls
from lp.server.config import ServerConfig
from lp.server.protocol import ApiError, ChatRequest, ServingContext, full_response, parse, prepare
from lp.server.tools import answer, partial_call

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city, by a Zanzibar oracle",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
FLIGHTS = {"type": "function", "function": {
    "name": "search_flights", "description": "Flights between two cities",
    "parameters": {"type": "object", "properties": {"origin": {"type": "string"}, "destination": {"type": "string"}},
                   "required": ["origin", "destination"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search_hotels", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, FLIGHTS]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
GOOD = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}


@pytest.fixture(scope="module")
def tok():
    from lp.model.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2", None))


def _ctx(tok):
    return ServingContext("smollm2", tok, 49152, 2048, DecodingConfig(max_new_tokens=100), ServerConfig())


def prep(tok, **body):
    return prepare(parse(ChatRequest, json.dumps({"messages": MSGS, **body}).encode()), _ctx(tok))


def shaped(p, text: str, finish: str) -> dict:
    """The chat body lp.serve answers for a finished ``text`` (lp.server.app._as_tool_calls)."""
    body = full_response("chat", "chatcmpl-x", "smollm2", text, finish, {}, {})
    return _as_tool_calls(body, p, text)["choices"][0]


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_never_calls(tok):
    none = prep(tok, tools=TOOLS, tool_choice="none")
    auto = prep(tok, tools=TOOLS, tool_choice="auto")
    plain = prep(tok)
    prompt = tok.decode(none.prompt_ids)
    for t in TOOLS:  # every definition is visible, as with auto
        f = t["function"]
        assert f["name"] in prompt and f["description"] in prompt and json.dumps(f["parameters"]) in prompt
    assert "Zanzibar" in tok.decode(auto.prompt_ids) and "Zanzibar" not in tok.decode(plain.prompt_ids)
    assert "Do not call a function" in prompt and "Do not call a function" not in tok.decode(auto.prompt_ids)
    assert none.decoding.grammar is None  # free text
    # a call-shaped answer stays text
    ch = shaped(none, json.dumps(GOOD), "stop")
    assert ch["message"]["content"] == json.dumps(GOOD) and "tool_calls" not in ch["message"]
    assert ch["finish_reason"] == "stop"
    assert answer(None, json.dumps(GOOD), "stop") == (None, "stop")


@pytest.mark.parametrize("args,valid", [
    ({"city": "Paris", "unit": "celsius"}, True),
    ({"city": "Paris", "unit": "kelvin"}, False),  # not in the enum
    ({"city": "Paris"}, False),  # a required property missing
    ({"city": "Paris", "unit": "celsius", "when": "now"}, False),  # additionalProperties: false
    ({"city": 75, "unit": "celsius"}, False),  # wrong type
    ({"city": "P" * 31, "unit": "celsius"}, False),  # maxLength
])
def test_auto_call_arguments_are_validated_against_the_parameters(tok, args, valid):
    p = prep(tok, tools=TOOLS)  # tool_choice absent: auto
    assert p.tools.mode == "auto" and p.decoding.grammar is None
    text = json.dumps({"name": "get_weather", "arguments": args})
    ch = shaped(p, text, "stop")
    if valid:
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
        (call,) = ch["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": json.dumps(args)}
    else:  # a malformed call is the model's text, not a call
        assert ch["finish_reason"] == "stop" and ch["message"]["content"] == text
        assert "tool_calls" not in ch["message"]


def test_auto_keys_in_any_order_and_unknown_names_are_text(tok):
    p = prep(tok, tools=TOOLS + [SEARCH])
    ch = shaped(p, '{"name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}}', "stop")
    assert ch["finish_reason"] == "tool_calls"  # JSON schema validity, not the grammar's key order
    ch = shaped(p, '{"name": "search_hotels", "arguments": {"anything": [1]}}', "stop")
    assert ch["finish_reason"] == "tool_calls"  # parameters {"type": "object"}: any object
    for text in ('{"name": "get_time", "arguments": {}}', '{"name": "get_weather", "arguments": "x"}', "Paris: sunny"):
        assert shaped(p, text, "stop")["message"]["content"] == text


FULL = json.dumps(GOOD)  # '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("cut", [0, 1, 9, 14, 22, 23, 36, 38, 50, len(FULL) - 1])
def test_required_call_cut_short_is_a_partial_call_never_content(tok, choice, cut):
    p = prep(tok, tools=TOOLS, tool_choice=choice)
    assert p.decoding.grammar is not None
    text = FULL[:cut]
    ch = shaped(p, text, "length")
    assert ch["finish_reason"] == "length" and ch["message"]["content"] is None, ch
    calls = ch["message"]["tool_calls"]
    # the name is known once the output determines it: named always; required once the prefix
    # of the name rules out search_flights (after '{"name": "g')
    determined = isinstance(choice, dict) or cut >= len('{"name": "g')
    assert len(calls) == int(determined), calls
    if determined:
        f = calls[0]["function"]
        assert f["name"] == "get_weather"
        head = '{"name": "get_weather", "arguments": '
        assert f["arguments"] == (FULL[len(head):cut] if cut > len(head) else "")
        assert FULL[len(head):].startswith(f["arguments"])
    # the whole call: a call, finish_reason tool_calls
    ch = shaped(p, FULL, "stop")
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["tool_calls"][0]["function"]["arguments"] == \
        json.dumps(GOOD["arguments"])


def test_partial_call_of_an_escaped_name():
    from lp.server.tools import ToolPlan

    plan = ToolPlan("required", {'say"hi': {}, "say": {}}, ['say"hi', "say"])
    assert partial_call(plan, '{"name": "say') == []  # both names still possible
    assert partial_call(plan, '{"name": "say\\"')[0]["function"]["name"] == 'say"hi'
    assert partial_call(plan, '{"name": "say", "arg')[0]["function"] == {"name": "say", "arguments": ""}


def test_bad_parameters_schema_is_400_naming_the_field(tok):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "city"}}}
    with pytest.raises(ApiError) as e:
        prep(tok, tools=[bad])
    assert e.value.param == "tools[0].function.parameters" and e.value.status == 400, e.value.message
