"""Sampling seeds: request validation (``prepare``, no server), then lp.serve through the real
``openai`` client, in one process and on 2 LP (gloo) workers (the slow tests).

Contract checked: a seeded request with the server's default lookahead (suffix drafts that learn
from every answer, so the same request meets other drafts each time) returns the same text sent
three times, while 7 other clients keep the server busy, on 2 LP workers, and equal to lp's
plain seeded decoding of the same prompt (``mode=ar``, offline, token for token); a sampled request without ``seed`` draws a fresh seed (rank 0 draws it at
admission; under LP it rides with the request to every rank), so identical unseeded requests
answer differently, and the seed drawn is reported as ``lookahead.seed`` (sending it back
reproduces the answer); a request with ``seed`` is reproducible, and its tokens on 2 LP workers
equal the one-process server's; ``n`` > 1 samples choice i with seed + i wrapped into the signed
64-bit range (``seed`` 2**63 - 1 with ``n`` 2 is a 200 whose choices carry seeds 2**63 - 1 and
-2**63, never a 500, and the server keeps serving).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from lp.config import DecodingConfig
from lp.server.engine import pack_request, unpack_request
from lp.server.protocol import ChatRequest, CompletionRequest, choice_seed, parse, prepare

M = 16  # new tokens per sampled request
PROMPT = "Write one sentence about anything you like."
SHAPE = {"W": 4, "N": 4, "G": 4}  # explicit: both servers decode the same lookahead shape
INT64_MAX = 2**63 - 1
ARGS = ["server.max_n=2", "server.kv_tokens=8192", "server.max_batch=8"]
REPRO = dict(max_tokens=40, temperature=0.9, top_p=0.9, seed=1234)  # the must-show's request (issue 51)
REPRO_PROMPT = "Tell me a short story about a robot who learns to paint."
BUSY = ["Name three rivers.", "Write a haiku about rain.", "What is 17 * 23?", "Describe a cat.",
        "List four fruits.", "Explain photosynthesis briefly.", "Give me a riddle."]


# ---------------------------------------------------------------------------
# without a server


@pytest.fixture(scope="module")
def tok():

    from lp.model.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2", None))


def _prepare(tok, body: dict, base: DecodingConfig | None = None):
    from tests.test_serve_units import _ctx

    ctx = _ctx(tok, max_n=4)
    if base is not None:
        ctx = dataclasses.replace(ctx, base=base)
    cls = ChatRequest if "messages" in body else CompletionRequest
    return prepare(parse(cls, json.dumps(body).encode()), ctx).decoding


def test_prepare_draws_a_fresh_seed_only_for_unseeded_sampled_requests(tok):
    sampled = {"prompt": "abc", "temperature": 0.9}
    drawn = [_prepare(tok, sampled).seed for _ in range(3)]
    assert len(set(drawn)) == 3 and all(0 <= s <= INT64_MAX for s in drawn), drawn
    assert [_prepare(tok, {**sampled, "seed": 7}).seed for _ in range(2)] == [7, 7]
    assert _prepare(tok, {**sampled, "seed": -(2**63)}).seed == -(2**63)
    # greedy requests keep the server's seed (it only picks the window's start tokens there)
    assert _prepare(tok, {"prompt": "abc", "temperature": 0}).seed == 0
    assert _prepare(tok, {"prompt": "abc"}, DecodingConfig(max_new_tokens=8, seed=5)).seed == 5
    # a server sampling by default (decoding.do_sample=true): a request without temperature samples, and
    # without seed it draws one too (never the server's decoding.seed)
    base = DecodingConfig(max_new_tokens=8, do_sample=True, seed=5)
    assert len({_prepare(tok, {"prompt": "abc"}, base).seed for _ in range(3)}) == 3


def test_choice_seeds_wrap_within_int64_and_fit_the_lp_channel():
    assert [choice_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert [choice_seed(INT64_MAX - 1, i) for i in range(4)] == [INT64_MAX - 1, INT64_MAX, -(2**63), -(2**63) + 1]
    assert choice_seed(-1, 1) == 0
    for i in range(4):  # every choice's decoding packs into the request channel's int64s and back
        d = DecodingConfig(do_sample=True, seed=choice_seed(INT64_MAX, i))
        fields, payload = pack_request([1, 2], d)
        assert all(-(2**63) <= x <= INT64_MAX for x in fields + payload)
        assert unpack_request(fields, payload, DecodingConfig())[1].seed == d.seed


# ---------------------------------------------------------------------------
# through the servers


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    from tests.test_serve import start

    s = start(tmp_path_factory, "seeds1", 1, ARGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lp2(tmp_path_factory):
    from tests.test_serve import start

    s = start(tmp_path_factory, "seeds_lp2", 2, ARGS)
    yield s
    s.stop()


def chat(server, **kw):
    """(text, output ids, lookahead.seed) of one sampled chat answer at temperature 0.9."""
    r = server.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": PROMPT}], max_tokens=M, temperature=0.9,
        extra_body={"lookahead": dict(SHAPE, return_token_ids=True)}, **kw)
    la = r.model_extra["lookahead"]
    return r.choices[0].message.content, la["output_ids"], la.get("seed")


def _unseeded_differ_seeded_repeat(server) -> list[int]:
    unseeded = [chat(server) for _ in range(3)]
    texts = [text for text, _, _ in unseeded]
    assert len(set(texts)) == 3, texts  # three requests, three fresh seeds, three samples
    seeds = [seed for _, _, seed in unseeded]
    assert all(isinstance(s, int) and 0 <= s <= INT64_MAX for s in seeds) and len(set(seeds)) == 3, seeds
    # the seed reported reproduces the unseeded answer
    assert chat(server, seed=seeds[0])[:2] == unseeded[0][:2]
    seeded = [chat(server, seed=11) for _ in range(3)]
    assert seeded[0] == seeded[1] == seeded[2], seeded
    assert seeded[0][2] == 11
    return seeded[0][1]


@pytest.mark.slow
def test_one_process_unseeded_requests_differ_and_seeded_ones_repeat(one):
    _unseeded_differ_seeded_repeat(one)


@pytest.mark.slow
def test_lp_unseeded_requests_differ_and_seeded_ones_repeat_and_equal_one_process(one, lp2):
    ids = _unseeded_differ_seeded_repeat(lp2)
    assert ids == chat(one, seed=11)[1]  # every rank sampled with the seed rank 0 sent


def _choices(server, **kw):
    r = server.client().completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8,
                                           temperature=1.0, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    return [c.text for c in r.choices], [la["seed"] for la in r.model_extra["lookahead"]["choices"]]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["one", "lp2"])
def test_n_choices_wrap_their_seeds_within_int64(which, request):
    server = request.getfixturevalue(which)
    texts, seeds = _choices(server, seed=INT64_MAX)
    assert seeds == [INT64_MAX, -(2**63)]  # seed + 1 wrapped into the signed 64-bit range
    assert _choices(server, seed=INT64_MAX) == (texts, seeds)  # reproducible
    texts, seeds = _choices(server)  # unseeded: one drawn seed s, the choices s and s + 1 (wrapped)
    assert seeds[1] == (seeds[0] + 1 + 2**63) % 2**64 - 2**63, seeds
    assert server.client().models.list().data[0].id == "smollm2"  # still serving
    assert chat(server, seed=3)[2] == 3


def repro(server) -> tuple[str, list[int]]:
    r = server.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": REPRO_PROMPT}],
        extra_body={"lookahead": {"return_token_ids": True}}, **REPRO)
    return r.choices[0].message.content, r.model_extra["lookahead"]["output_ids"]


def busy_repro(server) -> tuple[str, list[int]]:
    """The seeded request while 7 other clients (sampled, unseeded, and greedy) share the batch."""
    from concurrent.futures import ThreadPoolExecutor

    def other(i: int):
        return server.client().chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": BUSY[i]}], max_tokens=48,
            temperature=0.8 if i % 2 else 0.0)

    with ThreadPoolExecutor(8) as pool:
        others = [pool.submit(other, i) for i in range(7)]
        mine = pool.submit(repro, server)
        assert all(f.result().choices[0].message.content for f in others)
        return mine.result()


@pytest.fixture(scope="module")
def plain_repro(smollm2):
    """lp's plain seeded decoding (mode=ar, one process, offline) of the must-show's request."""
    from lp.engine.decoder import LookaheadDecoder
    from lp.model.runner import ModelRunner

    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": REPRO_PROMPT}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    cfg = DecodingConfig(mode="ar", do_sample=True, max_new_tokens=REPRO["max_tokens"], seed=REPRO["seed"],
                         temperature=REPRO["temperature"], top_p=REPRO["top_p"])
    out = LookaheadDecoder(ModelRunner(model), cfg).generate(ids, eos_token_ids=[tok.eos_token_id]).output_ids
    return [t for t in out if t != tok.eos_token_id]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["one", "lp2"])
def test_seeded_request_repeats_under_default_drafts_and_load_and_equals_plain_decoding(which, request,
                                                                                         plain_repro):
    server = request.getfixturevalue(which)
    answers = [repro(server) for _ in range(3)]  # the suffix index learns from each answer in turn
    answers.append(busy_repro(server))
    assert all(a == answers[0] for a in answers), answers
    assert [t for t in answers[0][1] if t != 2] == plain_repro, (answers[0][1], plain_repro)  # 2: SmolLM2's eos
