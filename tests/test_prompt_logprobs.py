"""Prompt logprobs in the batch engine (lp.engine.batch ``add(prompt_logprobs=k,
prompt_only=...)``): the raw log-softmax of every prompt token given the ones before it,
read from the prefill rows of the packed forward (chunked, beside other sequences'
decode rows), equal to one plain forward of transformers over the prompt; ``prompt_only``
finishes after the prompt with no new token."""

from __future__ import annotations

import pytest
import torch

from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine
from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT, hf_greedy

TREE = dict(drafts="suffix", draft_budget="all", W=2, N=3, G=3, window_policy="always", max_draft_rows=8)


def reference(model, prompt, k):
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    chosen = [lp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    top = lp[:-1].topk(k, dim=-1) if k else None
    return chosen, top


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prompt_logprobs_equal_a_plain_forward(tiny_factory, family):
    model = tiny_factory(family)
    engine = BatchEngine(ModelRunner(model), kv_tokens=1024, block_size=8, max_batch=4, max_prefill_tokens=16,
                         prefix_cache=True)
    other = engine.add(REPETITIVE_PROMPT, DecodingConfig(max_new_tokens=20, **TREE))
    engine.step()
    engine.step()  # the other sequence decodes while the prompts below are fed in chunks of 16
    prompt = [(11 * i) % 113 + 2 for i in range(41)]
    full = engine.add(prompt, DecodingConfig(max_new_tokens=6, **TREE), prompt_logprobs=3)
    only = engine.add(prompt + [7, 8], DecodingConfig(max_new_tokens=1), prompt_logprobs=0, prompt_only=True)
    outs = {}
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_tokens)
    res = {i: engine.result(i) for i in (other, full, only)}
    assert res[other].output_ids == hf_greedy(model, REPETITIVE_PROMPT, 20)
    assert res[full].output_ids == hf_greedy(model, prompt, 6)
    assert res[only].output_ids == [] and outs.get(only, []) == [] and res[only].finish_reason == "length"
    for rid, p, k in ((full, prompt, 3), (only, prompt + [7, 8], 0)):
        lps = res[rid].prompt_logprobs
        assert len(lps) == len(p) and lps[0] is None
        assert [x.token for x in lps[1:]] == p[1:]
        chosen, top = reference(model, p, k)
        assert [x.logprob for x in lps[1:]] == pytest.approx(chosen, abs=1e-4)
        if k:
            assert [[t for t, _ in x.top] for x in lps[1:]] == top.indices.tolist()
            assert [v for x in lps[1:] for _, v in x.top] == pytest.approx(top.values.flatten().tolist(), abs=1e-4)
        else:
            assert all(x.top == () for x in lps[1:])
    # prompt logprobs never come from the prefix cache (the rows' logits are needed)
    again = engine.add(prompt, DecodingConfig(max_new_tokens=1), prompt_logprobs=0, prompt_only=True)
    while engine.has_work:
        engine.step()
    r = engine.result(again)
    assert r.stats.cached_tokens == 0
    assert [x.logprob for x in r.prompt_logprobs[1:]] == pytest.approx(chosen_of(model, prompt), abs=1e-4)
    assert engine.blocks_in_use == 0


def chosen_of(model, prompt):
    return reference(model, prompt, 0)[0]


def test_prompt_logprobs_checked(tiny_factory):
    engine = BatchEngine(ModelRunner(tiny_factory("llama")), kv_tokens=256)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add([1, 2, 3], DecodingConfig(max_new_tokens=2), prompt_logprobs=21)
    one = engine.add([5], DecodingConfig(max_new_tokens=1), prompt_logprobs=2, prompt_only=True)
    while engine.has_work:
        engine.step()
    assert engine.result(one).prompt_logprobs == [None]


def test_a_scored_prompt_carries_no_drafts(tiny_factory):
    """A prompt whose logprobs are asked for is scored on a step without drafts after it, so its
    logprobs are the same bits whatever the draft store holds: the same request again, once its
    first answer taught the store its continuation, gives them bit for bit (drafts land later)."""
    model = tiny_factory("llama")
    engine = BatchEngine(ModelRunner(model), kv_tokens=1024, block_size=8, max_batch=4)
    cfg = DecodingConfig(max_new_tokens=12, **TREE)  # draft_budget=all: every draft the store has is verified
    seen = []
    real = engine._propose

    def spy(items, chunk_rows, seqs):
        real(items, chunk_rows, seqs)
        seen.extend((it.req.id, it.req.run.step, bool(it.prop.candidates)) for it in items)

    engine._propose = spy
    ids = []
    for _ in range(2):
        ids.append(engine.add(REPETITIVE_PROMPT, cfg, prompt_logprobs=1))
        while engine.has_work:
            engine.step()
    first, second = (engine.result(i) for i in ids)
    assert not any(drafted for rid, step, drafted in seen if step == 0)
    assert any(drafted for rid, step, drafted in seen if rid == ids[1] and step > 0)  # the store's drafts, later
    assert [(x.logprob, x.top) for x in first.prompt_logprobs[1:]] == [(x.logprob, x.top) for x in second.prompt_logprobs[1:]]
    assert first.output_ids == second.output_ids == hf_greedy(model, REPETITIVE_PROMPT, 12)
