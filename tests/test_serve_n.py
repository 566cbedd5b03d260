"""lp.serve ``n`` > 1 through the real ``openai`` client: each choice is its own sequence
in the batch; greedy choices all equal transformers' ``generate``; sampled choice i equals
seed + i (distinct, reproducible); usage counts the prompt once and every choice's
completion; streamed (SSE chunks carrying their choice's ``index``), every choice's text equals
the same request's non-streamed choice, greedy ones ``generate``, one usage chunk counting every
choice; bad values are 400s naming ``n``."""

from __future__ import annotations

import pytest

from tests.helpers import hf_greedy

pytestmark = pytest.mark.slow
M = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.test_serve import start

    s = start(tmp_path_factory, "serve_n", 1, ["server.prefix_cache=true", "server.kv_tokens=4096",
                                                "server.max_batch=4", "server.max_n=4"])
    yield s
    s.stop()


def test_greedy_choices_equal_generate(server, smollm2):
    from lp.generate import eos_ids

    model, tok = smollm2
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ref = tok.decode(hf_greedy(model, ids, M, eos_token_id=eos_ids(model, tok)), skip_special_tokens=True)
    r = server.client().chat.completions.create(model="smollm2", messages=messages, max_tokens=M, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [ref] * 3
    one = len(tok(ref, add_special_tokens=False)["input_ids"])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens >= 3 * min(one, M) - 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(r.model_extra["lookahead"]["choices"]) == 3


def test_sampled_choices_differ_and_repeat(server):
    """Choice i samples with seed + i: the choices differ, and the same request gives the
    same choices again. (Not compared with n=1 requests of seed + i: a sampled lookahead
    run's draws are keyed by its steps, and a choice decoded beside others takes other
    draft trees than one alone; only its distribution is the same.)"""
    client = server.client()
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=M, temperature=1.0, n=3, seed=5)
    r = client.completions.create(**kw)
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3, texts  # three seeds, three samples (12 tokens at temperature 1)
    assert [c.text for c in client.completions.create(**kw).choices] == texts
    assert r.usage.completion_tokens == 3 * M or any(c.finish_reason == "stop" for c in r.choices)


def test_bad_n_is_400(server):
    import openai

    client = server.client()
    for kw in (dict(n=5), dict(n=0), dict(n=True)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, **kw)
        assert e.value.body["param"] == "n", kw


def _streamed(stream, kind: str) -> tuple[dict, object, list]:
    """{index: concatenated text}, the usage chunk's usage, and every index seen, in order."""
    texts, use, seen = {}, None, []
    for ch in stream:
        if ch.usage is not None:
            use = ch.usage
        for c in ch.choices:
            seen.append(c.index)
            piece = c.delta.content if kind == "chat" else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
    return texts, use, seen


def test_streamed_choices_carry_their_index(server, smollm2):
    """n=3 streamed: greedy chat choices each == generate; sampled completions choice i ==
    choice i of the same request not streamed (seed + i); one usage chunk counting all."""
    from lp.generate import eos_ids

    model, tok = smollm2
    client = server.client()
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ref = tok.decode(hf_greedy(model, ids, M, eos_token_id=eos_ids(model, tok)), skip_special_tokens=True)
    texts, use, seen = _streamed(client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=M, temperature=0, n=3, stream=True,
        stream_options={"include_usage": True}), "chat")
    assert texts == {0: ref, 1: ref, 2: ref} and set(seen) == {0, 1, 2}
    assert use.prompt_tokens == len(ids) and use.total_tokens == use.prompt_tokens + use.completion_tokens
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=M, temperature=0, n=3)
    assert use.completion_tokens == whole.usage.completion_tokens
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=M, temperature=1.0, n=3, seed=5)
    want = {c.index: c.text for c in client.completions.create(**kw).choices}
    texts, use, _ = _streamed(client.completions.create(stream=True, **kw), "completions")
    assert texts == want and len(set(want.values())) == 3, (texts, want)
    assert use is None  # no include_usage: no usage chunk
