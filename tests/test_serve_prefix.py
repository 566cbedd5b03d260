"""lp.serve with ``server.prefix_cache=true``, driven by the real ``openai`` client.

A three-turn chat with a long system prompt, sent to a warm server (prefix caching on)
and a cold one (off): every reply equals the cold server's and transformers' greedy
``generate`` on the same chat-templated ids; from the second turn on,
``usage.prompt_tokens_details.cached_tokens`` covers at least the whole previous turn's
prompt (block-aligned) and the hit counter of /metrics moves by as much. The option is
validated like every other (400-free: a config error at start), on by default and allowed
under LP and LP x TP.
"""

from __future__ import annotations

import pytest

from lp.server.config import ServeConfig, ServerConfig
from lp.config import ParallelConfig
from tests.helpers import hf_greedy

M = 24
SYSTEM = ("You are a careful assistant for a small bakery. The bakery opens at seven in the morning and "
          "closes at six in the evening, every day except Monday. It sells sourdough, rye, baguettes, "
          "croissants, cinnamon rolls and three kinds of seasonal pie. Orders for cakes need two days' notice. "
          "Always answer in one or two short sentences, politely, and never invent products that are not "
          "on this list. If you do not know, say so and suggest calling the shop. ") * 2
TURNS = ["When do you open on Tuesday?", "Do you sell rye bread?", "Can I order a cake for tomorrow?"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from tests.test_serve import start

    warm = start(tmp_path_factory, "prefix_warm", 1, ["server.prefix_cache=true", "server.kv_tokens=4096"])
    try:
        cold = start(tmp_path_factory, "prefix_cold", 1, ["server.prefix_cache=false", "server.kv_tokens=4096"])
    except BaseException:
        warm.stop()
        raise
    yield warm, cold
    warm.stop()
    cold.stop()


@pytest.mark.slow
def test_chat_turns_warm_equal_cold_and_generate(servers, smollm2):
    from lp.generate import eos_ids

    warm, cold = servers
    model, tok = smollm2
    eos = eos_ids(model, tok)
    messages = [{"role": "system", "content": SYSTEM}]
    before = warm.metrics().get("lp_prefix_cache_hit_tokens_total", 0)
    prev_len, hits = 0, 0
    for turn, text in enumerate(TURNS):
        messages.append({"role": "user", "content": text})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        ref = tok.decode(hf_greedy(model, ids, M, eos_token_id=eos), skip_special_tokens=True)
        w, c = (s.client().chat.completions.create(model="smollm2", messages=messages, max_tokens=M, temperature=0)
                for s in (warm, cold))
        assert w.choices[0].message.content == ref, f"turn {turn}: warm server vs generate"
        assert c.choices[0].message.content == ref, f"turn {turn}: cold server vs generate"
        assert w.usage.prompt_tokens == len(ids) == c.usage.prompt_tokens
        cached = w.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached == 0
        else:
            assert cached >= prev_len // 8 * 8, (turn, cached, prev_len)  # whole blocks of server.kv_block=8
        assert cached < len(ids) and cached % 8 == 0
        assert c.usage.prompt_tokens_details is None or not c.usage.prompt_tokens_details.cached_tokens
        hits += cached
        prev_len = len(ids)
        messages.append({"role": "assistant", "content": w.choices[0].message.content})
    assert hits > 0
    assert warm.metrics()["lp_prefix_cache_hit_tokens_total"] - before == hits


@pytest.mark.slow
def test_template_prefix_reused_whole_by_default_blocks(servers, smollm2):
    """Two unrelated one-turn chats with no system prompt of their own share SmolLM2's template
    opening (its default system prompt, 24 ids): with the default ``server.kv_block`` (8) the
    second reuses all of it whole-block-aligned; blocks of 16 would reuse 16 (the bound below
    fails then). Both answers equal the cold server's."""
    warm, cold = servers
    _, tok = smollm2
    chats = [[{"role": "user", "content": "Name three rivers in Europe."}],
             [{"role": "user", "content": "What is the boiling point of water at sea level?"}]]
    ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in chats]
    ids = [list(i["input_ids"] if hasattr(i, "keys") else i) for i in ids]
    common = next(k for k, (a, b) in enumerate(zip(*ids)) if a != b)
    assert common // 8 * 8 > common // 16 * 16, common  # the case blocks of 8 serve better
    got = []
    for m in chats:
        w, c = (s.client().chat.completions.create(model="smollm2", messages=m, max_tokens=4, temperature=0)
                for s in (warm, cold))
        assert w.choices[0].message.content == c.choices[0].message.content
        got.append(w.usage.prompt_tokens_details.cached_tokens if w.usage.prompt_tokens_details else 0)
    assert got[1] == common // 8 * 8, (got, common)


def test_prefix_cache_config_checked_on_by_default_and_allowed_under_lp():
    with pytest.raises(ValueError, match="server.prefix_cache"):
        ServerConfig(prefix_cache="yes").validate()
    with pytest.raises(ValueError, match="server.kv_block"):
        ServerConfig(kv_block=0).validate()
    with pytest.raises(ValueError, match="server.kv_tokens"):
        ServerConfig(kv_block=64, kv_tokens=32).validate()
    from lp.model.paged import BLOCK_SIZE

    assert ServerConfig().kv_block == BLOCK_SIZE  # the server's default block is the engine's
    assert ServerConfig().prefix_cache is True
    for par in (ParallelConfig(workers=2), ParallelConfig(tp=2), ParallelConfig(workers=2, tp=2)):
        ServeConfig(server=ServerConfig(prefix_cache=True), parallel=par).validate()
    ServeConfig(server=ServerConfig(prefix_cache=False)).validate()


