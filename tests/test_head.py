"""The LM head's greedy screen (lp.kernels.head): its argmax is the fp32 head's on rows whose
top logits nearly tie (where a bf16 head alone picks another token), it answers only steps
whose logits feed an argmax, and decoding through it equals generate."""

from __future__ import annotations

import pytest
import torch

from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine
from lp.engine.decoder import LookaheadDecoder
from lp.kernels import head as head_mod
from lp.kernels.head import HeadScreen, argmax_rows
from lp.kernels.linears import bf16_packs
from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT, hf_greedy

# the screen packs its bf16 copy with oneDNN, which needs AVX-512 BW / VL / DQ or AVX-NE-CONVERT
needs_bf16 = pytest.mark.skipif(not bf16_packs(), reason="oneDNN cannot pack bf16 linears on this CPU (no screen here)")


def _near_tie_head(v=4096, d=64, groups=64, seed=0, noise=3e-2):
    """A head whose tokens come in groups of near-equal rows: a row's best tokens differ by
    ~``noise`` of its logit (3e-2: mostly inside bf16's rounding bound, outside the two fp32
    evaluations' bound, which the screen must beat to answer). Column 0 is a shift (w = 1,
    x = minus the row's top): the top logits sit near 0, where bf16's output rounding is
    nothing and the inputs' rounding is all the error."""
    gen = torch.Generator().manual_seed(seed)
    base_GD = torch.randn(groups, d, generator=gen)
    w_VD = base_GD.repeat_interleave(v // groups, 0) * (1 + noise * torch.randn(v, d, generator=gen))
    w_VD[:, 0] = 1.0
    x_MD = torch.randn(256, d, generator=gen) * 3
    x_MD[:, 0] = 0.0
    x_MD[:, 0] = -(x_MD @ w_VD.t()).amax(-1)
    return w_VD, x_MD


def _screened(screen, x_MD, w_VD, rows=8):
    """Argmaxes of ``x_MD`` through the screen, ``rows`` at a time, the fp32 head's where it
    answers None (what lp.kernels.linears does); and how many of them the screen answered
    where bf16 alone picks another token."""
    got, hard = [], 0
    for x_RD in x_MD.split(rows):
        y = screen.logits(x_RD)
        got += argmax_rows(y if y is not None else x_RD @ w_VD.t())
        if y is not None:
            hard += int((screen.bf16_logits(x_RD).float().argmax(-1) != (x_RD @ w_VD.t()).argmax(-1)).sum())
    return got, hard


@needs_bf16
def test_the_screen_finds_the_fp32_argmax_where_bf16_alone_does_not():
    w_VD, x_MD = _near_tie_head()
    screen = HeadScreen(w_VD)
    want = (x_MD @ w_VD.t()).argmax(-1).tolist()
    bf16 = screen.bf16_logits(x_MD).float().argmax(-1).tolist()
    assert sum(a != b for a, b in zip(want, bf16)) > 20, "the rows do not test the bound: bf16 alone agrees"
    got, hard = _screened(screen, x_MD, w_VD)
    assert got == want
    assert screen.calls + screen.undecided == len(x_MD) // 8 and screen.calls >= 20, (screen.calls, screen.undecided)
    assert hard >= 10, "the batches the screen answered hold no row bf16 alone gets wrong"
    # and with shifts of the other sign: the top logits large, the output's rounding the larger term
    x_MD[:, 0] += 200.0
    calls = screen.calls
    got, _ = _screened(screen, x_MD, w_VD)
    assert got == (x_MD @ w_VD.t()).argmax(-1).tolist() and screen.calls - calls >= 10, (calls, screen.calls)


@needs_bf16
def test_a_row_whose_bf16_rounding_errs_towards_a_wrong_token_keeps_the_true_argmax():
    """The bound is tight: x and two weight rows built so that bf16 rounds every product of the
    true argmax A down and every product of a rival B up (unit roundoff u = 2^-8 relative, each
    element rounded by just under u): bf16 puts B ~2u sum |x||w| above A though A's fp32 logit is
    the larger. The screen's bound (2u + ...) ||x|| ||w_max|| keeps A, within ~5% of it; the
    bound taken with u = 2^-9 (a half), or a quarter, drops A and the screen answers B."""
    d, v, a, b = 64, 64, 40, 7
    down, up = 1 + 2.0 ** -8 - 2.0 ** -20, 1 + 2.0 ** -8 + 2.0 ** -20  # round to 1 and to 1 + 2^-7
    x_D = torch.ones(d)
    x_D[:31], x_D[31:62] = down, up  # two exact coordinates at the end
    w_VD = -0.5 * x_D.repeat(v, 1) / x_D.norm() * 8 + 0.01 * torch.randn(v, d, generator=torch.Generator().manual_seed(0))
    w_VD[a, :31], w_VD[a, 31:62], w_VD[a, 62:] = down, -up, torch.tensor([2.0 ** -8, 0.0])
    w_VD[b] = -w_VD[a]
    w_VD[b, 63] = 0.0
    assert w_VD.norm(dim=1).argmax() in (a, b)  # the largest ||w_v|| is A's (or B's, equal): the bound's own
    x_1D = x_D[None]
    fp32 = (x_1D @ w_VD.t())[0]
    assert fp32.argmax() == a and fp32[a] - fp32[b] > 6e-3  # A wins in fp32 by more than the fp32 bounds
    screen = HeadScreen(w_VD)
    y_V = screen.bf16_logits(x_1D).float()[0]
    assert y_V.argmax() == b and y_V[b] - y_V[a] > 0.95  # bf16 alone: B, by ~2u sum|x||w| (~0.97)
    assert y_V[b] - y_V[a] > 0.9 * 2 * screen.bound * x_D.norm()  # ~ the whole margin the bound gives
    assert argmax_rows(screen.logits(x_1D)) == [a] and screen.calls == 1


@needs_bf16
def test_a_row_the_fp32_rounding_could_decide_either_way_goes_to_the_fp32_head():
    """The kept tokens' fp32 logits are one float32 evaluation, the packed head's another: the
    screen answers only rows whose best beats its runner-up by more than two fp32 bounds (then
    every float32 evaluation has that argmax, strictly); a tie, or a gap of one rounding, is the
    fp32 head's to decide (ties: its first index). Also under a float32 matmul precision that
    lets torch compute "fp32" products in bf16 / tf32."""
    gen = torch.Generator().manual_seed(4)
    w_VD = torch.randn(256, 64, generator=gen)
    x_2D = torch.randn(2, 64, generator=gen)
    top = int((x_2D[0] @ w_VD.t()).argmax())
    screen = HeadScreen(w_VD)
    assert argmax_rows(screen.logits(x_2D)) == (x_2D @ w_VD.t()).argmax(-1).tolist() and screen.calls == 1
    tie = w_VD.clone()
    tie[3] = tie[top]  # an exact tie with the top token, at a lower index: the fp32 head takes 3
    near = w_VD.clone()
    near[3] = near[top]
    near[3, 5] = torch.nextafter(near[top, 5], near[top, 5] + torch.sign(x_2D[0, 5]))  # one ulp above
    for w in (tie, near):
        screen = HeadScreen(w)
        assert screen.logits(x_2D) is None and screen.calls == 0 and screen.undecided == 1
        assert screen.logits(x_2D[1:]) is not None  # the other row alone is decided
        assert (x_2D[:1] @ w.t()).argmax(-1).tolist() == [3]
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert HeadScreen(w_VD).logits(x_2D) is None
    finally:
        torch.set_float32_matmul_precision(before)


@needs_bf16
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


@needs_bf16
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


@needs_bf16
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
