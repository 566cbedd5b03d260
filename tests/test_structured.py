"""Structured output (lp.grammar): greedy lookahead under a grammar mask == transformers ``generate``
with the same library's mask (llguidance, lp.grammar.matcher.GenerateGrammarProcessor), token for
token, in one sequence and in batched steps; the grammar's forced continuation is a draft that is
accepted (multi-token steps, asserted); ``G = 0`` (every draft source off) gives the same tokens;
every answer is valid: a finished one against its spec (jsonschema, ``re.fullmatch``, the choice list,
a fresh llguidance matcher of the Lark grammar compiled apart from lp's cache), an unfinished one is
a prefix the fresh matcher accepts. Sampled requests batched together are valid, each alike when
drawn twice; a grammar request whose prompt hits the prefix cache equals the first one; the server's
engine warms llguidance's tokenizer at start-up (the one requests then use).

The model is a tiny random Llama with SmolLM2's 49152-token vocabulary (SmolLM2's tokenizer), so
the grammars run over a real BPE vocabulary while a step costs milliseconds.
"""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
from transformers import LogitsProcessorList

from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine, generate_batch
from lp.engine.decoder import LookaheadDecoder
from lp.grammar import matcher as gm
from lp.grammar.matcher import GenerateGrammarProcessor, RowGrammar, compile_grammar
from lp.model.runner import ModelRunner
from tests.helpers import hf_greedy, make_tiny_model, step_spans

VOCAB = 49152
NEW = 48

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "ok", "tags"],
    "additionalProperties": False,
}
CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False},
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
GRAMMARS = {
    "person-schema": ("json_schema", PERSON),
    "call-schema": ("json_schema", CALL),
    "regex": ("regex", r"[a-z]{1,6}@[a-z]{1,5}\.(com|org)"),
    "choice": ("choice", ["positive", "negative", "neutral"]),
    "lark": ("lark", 'start: "ok(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
}


@pytest.fixture(scope="module")
def tok():
    from lp.model.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2", None))


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_model("llama", vocab=VOCAB)
    return model, ModelRunner(model)


def reference(model, tok, grammar, prompt, eos):
    proc = GenerateGrammarProcessor(grammar, tok, VOCAB, len(prompt), eos)
    return hf_greedy(model, prompt, NEW, logits_processor=LogitsProcessorList([proc]), eos_token_id=eos,
                     pad_token_id=eos[0])


def fresh_matcher(kind, spec, tok, eos):
    """A matcher of the spec compiled straight by llguidance (not lp's compile_grammar / cache)."""
    if kind in ("json_schema", "json_object"):
        text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec), overrides=gm.JSON_OPTIONS)
    elif kind == "regex":
        text = llguidance.LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        text = llguidance.grammar_from("choice", json.dumps(spec))
    else:
        text = llguidance.grammar_from(kind, spec)
    return llguidance.LLMatcher(gm.ll_tokenizer(tok, VOCAB, eos), text, log_level=0)


def check_valid(kind, spec, tok, ids, finished, eos):
    """The output tokens ``ids`` are valid for the spec: a finished answer (finish_reason "stop")
    whole (the spec's own check: jsonschema, ``re.fullmatch``, the choice list, and for every kind a
    fresh matcher accepting it), an unfinished one as a prefix the fresh matcher accepts."""
    body = [t for t in ids if t not in eos]
    assert len(body) >= len(ids) - 1 and (not finished or len(body) == len(ids) or ids[-1] in eos), ids
    text = tok.decode(body)
    if finished and kind == "json_schema":
        jsonschema.validate(json.loads(text), spec)
    elif finished and kind == "choice":
        assert text in spec, text
    elif finished and kind == "regex":
        assert re.fullmatch(spec, text), text
    m = fresh_matcher(kind, spec, tok, eos)
    assert m.try_consume_tokens(body) == len(body), (kind, text)
    assert not finished or m.is_accepting(), (kind, text)


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_greedy_under_grammar_equals_generate(tiny, tok, name):
    model, runner = tiny
    kind, spec = GRAMMARS[name]
    grammar = compile_grammar(kind, spec)
    prompt = tok.encode(f"Answer with {name} output: ")
    eos = [tok.eos_token_id]
    ref = reference(model, tok, grammar, prompt, eos)
    drafts = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=NEW, grammar=grammar)).generate(
        prompt, eos, tokenizer=tok)
    plain = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=NEW, grammar=grammar, G=0)).generate(
        prompt, eos, tokenizer=tok)
    assert drafts.output_ids == ref, (tok.decode(drafts.output_ids), tok.decode(ref))
    assert plain.output_ids == ref
    assert plain.stats.steps == len(ref) and plain.stats.forced_tokens == 0  # G=0: one token a step
    spans = step_spans(drafts)
    assert max(b - a for a, b in spans) >= 2, spans  # drafts were accepted in multi-token steps
    assert drafts.stats.forced_tokens >= 1, drafts.stats.summary()
    check_valid(kind, spec, tok, drafts.output_ids, drafts.finish_reason == "stop", eos)


