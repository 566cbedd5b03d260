"""EOS inside accepted runs, max_new_tokens boundaries, streaming (tiny random Llama)."""

from __future__ import annotations

import pytest
import torch

from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT, hf_greedy, lookahead, step_spans

MAX_NEW = 40
CFG = dict(W=5, N=4, G=5, prompt_pool=True)


@pytest.fixture(scope="module")
def base(tiny_factory):
    model = tiny_factory("llama")
    runner = ModelRunner(model)
    res = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=MAX_NEW, **CFG)
    ref = hf_greedy(model, REPETITIVE_PROMPT, MAX_NEW)
    assert res.output_ids == ref
    spans = step_spans(res)
    assert any(e - s >= 3 for s, e in spans), f"need a step publishing >= 3 tokens: {spans}"
    return model, runner, ref, spans


def _inner_positions(ref, spans):
    """Positions k published by a multi-token step with more tokens after k in that step,
    where ref[k] occurs for the first time; those inside the run (k > start) first."""
    inner, head = [], []
    for s, e in spans:
        if e - s < 2:
            continue
        for k in range(s, e - 1):
            if ref[k] not in ref[:k]:
                (inner if k > s else head).append(k)
    return inner + head


def test_eos_inside_accepted_run(base):
    model, runner, ref, spans = base
    positions = _inner_positions(ref, spans)
    assert positions, f"no first-occurrence token inside a multi-token step: {ref} {spans}"
    for k in positions[:3]:
        eos = ref[k]
        res = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[eos], **CFG)
        assert res.output_ids == ref[: k + 1], (k, eos)
        start = next(s for s, e in spans if s <= k < e)
        assert res.stats.records[-1].emitted == k + 1 - start, "the step must be cut right after eos"
        assert res.stats.new_tokens == k + 1
        assert hf_greedy(model, REPETITIVE_PROMPT, MAX_NEW, eos_token_id=eos) == ref[: k + 1]
        # a plain int is accepted as well
        res_int = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=eos, **CFG)
        assert res_int.output_ids == ref[: k + 1]


def test_multiple_eos_ids(base):
    model, runner, ref, spans = base
    k = _inner_positions(ref, spans)[0]
    later = [t for t in dict.fromkeys(ref[k + 1 :]) if t not in ref[: k + 1]]
    assert later, "need a token first appearing after k"
    t_late = later[0]
    k_late = ref.index(t_late)
    never = next(t for t in range(128) if t not in ref)
    for eos in ([t_late, ref[k]], [ref[k], t_late], [never, ref[k]]):
        res = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=eos, **CFG)
        assert res.output_ids == ref[: k + 1], eos
        assert hf_greedy(model, REPETITIVE_PROMPT, MAX_NEW, eos_token_id=eos) == ref[: k + 1]
    res = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[never, t_late], **CFG)
    assert res.output_ids == ref[: k_late + 1]
    res = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[never], **CFG)
    assert res.output_ids == ref
    res = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[], **CFG)
    assert res.output_ids == ref


def test_eos_as_first_token(base):
    _, runner, ref, _ = base
    res = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[ref[0]], **CFG)
    assert res.output_ids == ref[:1]
    assert res.stats.steps == 1


def test_max_new_tokens_boundaries(base):
    _, runner, ref, spans = base
    cuts = {1, 2, MAX_NEW - 1}
    for s, e in spans:
        if e - s >= 2:
            cuts.add(s + 1)  # keeps only the first token of a multi-token step
            cuts.add(e - 1)  # drops only the last one
    assert any(s < m - 1 < e - 1 for m in cuts for s, e in spans if e - s >= 3), "no cut inside a long step"
    for m in sorted(cuts):
        res = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=m, **CFG)
        assert len(res.output_ids) == m, m
        assert res.output_ids == ref[:m], m
        hist = res.stats.accept_hist
        assert sum(k * c for k, c in enumerate(hist)) == m
        assert res.stats.new_tokens == m
        start = next(s for s, e in spans if s < m <= e)
        assert res.stats.records[-1].emitted == m - start


class CollectingStreamer:
    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value):
        assert self.ends == 0, "put after end"
        self.puts.append(value.detach().clone())

    def end(self):
        self.ends += 1

    def streamed(self) -> list[int]:
        # like TextStreamer(skip_prompt=True): the first put is the prompt
        out = []
        for v in self.puts[1:]:
            out.extend(v.reshape(-1).tolist())
        return out


@pytest.mark.parametrize(
    "extra",
    [dict(max_new_tokens=MAX_NEW), dict(max_new_tokens=7), dict(max_new_tokens=1), dict(max_new_tokens=MAX_NEW, eos=True)],
    ids=["full", "cut", "one", "eos"],
)
def test_streamer_receives_exactly_the_output(base, extra):
    _, runner, ref, spans = base
    extra = dict(extra)
    if extra.pop("eos", False):
        extra["eos_token_ids"] = [ref[_inner_positions(ref, spans)[0]]]
    st = CollectingStreamer()
    runner_res = lookahead(runner, REPETITIVE_PROMPT, streamer=st, **extra, **CFG)
    assert st.ends == 1
    first = st.puts[0]
    assert first.dim() == 2 and first.shape == (1, len(REPETITIVE_PROMPT))
    assert first[0].tolist() == REPETITIVE_PROMPT
    assert all(v.dim() == 1 and v.numel() >= 1 for v in st.puts[1:])
    assert st.streamed() == runner_res.output_ids
    assert runner_res.output_ids == ref[: len(runner_res.output_ids)]
    # one put per step, of the tokens that step published
    assert [v.numel() for v in st.puts[1:]] == [r.emitted for r in runner_res.stats.records]


def test_on_step_callback(base):
    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder

    _, runner, ref, _ = base
    seen = []
    res = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=MAX_NEW, **CFG)).generate(
        REPETITIVE_PROMPT, on_step=lambda step, rec: seen.append((step, rec.emitted))
    )
    assert [s for s, _ in seen] == list(range(res.stats.steps))
    assert sum(e for _, e in seen) == MAX_NEW
    assert res.output_ids == ref
