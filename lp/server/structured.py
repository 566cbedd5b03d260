"""Structured output fields of a request into a grammar (lp.grammar): OpenAI's ``response_format``
and vLLM's ``structured_outputs``.

Contract: ``grammar_fields(req)`` returns the DecodingConfig fields (``{"grammar": text}``, or
nothing for free text) or raises an ``ApiError`` naming the field:

    response_format     {"type": "text"} (free text), {"type": "json_object"} (any JSON object),
                        {"type": "json_schema", "json_schema": {"name", "schema", "strict",
                        "description"}} (the schema's JSON, keys in the schema's order)
    structured_outputs  vLLM's: exactly one of "json" (a schema, object or JSON text), "regex",
                        "choice" (a list of strings), "grammar" (Lark or GBNF), "json_object": true

Both at once (other than a text response_format) is a 400. Errors are ``FieldError`` (param, message),
which lp.server.protocol turns into its ``ApiError`` (OpenAI's error body naming the field). Grammars compile once per source
(lp.grammar.matcher's cache); an invalid schema, a regex that does not compile, an unsupported
schema keyword: a 400 with the library's message.
"""

from __future__ import annotations

from lp.grammar.matcher import compile_grammar


class FieldError(ValueError):
    """A request field's bad value: ``param`` names it (lp.server.protocol answers a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param

SO_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
           "json_object": "json_object"}


def grammar_fields(req) -> dict:
    rf = getattr(req, "response_format", None)
    so = getattr(req, "structured_outputs", None)

    def bad(param: str, msg: str) -> FieldError:
        return FieldError(f"Invalid value for '{param}': {msg}", param)

    def compiled(param: str, kind: str, spec) -> dict:
        try:
            return {"grammar": compile_grammar(kind, spec)}
        except ValueError as e:
            raise bad(param, str(e)) from None

    text_rf = rf is None or rf == {"type": "text"}
    if not text_rf and so is not None:
        raise bad("structured_outputs", "give either response_format or structured_outputs, not both.")
    if not text_rf:
        if not isinstance(rf, dict) or "type" not in rf:
            raise bad("response_format", 'expected an object with a "type".')
        t = rf["type"]
        if t == "json_object":
            if set(rf) != {"type"}:
                raise bad("response_format", "json_object takes no other field.")
            return compiled("response_format", "json_object", None)
        if t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad("response_format.json_schema", 'expected an object with "name" and "schema".')
            extra = set(js) - {"name", "schema", "strict", "description"}
            if extra:
                raise bad(f"response_format.json_schema.{sorted(extra)[0]}", "unknown field.")
            name = js.get("name")
            if not isinstance(name, str) or not name:
                raise bad("response_format.json_schema.name", "expected a non-empty string.")
            if js.get("strict") not in (None, True, False):
                raise bad("response_format.json_schema.strict", "expected true or false.")
            if "schema" not in js:
                raise bad("response_format.json_schema.schema", "missing.")
            return compiled("response_format.json_schema.schema", "json_schema", js["schema"])
        raise bad("response_format.type", f"expected 'text', 'json_object' or 'json_schema' (got {t!r}).")
    if so is None:
        return {}
    if not isinstance(so, dict):
        raise bad("structured_outputs", "expected an object.")
    keys = [k for k, v in so.items() if v is not None and v is not False]
    unknown = [k for k in keys if k not in SO_KEYS]
    if unknown:
        raise bad(f"structured_outputs.{unknown[0]}",
                  f"not supported (one of {', '.join(SO_KEYS)}).")
    if len(keys) != 1:
        raise bad("structured_outputs", f"expected exactly one of {', '.join(SO_KEYS)} (got {len(keys)}).")
    k = keys[0]
    if k == "json_object" and so[k] is not True:
        raise bad("structured_outputs.json_object", "expected true.")
    return compiled(f"structured_outputs.{k}", SO_KEYS[k], so[k])