def test_schema_output_is_valid_and_forced_drafts_carry_the_keys(tiny, tok):
    model, runner = tiny
    grammar = compile_grammar("json_schema", PERSON)
    prompt = tok.encode("A person: ")
    eos = [tok.eos_token_id]
    res = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=96, grammar=grammar)).generate(prompt, eos,
                                                                                                tokenizer=tok)
    assert res.finish_reason == "stop", tok.decode(res.output_ids)
    jsonschema.validate(json.loads(tok.decode(res.output_ids, skip_special_tokens=True)), PERSON)
    # the five keys, their quotes and separators are forced: a good share of the output
    assert res.stats.forced_tokens >= 10, res.stats.summary()
    assert res.stats.steps < len(res.output_ids) - 10, res.stats.summary()


def test_batched_steps_under_grammars_equal_generate(tiny, tok):
    """Three structured requests and a free one in batched steps (lp.engine.batch)."""
    model, runner = tiny
    eos = [tok.eos_token_id]
    names = ["person-schema", "call-schema", "regex"]
    grammars = [compile_grammar(*GRAMMARS[n]) for n in names]
    prompts = [tok.encode(f"Request {i}: ") for i in range(4)]
    refs = [reference(model, tok, g, p, eos) for g, p in zip(grammars, prompts)]
    refs.append(hf_greedy(model, prompts[3], NEW, eos_token_id=eos, pad_token_id=eos[0]))
    cfgs = [DecodingConfig(max_new_tokens=NEW, grammar=g) for g in grammars] + [DecodingConfig(max_new_tokens=NEW)]
    dec = LookaheadDecoder(runner, cfgs[0])
    outs = generate_batch(dec, prompts, eos, tokenizer=tok, configs=cfgs, max_batch=4)
    for o, r in zip(outs, refs):
        assert o.output_ids == r, (tok.decode(o.output_ids), tok.decode(r))
    assert sum(o.stats.forced_tokens for o in outs[:3]) >= 3
    assert any(max(b - a for a, b in step_spans(o)) >= 2 for o in outs[:3])


def test_row_masks_follow_each_rows_path(tok):
    """Each row's mask is the matcher's state after its own extra tokens; the matcher is rolled
    back to the committed state; a row whose path the grammar rejects is left unmasked."""
    from lp.grammar.matcher import unpack

    g = RowGrammar(compile_grammar("choice", ["yes", "no"]), tok, VOCAB, "cpu", [tok.eos_token_id])
    y, n = tok.encode("y")[0], tok.encode("no")[0]
    bm, ok = g.masks([[], [y], [n], [tok.encode("maybe")[0]]])
    allowed = unpack(bm, VOCAB, "cpu")
    assert ok == [True, True, True, False]
    assert allowed[0, y] and allowed[0, n] and allowed[0].sum() < 20
    assert not allowed[1, y] and allowed[1].sum() >= 1  # after "y": "es"-like tokens only
    assert allowed[2].nonzero()[:, 0].tolist() == [tok.eos_token_id]  # "no" is complete: eos only
    assert allowed[3].all()
    assert g.forced(8) == ()  # still two choices: nothing forced, the matcher is back at the start


@pytest.mark.parametrize("kind,spec,needle", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", {"type": "object", "properties": {"a": {"type": "strin"}}}, "does not compile"),
    ("regex", "(ab", "does not compile"),
    ("choice", [], "non-empty list"),
    ("lark", "start: undefined_rule", "does not compile"),
])
def test_bad_grammars_are_value_errors(kind, spec, needle):
    with pytest.raises(ValueError, match=needle):
        compile_grammar(kind, spec)