# -- prompt logprobs on /v1/completions (echo + logprobs, max_tokens 0) ---------------------

SCORED = "The capital of France is Paris. The capital of Italy is Rome."


def _reference_logprobs(model, ids):
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return lp


@pytest.mark.slow
def test_echo_logprobs_score_the_prompt(servers, smollm2):
    """max_tokens 0 + echo + logprobs (what lm-eval's loglikelihood sends): the prompt's own
    logprobs == one plain forward's log_softmax, the first null; with max_tokens 3 the
    completion follows, greedy, with its own logprobs; the warm server computes the prompt
    even when it is cached (cached_tokens 0)."""
    model, tok = smollm2
    warm, _ = servers
    ids = tok(SCORED)["input_ids"]
    lp = _reference_logprobs(model, ids)
    client = warm.client()
    for attempt in range(2):  # the second time its blocks are in the prefix cache
        r = client.completions.create(model="smollm2", prompt=SCORED, max_tokens=0, echo=True, logprobs=2,
                                      temperature=0)
        c = r.choices[0]
        assert c.text == SCORED and c.finish_reason == "length" and r.usage.completion_tokens == 0
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        got = c.logprobs.token_logprobs
        assert len(got) == len(ids) and got[0] is None and c.logprobs.top_logprobs[0] is None
        want = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert got[1:] == pytest.approx(want, abs=1e-3), attempt
        assert c.logprobs.tokens == [tok.decode([t]) for t in ids]
        for i in range(1, len(ids)):
            top = c.logprobs.top_logprobs[i]
            best = lp[i - 1].topk(2)
            assert list(top) == [tok.decode([t]) for t in best.indices.tolist()] or len(set(top)) < 2
            assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-3)
        assert c.logprobs.text_offset[0] == 0 and c.logprobs.text_offset[-1] == len(SCORED) - len(c.logprobs.tokens[-1])
    r = client.completions.create(model="smollm2", prompt=ids, max_tokens=3, echo=True, logprobs=0, temperature=0)
    c = r.choices[0]
    new = hf_greedy(model, ids, 3)
    assert c.text == tok.decode(ids) + tok.decode(new)
    got = c.logprobs.token_logprobs
    assert len(got) == len(ids) + 3 and got[0] is None
    assert got[1 : len(ids)] == pytest.approx([lp[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-3)
    lp2 = _reference_logprobs(model, ids + new)
    assert got[len(ids):] == pytest.approx([lp2[len(ids) - 1 + k, new[k]].item() for k in range(3)], abs=1e-3)


@pytest.mark.slow
def test_echo_bad_combinations_are_400(servers):
    import openai

    warm, _ = servers
    client = warm.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    r = client.completions.create(model="smollm2", prompt="Hi there", max_tokens=0, echo=True)
    assert r.choices[0].text == "Hi there" and r.choices[0].logprobs is None


@pytest.mark.slow
def test_lm_eval_loglikelihood_equals_hf(servers, smollm2_dense, tmp_path):
    """lm-eval's ``local-completions`` model (echo + logprobs over token ids, what its
    loglikelihood tasks send) against this server == lm-eval's own HF model on the same
    requests: the log-likelihood of each continuation and whether it is greedy."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval[api]: its API models need it
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model, tok = smollm2_dense  # HFLM reads the embedding's weight: the file's weights as float32 parameters
    tok.save_pretrained(tmp_path / "tok")  # the GGUF's tokenizer as files lm-eval's API model can load
    warm, _ = servers
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " a small village"),
             ("def add(a, b):\n    return", " a + b"), ("One, two, three,", " four")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    served = LocalCompletionsAPI(base_url=warm.url + "/v1/completions", model="smollm2", tokenizer=str(tmp_path / "tok"),
                                 tokenizer_backend="huggingface", tokenized_requests=True, batch_size=1,
                                 max_retries=1)
    got = served.loglikelihood(reqs, disable_tqdm=True)
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=1).loglikelihood(reqs, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in ref], (got, ref)
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in ref], abs=2e-3), (got, ref)
    assert lm_eval.__version__ and any(g for _, g in ref)  # " Paris" / " four" are greedy


@pytest.mark.slow
def test_echo_logprobs_streamed_equal_whole(servers):
    """echo + logprobs streamed: the first text chunk is the prompt with its own logprobs,
    then the completion's chunks; joined, text and logprobs (tokens, token_logprobs,
    top_logprobs, text_offset) equal the same request not streamed; max_tokens 0 too."""
    warm, _ = servers
    client = warm.client()
    for max_tokens in (4, 0):
        kw = dict(model="smollm2", prompt=SCORED, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0)
        whole = client.completions.create(**kw).choices[0]
        text, lps, first = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, None
        for ch in client.completions.create(stream=True, **kw):
            for c in ch.choices:
                if c.text and first is None:
                    first = c
                text += c.text
                if c.logprobs is not None:
                    for k in lps:
                        lps[k] += getattr(c.logprobs, k)
        assert first.text == SCORED and first.logprobs.token_logprobs[0] is None, max_tokens
        assert text == whole.text, max_tokens
        for k in lps:
            assert lps[k] == getattr(whole.logprobs, k), (max_tokens, k)
