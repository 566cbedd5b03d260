"""Every OpenAI request field honored or refused by lp.serve, none ignored (real server, real client).

The schema walk takes every field of the ``openai`` package's typed request params for chat
and completions: each is in lp's FIELD_POLICY; a refused field with a real value gets a 400
naming it, with its no-op value it is served; an unknown field gets OpenAI's 400. Honored
fields do what they ask: penalties, logit_bias and top_k give transformers ``generate``'s
whole output with the same processors, top_k caps sampled tokens, logprobs (chat streamed
and not, legacy completions) equal generate's log-softmax to 1e-4, echo returns the prompt
first.
"""

from __future__ import annotations

import json
import typing

import httpx
import pytest
import torch

from lp.server.protocol import FIELD_POLICY
from tests.helpers import hf_greedy
from tests.test_processors import hf_processors
from tests.test_serve import start

pytestmark = pytest.mark.slow
PROMPT = "List three uses of a hash map, one line each."
M = 24

# a real (not no-op) value for every refused field
REFUSED_VALUES = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
    "tool_choice": "auto", "parallel_tool_calls": True,
    "functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}], "function_call": "auto",
    "response_format": {"type": "json_object"}, "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "verbosity": "low", "web_search_options": {}, "store": True, "metadata": {"k": "v"}, "service_tier": "flex",
    "moderation": {"x": 1}, "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {},
    "best_of": 2, "suffix": "tail",
}
NOOP_VALUES = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "modalities": ["text"],
               "store": False, "service_tier": "auto", "best_of": 1}


def openai_fields(kind: str) -> set[str]:
    if kind == "chat":
        from openai.types.chat import completion_create_params as params
    else:
        from openai.types import completion_create_params as params
    return set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start(tmp_path_factory, "serve_fields", 1, [])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    _, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def post(server, kind: str, **body) -> httpx.Response:
    base = {"model": "smollm2", "max_tokens": 4}
    base.update({"messages": [{"role": "user", "content": PROMPT}]} if kind == "chat" else {"prompt": "Hello"})
    base.update(body)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return httpx.post(server.url + path, json=base, timeout=300)


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_schema_walk_every_field_honored_or_refused(server, kind):
    fields = openai_fields(kind)
    assert fields - set(FIELD_POLICY) == set(), "fields of the OpenAI API with no policy"
    for name in sorted(fields):
        if FIELD_POLICY[name] != "refused":
            continue
        r = post(server, kind, **{name: REFUSED_VALUES[name]})
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"], err
        if name in NOOP_VALUES:
            assert post(server, kind, **{name: NOOP_VALUES[name]}).status_code == 200, name
    r = post(server, kind, no_such_field=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "no_such_field"
    assert "Unrecognized request argument" in r.json()["error"]["message"]
    assert post(server, kind, user="alice").status_code == 200


@pytest.fixture(scope="module")
def eos(smollm2):
    from lp.generate import eos_ids

    model, tok = smollm2
    return eos_ids(model, tok)


@pytest.mark.parametrize("settings", [
    dict(repetition_penalty=1.3), dict(frequency_penalty=0.8, presence_penalty=0.5), "ban_first", dict(top_k=5)])
def test_penalties_and_bias_equal_generate(server, smollm2, prompt_ids, eos, settings):
    """The whole answer (to max_tokens or eos) == generate with the same processors."""
    model, tok = smollm2
    greedy = hf_greedy(model, prompt_ids, M, eos_token_id=eos)
    if settings == "ban_first":
        settings = {"logit_bias": {greedy[0]: -100.0}}
    from lp.config import DecodingConfig

    kw, custom = hf_processors(DecodingConfig(**settings), len(prompt_ids))
    ref = hf_greedy(model, prompt_ids, M, eos_token_id=eos, logits_processor=custom, **kw)
    body = dict(settings, temperature=0, max_tokens=M, lookahead={"return_token_ids": True})
    if "logit_bias" in body:
        body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}
        assert ref[0] != greedy[0]
    r = post(server, "chat", **body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["lookahead"]["output_ids"] == ref and len(ref) >= 8
    assert choice["message"]["content"] == tok.decode(ref, skip_special_tokens=True)
    assert choice["finish_reason"] == ("stop" if ref[-1] in eos else "length")
    if settings != dict(top_k=5):
        assert ref != greedy  # the setting changed the output: it was honored, not ignored


def top_k_ranks(model, prompt_ids, out) -> list[int]:
    """Rank of each output token in the model's next-token distribution (0: the most likely)."""
    ids = torch.tensor([list(prompt_ids) + list(out)])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(out)].float()
    return [int((row > row[t]).sum()) for row, t in zip(logits, out)]