def test_json_schema_path_and_missing_tokenizer(tiny, tok, tmp_path):
    model, runner = tiny
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(PERSON))
    prompt = tok.encode("A person: ")
    eos = [tok.eos_token_id]
    a = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=24, json_schema=str(path))).generate(prompt, eos,
                                                                                                    tokenizer=tok)
    b = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=24, grammar=compile_grammar("json_schema", PERSON)))
    assert a.output_ids == b.generate(prompt, eos, tokenizer=tok).output_ids
    with pytest.raises(ValueError, match="needs the tokenizer"):
        b.generate(prompt, eos)
    with pytest.raises(ValueError, match="decoding.json_schema: cannot read"):
        LookaheadDecoder(runner, DecodingConfig(json_schema=str(tmp_path / "missing.json")))


SAMPLED = ["person-schema", "call-schema", "regex", "lark", "choice"]


def sampled_batch(runner, tok, seed0):
    eos = [tok.eos_token_id]
    prompts = [tok.encode(f"Sampled request {i}: ") for i in range(len(SAMPLED))]
    cfgs = [DecodingConfig(max_new_tokens=NEW, grammar=compile_grammar(*GRAMMARS[n]), do_sample=True, temperature=1.0,
                           seed=seed0 + i) for i, n in enumerate(SAMPLED)]
    return generate_batch(LookaheadDecoder(runner, cfgs[0]), prompts, eos, tokenizer=tok, configs=cfgs,
                          max_batch=len(SAMPLED))


def test_sampled_grammar_requests_batched_are_valid(tiny, tok):
    """The server's path: several sampled grammar requests in one batch (lp.engine.batch), every
    output valid for its grammar (drafts below the committed token masked too), the same seeds
    drawing the same outputs."""
    _, runner = tiny
    eos = [tok.eos_token_id]
    outs = []
    for seed0 in (0, 100):
        outs += sampled_batch(runner, tok, seed0)
    for o, n in zip(outs, SAMPLED * 2):
        check_valid(*GRAMMARS[n], tok, o.output_ids, o.finish_reason == "stop", eos)
    assert sum(o.finish_reason == "stop" for o in outs) >= 6, [o.finish_reason for o in outs]
    assert sum(o.stats.forced_tokens for o in outs) >= 10  # the forced drafts rode in the sampled steps
    assert any(max(b - a for a, b in step_spans(o)) >= 2 for o in outs)
    assert len({tuple(o.output_ids) for o in outs}) >= 6  # sampled: the seeds draw different outputs
    again = sampled_batch(runner, tok, 0)
    assert [o.output_ids for o in again] == [o.output_ids for o in outs[: len(SAMPLED)]]


def test_grammar_request_hitting_the_prefix_cache(tiny, tok):
    """A second identical greedy grammar request finds its prompt in the prefix cache and answers
    the same valid output (== generate with the same mask)."""
    model, runner = tiny
    eos = [tok.eos_token_id]
    kind, spec = GRAMMARS["person-schema"]
    grammar = compile_grammar(kind, spec)
    prompt = tok.encode("A long shared system prompt about people, their names, ages, colors and tags. " * 3)
    engine = BatchEngine(runner, 4096, max_batch=2, prefix_cache=True)
    results = []
    for _ in range(2):
        rid = engine.add(prompt, DecodingConfig(max_new_tokens=NEW, grammar=grammar), eos, tok)
        while engine.has_work:
            engine.step()
        results.append(engine.result(rid))
    first, second = results
    assert first.stats.cached_tokens == 0 and second.stats.cached_tokens >= 32, second.stats.cached_tokens
    assert second.output_ids == first.output_ids == reference(model, tok, grammar, prompt, eos)
    check_valid(kind, spec, tok, second.output_ids, second.finish_reason == "stop", eos)


def test_server_engine_builds_the_grammar_matcher_once_idle(tiny, tok, monkeypatch):
    """lp.serve's engine builds llguidance's tokenizer in its own loop once it has been idle
    GRAMMAR_IDLE_S: not at start-up (a restart answers sooner), never beside serving (its
    GIL-holding build stalled the steps in flight); a grammar request then uses that one."""
    import threading
    import time

    from lp.server import batched
    from lp.server.batched import BatchedEngine

    _, runner = tiny
    eos = [tok.eos_token_id]
    for idle, expect in ((30.0, False), (0.2, True)):
        gm._TOKENIZERS.clear()
        monkeypatch.setattr(batched, "GRAMMAR_IDLE_S", idle)
        engine = BatchedEngine(runner, tok, eos, max_queue=2, max_batch=2, kv_tokens=1024, max_prefill_tokens=None)
        assert not gm.is_warm(tok, VOCAB, eos)  # not at start-up
        loop = threading.Thread(target=engine.run, daemon=True)
        loop.start()
        deadline = time.monotonic() + (20.0 if expect else 1.5)  # idle 1.5 s of a 30 s bound: nothing built
        while not gm.is_warm(tok, VOCAB, eos) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gm.is_warm(tok, VOCAB, eos) == expect, idle
        engine.request_stop()
        loop.join(10)
        assert not loop.is_alive()
    built = dict(gm._TOKENIZERS)
    rid = engine.batch.add(tok.encode("x"), DecodingConfig(max_new_tokens=4, grammar=compile_grammar(*GRAMMARS[
        "choice"])), eos, tok)
    while engine.batch.has_work:
        engine.batch.step()
    assert engine.batch.result(rid).output_ids
    assert gm._TOKENIZERS == built  # the request found the tokenizer the idle loop built


