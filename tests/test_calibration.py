"""The draft budget's gain calibration (lp.drafts.budget.GainCalibration): literal counts, the
predicted gain of a verified trie, the budget pricing with it, and decoders / batch engines
that learn it from what verification accepted while staying equal to greedy generate; a factor
that fell so low that nothing drafts recovers over the steps that draft nothing (``idle``)."""

from __future__ import annotations

import pytest

from lp.config import DecodingConfig
from lp.drafts.budget import AcceptanceModel, GainCalibration, best_k
from lp.drafts.select import FORCED, Scored, TreeRequest, predicted_gain, select_tree, select_trees
from lp.engine.batch import BatchEngine
from lp.engine.decoder import LookaheadDecoder
from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT, hf_greedy

CPU = [(1, 0.055), (2, 0.085), (16, 0.130), (32, 0.184)]  # fp32 SmolLM2 on a 2-core CPU


def test_factor_is_realized_over_predicted_with_a_prior_decay_and_clamp():
    g = GainCalibration(weight=8.0, decay=1.0)
    assert g.factor() == 1.0
    g.observe(predicted=10.0, realized=2.0)
    assert g.factor() == pytest.approx((2 + 8) / (10 + 8))
    g.observe(predicted=0.0, realized=30.0)  # drafts beat the prediction: clamped at hi
    assert g.factor() == 1.5
    g = GainCalibration(weight=8.0, decay=0.5)
    g.observe(4.0, 0.0)
    g.observe(0.0, 4.0)  # the first step now counts half: predicted 2, realized 4
    assert (g.predicted, g.realized) == (2.0, 4.0)
    assert g.factor() == pytest.approx(12 / 10)
    g = GainCalibration(weight=1.0, lo=0.1)
    g.observe(1000.0, 0.0)
    assert g.factor() == 0.1


def test_predicted_gain_sums_the_verified_nodes_once():
    a = AcceptanceModel()
    drafts = [Scored((5, 6, 7), 6, 1.0), Scored((5, 6, 9), 6, 0.5), Scored((4,), 0, 1.0)]
    r6, r7, r8 = a.rate(6), a.rate(7), a.rate(8)
    # (5,), (5, 6) shared by both drafts (counted once, the best P), (5, 6, 7), (5, 6, 9), (4,)
    want = r6 + r6 * r7 + r6 * r7 * r8 + 0.5 * r6 * r7 * r8 + a.rate(0)
    assert predicted_gain(drafts, [(5, 6, 7), (5, 6, 9), (4,)], a) == pytest.approx(want)
    # the budget cut (5, 6, 9) to (5, 6): its last node was not verified
    assert predicted_gain(drafts, [(5, 6, 7), (4,)], a) == pytest.approx(want - 0.5 * r6 * r7 * r8)
    # filler chains (tokens no draft starts with) count nothing
    assert predicted_gain(drafts, [(5, 6, 7), (4,), (0, 0)], a) == pytest.approx(want - 0.5 * r6 * r7 * r8)
    assert predicted_gain(drafts, [], a) is None
    assert predicted_gain([Scored((3, 3), FORCED, 1.0)], [(3, 3)], a) is None


def test_the_budget_prices_nodes_at_the_calibrated_gain():
    a = AcceptanceModel()
    likely = [Scored((5, 6, 7, 8), 6, 1.0)]
    assert select_tree(likely, a, base=1, curve=CPU, cap=16) == [(5, 6, 7, 8)]
    assert select_tree(likely, a, base=1, curve=CPU, cap=16, gain=0.3) == []
    # per request in a batch: only the miscalibrated one stops drafting
    good = TreeRequest(likely, a, base=1, cap=16)
    bad = TreeRequest([Scored((4, 5, 6, 7), 6, 1.0)], a, base=1, cap=16, gain=0.1)
    assert select_trees([good, bad], CPU) == [[(5, 6, 7, 8)], []]
    assert select_trees([good, TreeRequest(bad.drafts, a, base=1, cap=16)], CPU) == [[(5, 6, 7, 8)], [(4, 5, 6, 7)]]


def _locked_out() -> GainCalibration:
    """40 drafting steps that realized a quarter of the predicted tokens: factor 0.32."""
    g = GainCalibration()
    for _ in range(40):
        g.observe(predicted=2.0, realized=0.5)
    assert round(g.factor(), 2) == 0.32
    return g