def test_top_k_under_sampling(server, smollm2, prompt_ids):
    """top_k while sampling: every drawn token is among the k most likely; the same seed
    without top_k draws outside them (so the test would see top_k ignored)."""
    model, _ = smollm2

    def sample(**kw):
        r = post(server, "chat", temperature=1.2, seed=5, max_tokens=M, lookahead={"return_token_ids": True}, **kw)
        assert r.status_code == 200, r.text
        return r.json()["lookahead"]["output_ids"]

    capped, free = sample(top_k=2), sample()
    assert len(capped) >= 8 and max(top_k_ranks(model, prompt_ids, capped)) <= 1, top_k_ranks(model, prompt_ids, capped)
    assert max(top_k_ranks(model, prompt_ids, free)) >= 2


def test_logprobs_equal_generate_streamed_and_not(server, smollm2, prompt_ids):
    model, tok = smollm2
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=M,
                             output_logits=True, return_dict_in_generate=True)
    ref = out.sequences[0, len(prompt_ids):].tolist()
    ref_lp = torch.stack([torch.log_softmax(x[0].float(), -1) for x in out.logits])
    client = server.client()
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=M, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    chunks = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=M, temperature=0, logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    n = len(content)
    assert n >= 8 and [e.token for e in streamed] == [e.token for e in content]
    for i, (e, s) in enumerate(zip(content, streamed)):
        assert e.token == tok.decode([ref[i]])
        assert e.logprob == pytest.approx(ref_lp[i, ref[i]].item(), abs=1e-4)
        # the two requests step differently (the second drafts from the first's text): a verify step of more than
        # lp.kernels.attention.NATIVE_ROWS rows runs ATen's sdpa, whose float32 sums differ from lp's one-row
        # kernel in the last bits (1.8e-6 here on an AVX2 EPYC)
        assert s.logprob == pytest.approx(e.logprob, abs=1e-5)
        vals, top = ref_lp[i].topk(3)
        assert [t.token for t in e.top_logprobs] == [tok.decode([t]) for t in top.tolist()]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(vals.tolist(), abs=1e-4)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    # completions: the legacy shape, by value
    raw = tok("def add(a, b):")["input_ids"]
    ids = torch.tensor([raw])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                             output_logits=True, return_dict_in_generate=True)
    ref = out.sequences[0, len(raw):].tolist()
    ref_lp = torch.stack([torch.log_softmax(x[0].float(), -1) for x in out.logits])
    c = client.completions.create(model="smollm2", prompt="def add(a, b):", max_tokens=6, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0
    assert lp.tokens == [tok.decode([t]) for t in ref]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for i, t in enumerate(ref):
        assert lp.token_logprobs[i] == pytest.approx(ref_lp[i, t].item(), abs=1e-4), i
        vals, top = ref_lp[i].topk(2)
        assert list(lp.top_logprobs[i]) == [tok.decode([k]) for k in top.tolist()], i
        assert list(lp.top_logprobs[i].values()) == pytest.approx(vals.tolist(), abs=1e-4), i


def test_echo_and_bad_values(server):
    r = post(server, "completions", prompt="def add(a, b):", echo=True, max_tokens=3, temperature=0)
    plain = post(server, "completions", prompt="def add(a, b):", max_tokens=3, temperature=0)
    assert r.json()["choices"][0]["text"] == "def add(a, b):" + plain.json()["choices"][0]["text"]
    for body, param in ((dict(logit_bias={"5": 101}), "logit_bias"), (dict(logit_bias={"99999999": 1}), "logit_bias"),
                        (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(min_p=1.5), "min_p"),
                        (dict(top_logprobs=2), "top_logprobs"), (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                        (dict(repetition_penalty=0), "repetition_penalty"),
                        (dict(stream_options={"include_obfuscation": True}, stream=True),
                         "stream_options.include_obfuscation")):
        r = post(server, "chat", **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = post(server, "completions", echo=True, logprobs=1, stream=True)  # prompt logprobs streamed (test_serve_prefix)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    assert json.loads(post(server, "chat").text)["choices"][0]["logprobs"] is None
