"""The LM head's greedy screen (lp.model.head): its argmax is the fp32 head's on rows whose
top logits nearly tie (where a bf16 head alone picks another token), it answers only steps
whose logits feed an argmax, and decoding through it equals generate."""

from __future__ import annotations

import pytest
import torch

from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine
from lp.engine.decoder import LookaheadDecoder
from lp.model import head as head_mod
from lp.model.head import HeadScreen, argmax_rows
from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT, hf_greedy


def _near_tie_head(v=4096, d=64, groups=64, seed=0):
    """A head whose tokens come in groups of near-equal rows: a row's best tokens differ by
    ~1e-3 of its logit, inside bf16's rounding, outside fp32's. Column 0 is a shift (w = 1,
    x = minus the row's top): the top logits sit near 0, where bf16's output rounding is
    nothing and the inputs' rounding is all the error."""
    gen = torch.Generator().manual_seed(seed)
    base_GD = torch.randn(groups, d, generator=gen)
    w_VD = base_GD.repeat_interleave(v // groups, 0) * (1 + 1e-3 * torch.randn(v, d, generator=gen))
    w_VD[:, 0] = 1.0
    x_MD = torch.randn(256, d, generator=gen) * 3
    x_MD[:, 0] = 0.0
    x_MD[:, 0] = -(x_MD @ w_VD.t()).amax(-1)
    return w_VD, x_MD


def test_the_screen_finds_the_fp32_argmax_where_bf16_alone_does_not():
    w_VD, x_MD = _near_tie_head()
    screen = HeadScreen(w_VD)
    want, bf16, got = [], [], []
    for rows in x_MD.split(8):
        want += (rows @ w_VD.t()).argmax(-1).tolist()
        bf16 += screen.bf16_logits(rows).float().argmax(-1).tolist()
        got += argmax_rows(screen.logits(rows))
    assert sum(a != b for a, b in zip(want, bf16)) > 20, "the rows do not test the bound: bf16 alone agrees"
    assert got == want
    assert screen.calls == len(x_MD) // 8
    # and with shifts of the other sign: the top logits large, the output's rounding the larger term
    x_MD[:, 0] += 200.0
    assert [argmax_rows(screen.logits(rows)) for rows in x_MD.split(8)] == [
        (rows @ w_VD.t()).argmax(-1).tolist() for rows in x_MD.split(8)]


def test_the_screen_leaves_to_the_fp32_head_what_it_cannot_prove():
    w_VD, x_MD = _near_tie_head()
    screen = HeadScreen(w_VD)
    assert screen.logits(x_MD[: head_mod.MAX_ROWS + 1]) is None  # too many rows to pay off
    bad = x_MD[:2].clone()
    bad[1, 3] = float("nan")
    assert screen.logits(bad) is None
    assert screen.calls == 0


def test_argmax_rows_is_torchs_first_maximum():
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(4, 256, generator=gen)
    y[1, [9, 7, 100, 200]] = 9.0  # ties, two in one block: the first one
    y[2, 70] = y[2, 64:128].max() + 5  # in a later block
    y[3, :] = -1.0  # every token ties
    assert argmax_rows(y) == y.argmax(-1).tolist() and argmax_rows(y)[1] == 7
    y[0] = float("-inf")  # rows that are not finite take torch's argmax
    y[2, 5] = float("inf")
    assert argmax_rows(y) == y.argmax(-1).tolist()
    y[3, 3] = float("nan")  # torch counts nan as the maximum
    assert argmax_rows(y) == y.argmax(-1).tolist()
    odd = torch.randn(3, 101, generator=gen)  # no block size divides it
    assert argmax_rows(odd) == odd.argmax(-1).tolist()


def test_greedy_decoding_through_the_screen_equals_generate(tiny_factory):
    model = tiny_factory("llama")
    runner = ModelRunner(model, linears="packed", head="screen")
    cfg = DecodingConfig(max_new_tokens=30, drafts="suffix", draft_budget="all", max_draft_rows=8, W=2, N=3, G=3)
    assert LookaheadDecoder(runner, cfg).generate(REPETITIVE_PROMPT).output_ids == hf_greedy(model, REPETITIVE_PROMPT, 30)
    assert runner.head_screen.calls > 0
    with pytest.raises(ValueError, match="model.head must be one of auto, screen, exact"):
        ModelRunner(model, head="bf16")
    with pytest.raises(ValueError, match="model.head=screen needs a packed fp32 LM head"):
        ModelRunner(model, linears="plain", head="screen")


@pytest.mark.parametrize("batched", [False, True])
def test_logprobs_and_sampling_read_the_fp32_heads_logits(tiny_factory, batched):
    """A request that reads logits (logprobs here) never gets the screen's: its logprobs equal
    those of an exact-head run, beside a greedy one in the same batch."""
    model = tiny_factory("llama")
    small = dict(W=2, N=3, G=2)  # steps of at most head.MAX_ROWS rows: the screen could answer them
    cfg = DecodingConfig(max_new_tokens=12, logprobs=True, top_logprobs=2, **small)

    def run(head):
        runner = ModelRunner(model, linears="packed", head=head)
        if not batched:
            return LookaheadDecoder(runner, cfg).generate(REPETITIVE_PROMPT), runner
        engine = BatchEngine(runner, kv_tokens=1024, block_size=8, max_batch=2)
        rid = engine.add(REPETITIVE_PROMPT, cfg)
        engine.add(REPETITIVE_PROMPT[2:], DecodingConfig(max_new_tokens=12, **small))
        tokens, lps = [], []
        while engine.has_work:
            for out in engine.step():
                if out.request_id == rid:
                    tokens += out.new_tokens
                    lps += out.logprobs or []
        return tokens, lps, runner

    def result(head):
        if batched:
            return run(head)
        res, runner = run(head)
        return res.output_ids, res.logprobs, runner

    calls = getattr(getattr(model, "_lp_head_screen", None), "calls", 0)  # the screen is kept on the model
    (exact, exact_lps, _), (screened, screened_lps, runner) = result("exact"), result("screen")
    assert screened == exact == hf_greedy(model, REPETITIVE_PROMPT, 12)
    assert [(t.token, round(t.logprob, 4)) for t in screened_lps] == [(t.token, round(t.logprob, 4)) for t in exact_lps]
    assert len(screened_lps) == 12 and all(t.logprob > -100 for t in screened_lps)
    if not batched:
        assert runner.head_screen.calls == calls  # no step of a logprobs request is screened