def test_a_locked_out_factor_recovers_over_steps_that_do_not_draft():
    """On the CPU curve a lone node pays when gain x P > t(2) / t(1) - 1 = 0.545: with P = 0.9,
    gain > 0.606. At 0.32 nothing drafts, so only steps that draft nothing can move the factor:
    each decays the evidence by idle_decay = 0.99 toward the prior 1.0; after 209 such steps the
    0.9 node still does not pay, after 210 it does."""
    a = AcceptanceModel(prior=(0.35, 0.25, 0.55, 0.65, 0.78, 0.9, 0.95))  # bucket 5 (m = 8..15) at 0.9
    node = [Scored((7,), 8, 1.0)]  # one draft token after an 8-token match: P = 0.9
    assert a.rate(8) == 0.9
    assert select_tree(node, a, base=1, curve=CPU, cap=16) == [(7,)]  # uncalibrated: it pays
    g = _locked_out()
    assert select_tree(node, a, base=1, curve=CPU, cap=16, gain=g.factor()) == []  # locked out
    assert best_k([0.9], base=1, curve=CPU, gain=0.606) == 0 and best_k([0.9], base=1, curve=CPU, gain=0.607) == 1
    for _ in range(209):
        g.idle()
    assert g.factor() == pytest.approx(0.6051, abs=1e-4)
    assert select_tree(node, a, base=1, curve=CPU, cap=16, gain=g.factor()) == []
    g.idle()
    assert g.factor() == pytest.approx(0.6070, abs=1e-4)
    assert select_tree(node, a, base=1, curve=CPU, cap=16, gain=g.factor()) == [(7,)]  # drafting resumes
    for _ in range(1000):
        g.idle()
    assert g.factor() == pytest.approx(1.0, abs=1e-4)  # the prior


def test_a_decoder_recovers_from_a_locked_out_calibration_and_stays_exact(tiny_factory):
    """A decoder handed a calibration locked out at 0.21 (40 steps that realized an eighth of
    the prediction) drafts nothing at first; its plain steps decay the factor toward 1.0 until
    the tiny model's suffix drafts pay again within the same 160-token run (measured: first at
    step 134; without the decay no step of the run drafts); the output stays greedy generate's."""
    model = tiny_factory("llama")
    n_new = 160
    ref = hf_greedy(model, REPETITIVE_PROMPT, n_new)
    cfg = DecodingConfig(max_new_tokens=n_new, drafts="suffix", max_draft_rows=12, window_policy="off")
    cal = GainCalibration()
    for _ in range(40):
        cal.observe(predicted=2.0, realized=0.25)
    before = cal.factor()
    assert round(before, 2) == 0.21
    res = LookaheadDecoder(ModelRunner(model), cfg, tq_curve=CPU, calibration=cal).generate(REPETITIVE_PROMPT)
    assert res.output_ids == ref
    rows = [rec.rows for rec in res.stats.records[1:]]  # the first step also prefills
    drafting = [i for i, r in enumerate(rows) if r > 1]
    assert drafting, f"drafting never resumed (factor {before:.3f} -> {cal.factor():.3f})"
    assert drafting[0] > 20, drafting  # it was locked out at first
    assert cal.factor() > before


def _draft_rows(res) -> int:
    return sum(rec.rows - 1 for rec in res.stats.records)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_decoder_learns_its_calibration_and_stays_exact(tiny_factory, family):
    model = tiny_factory(family)
    ref = hf_greedy(model, REPETITIVE_PROMPT, 48)
    cfg = DecodingConfig(max_new_tokens=48, drafts="suffix", max_draft_rows=12, window_policy="off")
    cal = GainCalibration(decay=1.0, idle_decay=1.0)  # plain sums (no step decays them)
    res = LookaheadDecoder(ModelRunner(model), cfg, tq_curve=CPU, calibration=cal).generate(REPETITIVE_PROMPT)
    assert res.output_ids == ref
    drafting = [rec for rec in res.stats.records if rec.rows > 1]
    assert drafting, "no step verified drafts: the test shows nothing"
    # realized: every drafting step's emitted tokens beyond the one a plain step gives
    assert cal.realized == sum(rec.emitted - 1 for rec in drafting)
    assert cal.predicted > 0
    # a calibration that saw drafts miss: the next run drafts less, with the same output
    low = GainCalibration(decay=1.0, idle_decay=1.0)
    low.observe(predicted=1000.0, realized=0.0)
    res_low = LookaheadDecoder(ModelRunner(model), cfg, tq_curve=CPU, calibration=low).generate(REPETITIVE_PROMPT)
    off = LookaheadDecoder(ModelRunner(model), DecodingConfig(**{**cfg.__dict__, "draft_calibration": False}),
                           tq_curve=CPU, calibration=low).generate(REPETITIVE_PROMPT)
    assert res_low.output_ids == off.output_ids == ref
    assert _draft_rows(res_low) < _draft_rows(off), (_draft_rows(res_low), _draft_rows(off))
    assert low.predicted >= 1000.0 and off.stats.steps > 0  # off neither reads nor feeds it


def test_a_batch_engine_calibrates_across_its_requests(tiny_factory):
    model = tiny_factory("llama")
    runner = ModelRunner(model)
    prompts = [REPETITIVE_PROMPT, REPETITIVE_PROMPT[3:], REPETITIVE_PROMPT[:20] * 2]
    cfg = DecodingConfig(max_new_tokens=32, drafts="suffix", max_draft_rows=12, window_policy="off")
    engine = BatchEngine(runner, kv_tokens=4096, max_batch=2, tq_curve=CPU)
    ids = [engine.add(p, cfg) for p in prompts]
    while engine.has_work:
        engine.step()
    for i, p in zip(ids, prompts):
        assert engine.result(i).output_ids == hf_greedy(model, p, 32)
    assert engine.calibration.predicted > 0  # every request's decoder fed the engine's one calibration
    dec = engine.check(prompts[0], cfg)[0]
    assert dec.calibration is engine.calibration
