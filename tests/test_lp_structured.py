"""Structured output under Lookahead Parallelism: 2 gloo workers under torchrun (tests/lp_worker.py).

Contract checked: with a JSON schema (decoding.json_schema) every rank holds the same llguidance
matcher, advanced on the same committed tokens, masks its own rows and drafts the grammar's forced
continuation into the shard plan like any candidate; the 2-worker output equals one process token
for token, greedy and sampled (same seeds), is valid under the schema, and the forced drafts were
accepted under LP too (forced_tokens > 0); a digits regex (decoding.grammar) on the pool shape equals
one process too. lp.serve's request message carries the grammar text to the other ranks.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from lp.grammar.matcher import compile_grammar

from tests.test_lp import torchrun

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"], "additionalProperties": False}
PROMPT = "Invent a person: name, age and city. Answer in JSON."
SHAPES = [
    # suffix drafts (the default source) with every node verified: forced drafts + window in one tree
    {"drafts": "suffix", "draft_budget": "all", "W": 3, "N": 4, "G": 4, "max_draft_rows": 16},
    # the paper's pool drafts: the forced continuation is no draft there, the masks still are per row
    {"W": 4, "N": 3, "G": 3, "prompt_pool": True},
]
SAMPLED = {"do_sample": True, "temperature": 0.8, "top_p": 0.95}
DIGITS = "[0-9]{4}( [0-9]{4}){5}"


def chat_ids(text: str) -> list[int]:
    from lp.model.loader import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path("smollm2", None))
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids), tok


def test_lp_json_schema_greedy_and_sampled_equal_one_process(tmp_path):
    prompt, tok = chat_ids(PROMPT)
    eos = [tok.eos_token_id]
    jobs = [{"prompt_ids": prompt, "eos": eos, "decoding": dict(shape, json_schema=json.dumps(SCHEMA),
                                                                   max_new_tokens=48)} for shape in SHAPES]
    jobs += [{"prompt_ids": prompt, "eos": eos, "decoding": dict(SHAPES[0], json_schema=json.dumps(SCHEMA),
                                                                    max_new_tokens=32, seed=s, **SAMPLED)}
             for s in (1, 2)]
    # digits where the free model writes words: a rank verifying its rows unmasked errs here (greedy)
    jobs.append({"prompt_ids": prompt, "eos": eos, "decoding": dict(W=4, N=4, G=4, grammar=compile_grammar("regex", DIGITS),
                                                                    max_new_tokens=40)})
    spec = {"jobs": jobs, "tokenizer": True, "check_divergence": True}
    proc1, single = torchrun(1, spec, tmp_path)
    assert proc1.returncode == 0, proc1.stderr[-3000:]
    proc2, multi = torchrun(2, spec, tmp_path)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert len(single) == len(multi) == len(jobs)
    assert re.fullmatch(DIGITS, tok.decode(single[-1]["output_ids"], skip_special_tokens=True)), single[-1]
    assert multi[-1]["output_ids"] == single[-1]["output_ids"], (tok.decode(single[-1]["output_ids"]),
                                                                 tok.decode(multi[-1]["output_ids"]))
    for job, one, many in zip(jobs[:-1], single, multi):
        cfg = job["decoding"]
        assert many["output_ids"] == one["output_ids"], (cfg, tok.decode(one["output_ids"]),
                                                         tok.decode(many["output_ids"]))
        assert many["finish_reason"] == one["finish_reason"], cfg
        assert len(many["mean_rows_per_rank"]) == 2
        if one["finish_reason"] == "stop":
            jsonschema.validate(json.loads(tok.decode(one["output_ids"], skip_special_tokens=True)), SCHEMA)
        else:  # cut by max_new_tokens: still the start of an object
            assert tok.decode(one["output_ids"]).startswith("{"), tok.decode(one["output_ids"])
    assert single[0]["finish_reason"] == "stop"  # greedy: a whole, valid object
    assert multi[0]["forced_tokens"] > 0 and sum(multi[0]["accept_hist"][2:]) > 0, multi[0]  # forced drafts, LP
    assert single[2]["output_ids"] != single[3]["output_ids"]  # the seeds draw different objects


def test_request_channel_carries_the_grammar():
    """lp.serve's request message (lp.server.engine.pack_request) carries the request's grammar text
    to the other ranks byte for byte (any length, non-ASCII), and None stays None (the base's own)."""
    from lp.config import DecodingConfig
    from lp.grammar.matcher import compile_grammar
    from lp.server.engine import pack_step, unpack_step

    texts = [compile_grammar("json_schema", SCHEMA), compile_grammar("choice", ["naïve", "ß", "x" * 13]), "a", None]
    joins = [(k, [5, 6, 7], DecodingConfig(grammar=t, stop_strings=["é"], logit_bias={3: -1.5}))
             for k, t in enumerate(texts)]
    got, _, _, _, _ = unpack_step(*pack_step(joins, [], [], False), DecodingConfig())
    assert [d.grammar for _, _, d, *_ in got] == texts
    assert all(p == [5, 6, 7] and d.stop_strings == ["é"] and d.logit_bias == {3: -1.5} for _, p, d, *_ in got)
