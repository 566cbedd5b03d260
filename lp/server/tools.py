"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` into a prompt, a grammar and a parsed answer.

Contract: ``tool_plan(req)`` checks ``tools`` and ``tool_choice`` (an ``ApiError`` naming the field:
a tool without a name, parameters that are not a JSON schema, ``tool_choice`` naming an unknown
function) and returns a ``ToolPlan`` or None (no tools).

Rendering: the tools go into the prompt through the model's chat template when it uses a ``tools``
variable; otherwise (SmolLM2's template has none) by the documented fallback, a system message
that lists every function (name, description, parameters schema) and says that a call is written
as one JSON object ``{"name": ..., "arguments": {...}}`` and nothing else. Earlier assistant
``tool_calls`` are rendered as that JSON, ``role: "tool"`` messages as ``tool`` turns (the
template's role) whose content is the tool's output. ``tool_choice: "none"`` keeps the tools in
the prompt (as OpenAI does: the model sees them; the fallback's system message says not to call
one now) and the answer is text, never ``tool_calls``.

Decoding: ``required`` and a named function constrain the output with a JSON schema grammar
(lp.grammar): one object whose ``name`` is one of the allowed functions and whose ``arguments``
are valid for that function's ``parameters`` (an ``anyOf`` over the functions). ``auto``: the
model decodes freely and lp decides afterwards: the answer is a tool call when the whole output
(stripped) is a JSON object with a known function's ``name`` and ``arguments`` that validate
against that function's ``parameters`` (jsonschema), text (``content``) otherwise, so a malformed
call is never returned as a call. (Not a grammar in auto mode: auto is the default whenever tools
are sent, and a mask on every free-text row would cost every such request. Grammars run under LP
workers as in one process.)

``answer(plan, text, finish_reason)`` returns (OpenAI ``tool_calls`` or None for a text answer,
the finish reason): a complete call gives ``"tool_calls"``. A ``required`` / named answer that is
not a complete call (cut by ``max_tokens`` or a stop string) is still a call, never content: the
call as far as it got, like vLLM's: the function's ``name`` once the output determines it (a named
choice, or a prefix only one allowed name has) and ``arguments`` the partial JSON text produced so
far (``""`` if they had not begun), with the finish reason as it was (``"length"``); when the
output does not yet determine the function, ``tool_calls`` is an empty list.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolPlan:
    mode: str  # "auto" | "required" | "named" | "none"
    functions: dict  # name -> {"description", "parameters"}
    allowed: list  # the names the output may call
    validators: dict = field(default_factory=dict)  # name -> jsonschema validator of its parameters


def _err(param: str, msg: str):
    from lp.server.structured import FieldError

    return FieldError(f"Invalid value for '{param}': {msg}", param)


def tool_plan(req) -> ToolPlan | None:
    tools = getattr(req, "tools", None)
    choice = getattr(req, "tool_choice", None)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _err("tool_choice", "no tools were given.")
        return None
    if not isinstance(tools, list):
        raise _err("tools", "expected an array of tools.")
    functions: dict = {}
    validators: dict = {}
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _err(p, 'expected {"type": "function", "function": {...}}.')
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise _err(f"{p}.function.name", "every tool needs a non-empty name.")
        if name in functions:
            raise _err(f"{p}.function.name", f"the name {name!r} is used twice.")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _err(f"{p}.function.parameters", "expected a JSON schema object.")
        from lp.grammar.matcher import compile_grammar

        try:
            compile_grammar("json_schema", params)
        except ValueError as e:
            raise _err(f"{p}.function.parameters", str(e)) from None
        import jsonschema

        cls = jsonschema.validators.validator_for(params)
        try:
            cls.check_schema(params)
        except jsonschema.SchemaError as e:
            raise _err(f"{p}.function.parameters", f"not a valid JSON schema: {e.message}") from None
        functions[name] = {"description": f.get("description", ""), "parameters": params}
        validators[name] = cls(params)
    if choice in (None, "auto"):
        return ToolPlan("auto", functions, list(functions), validators)
    if choice == "none":
        return ToolPlan("none", functions, [], validators)
    if choice == "required":
        return ToolPlan("required", functions, list(functions), validators)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise _err("tool_choice.function.name", f"no tool is named {name!r}.")
        return ToolPlan("named", functions, [name], validators)
    raise _err("tool_choice", "expected 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}.")


def call_schema(plan: ToolPlan) -> dict:
    """The JSON schema of one call of an allowed function (keys: name, then arguments)."""
    options = [{"type": "object", "properties": {"name": {"const": n}, "arguments": plan.functions[n]["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False} for n in plan.allowed]
    return options[0] if len(options) == 1 else {"anyOf": options}


def grammar_fields(plan: ToolPlan | None) -> dict:
    if plan is None or plan.mode in ("auto", "none"):
        return {}
    from lp.grammar.matcher import compile_grammar

    try:
        return {"grammar": compile_grammar("json_schema", call_schema(plan))}
    except ValueError as e:
        raise _err("tools", str(e)) from None


def system_text(plan: ToolPlan) -> str:
    lines = ["You can call these functions (tools):"]
    for n, f in plan.functions.items():
        lines.append(json.dumps({"name": n, "description": f["description"], "parameters": f["parameters"]}))
    if plan.mode == "none":
        lines.append("Do not call a function in this answer: answer in text.")
    else:
        lines.append('To call a function, answer with one JSON object {"name": <function name>, "arguments": '
                     '<arguments object>} and nothing else.')
    return "\n".join(lines)


def render_messages(messages, plan: ToolPlan | None, template: str | None) -> tuple[list[dict], list | None]:
    """(messages for the chat template, the ``tools`` argument or None)."""
    out = []
    for m in messages:
        content = m.text()
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for c in m.tool_calls:
                f = c.get("function", {}) if isinstance(c, dict) else {}
                try:
                    args = json.loads(f.get("arguments") or "{}")
                except (TypeError, ValueError):
                    args = f.get("arguments")
                calls.append(json.dumps({"name": f.get("name"), "arguments": args}))
            content = (content + "\n" if content else "") + "\n".join(calls)
        out.append({"role": m.role, "content": content})
    if plan is None:
        return out, None
    if template and "tools" in template:
        return out, [{"type": "function", "function": {"name": n, **f}} for n, f in plan.functions.items()]
    sys_msg = system_text(plan)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + sys_msg}
    else:
        out.insert(0, {"role": "system", "content": sys_msg})
    return out, None


def _call(name: str, arguments: str) -> dict:
    return {"index": 0, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse(plan: ToolPlan | None, text: str) -> list | None:
    """OpenAI ``tool_calls`` for an answer that is a complete call of an allowed function (in
    auto mode its arguments valid for the function's parameters), else None."""
    if plan is None or plan.mode == "none":
        return None
    try:
        obj = json.loads(text.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in plan.allowed or not isinstance(obj.get("arguments"), dict):
        return None
    if plan.mode == "auto" and not plan.validators[obj["name"]].is_valid(obj["arguments"]):
        return None  # the model wrote a malformed call: its text is the answer
    return [_call(obj["name"], json.dumps(obj["arguments"]))]


# a prefix of the grammar's call: compact separators, "name" before "arguments" (lp.grammar.matcher)
_NAME = re.compile(r'\{"name": "(?P<name>(?:[^"\\]|\\.)*)(?P<closed>")?', re.DOTALL)
_ARGS = ', "arguments": '


def partial_call(plan: ToolPlan, text: str) -> list:
    """A required / named call the output did not finish: ``[call]`` with the name (once the
    output determines it) and the arguments' text so far, or ``[]``."""
    m = _NAME.match(text)
    args = ""
    if m is None:  # not even past '{"name": "': the name is known only if one function is allowed
        names = plan.allowed if len(plan.allowed) == 1 else []
    elif not m.group("closed"):
        names = [n for n in plan.allowed if json.dumps(n)[1:-1].startswith(m.group("name"))]
    else:
        names = [n for n in plan.allowed if json.dumps(n)[1:-1] == m.group("name")]
        rest = text[m.end():]
        if rest.startswith(_ARGS):
            args = rest[len(_ARGS):]
    return [_call(names[0], args)] if len(names) == 1 else []


def answer(plan: ToolPlan | None, text: str, finish: str) -> tuple[list | None, str]:
    """(OpenAI ``tool_calls``, or None for a text answer; the finish reason) of a chat answer."""
    if plan is None or plan.mode == "none":
        return None, finish
    calls = parse(plan, text)
    if calls:
        return calls, "tool_calls"
    if plan.mode in ("required", "named"):  # the grammar's call, unfinished: still a call, never content
        return partial_call(plan, text), finish
    return None, finish