def test_a_tokenizer_asked_for_during_its_build_is_built_once(tok, monkeypatch, tmp_path):
    """A grammar request that arrives while lp.serve's start-up thread builds llguidance's
    tokenizer waits for that build (one lock) instead of building a second one."""
    import threading
    import time

    import llguidance.hf

    real, calls = llguidance.hf.from_tokenizer, []

    def slow(*args, **kwargs):
        calls.append(threading.current_thread().name)
        time.sleep(0.3)  # the other thread asks meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", slow)
    monkeypatch.setenv("LP_CACHE", str(tmp_path))  # no kept tokens: the build reads the tokenizer's JSON
    gm._TOKENIZERS.clear()
    eos = [tok.eos_token_id]
    got = []
    threads = [threading.Thread(target=lambda: got.append(gm.ll_tokenizer(tok, VOCAB, eos)), name=f"asker{i}")
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(calls) == 1 and len(got) == 3 and all(g is got[0] for g in got)
    gm._TOKENIZERS.clear()


def test_a_restart_builds_the_matcher_from_the_tokens_its_first_build_kept(tok, monkeypatch, tmp_path, caplog):
    """The first build of llguidance's tokenizer reads the tokenizer's JSON and keeps every token's bytes
    ($LP_CACHE/grammar); a later one (a restart) builds from those, never from the JSON, and is the same
    tokenizer: every token's bytes and specialness, and each grammar's masks and forced tokens after
    several prefixes. A damaged kept file is built again from the JSON, with a warning."""
    import logging

    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    monkeypatch.setenv("LP_CACHE", str(tmp_path))
    eos = [tok.eos_token_id]
    gm._TOKENIZERS.clear()
    first = gm.ll_tokenizer(tok, VOCAB, eos)
    (kept,) = (tmp_path / "grammar").iterdir()
    real = llguidance.hf.from_tokenizer

    def refuse(*args, **kwargs):
        raise AssertionError("a restart read the tokenizer's JSON")

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", refuse)
    gm._TOKENIZERS.clear()
    again = gm.ll_tokenizer(tok, VOCAB, eos)
    assert again is not first and again.vocab_size == first.vocab_size == VOCAB
    assert again.eos_tokens == first.eos_tokens
    for i in range(VOCAB):
        assert again.decode_bytes([i]) == first.decode_bytes([i]), i
        assert again.is_special_token(i) == first.is_special_token(i), i
    prefixes = ["", '{"', '{"name": "A', "neg", "ok(1", "ab@"]
    compared = 0
    for kind, spec in GRAMMARS.values():
        text = compile_grammar(kind, spec)
        for prefix in prefixes:
            a, b = (llguidance.LLMatcher(t, text, log_level=0) for t in (first, again))
            ids = tok.encode(prefix, add_special_tokens=False)
            a.consume_tokens(ids)
            b.consume_tokens(ids)
            assert a.is_error() == b.is_error(), (kind, prefix)
            if a.is_error():
                continue
            ma, mb = allocate_token_bitmask(1, VOCAB), allocate_token_bitmask(1, VOCAB)
            fill_next_token_bitmask(a, ma, 0)
            fill_next_token_bitmask(b, mb, 0)
            assert (ma == mb).all(), (kind, prefix)
            assert a.compute_ff_tokens() == b.compute_ff_tokens(), (kind, prefix)
            compared += 1
    assert compared >= len(GRAMMARS)
    kept.write_bytes(b"not an npz file")
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", real)
    gm._TOKENIZERS.clear()
    with caplog.at_level(logging.WARNING, logger="lp.grammar.matcher"):
        rebuilt = gm.ll_tokenizer(tok, VOCAB, eos)
    assert "do not read" in caplog.text and rebuilt.decode_bytes([100]) == first.decode_bytes([100])
    assert kept.read_bytes()[:2] == b"PK"  # kept anew
    gm._TOKENIZERS.clear()
