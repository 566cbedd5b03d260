"""model.fused (lp.kernels.fused): an exact4 Llama's decoder stack in two C++ calls a layer. It is
kept only where it equals the model's own forward bit for bit, and decoding on it equals
transformers generate on the converted model: one sequence with drafts and a window, and a
batch of sequences on the paged cache."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from lp.config import DecodingConfig, ModelConfig
from lp.engine.decoder import LookaheadDecoder
from lp.kernels import fused as fused_stack
from lp.model.quant import quantize
from lp.model.kv import PackedCache
from lp.model.runner import ModelRunner
from tests.helpers import BATCH_PROMPTS, REPETITIVE_PROMPT, batch_outputs, hf_greedy
from tests.test_exact4 import to_q4_blocks

pytestmark = [pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="x86 CPU kernels"),
              pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ninja") is None,
                                 reason="the exact4 kernel is built with g++ and ninja")]


@pytest.fixture(scope="module")
def q4_llama(tiny_factory):
    """A tiny Llama (head size 32, as the fused rotation needs) whose linears are 4-bit blocks, converted
    (exact4's float kernels with AVX-512; lp.kernels.idot's float product on an AVX2-only CPU)."""
    from lp.kernels import exact4, idot

    if not exact4.extension().avx512() and not idot.available():
        pytest.skip("fused layers run on the AVX-512 exact4 build or on idot's products (AVX2)")
    model = to_q4_blocks(copy.deepcopy(tiny_factory("llama", head_dim=32, seed=1)))
    assert quantize(model, "exact4") == "exact4"
    return model


class _Counting:
    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.stack(*args, **kwargs)


def test_fused_steps_equal_generate_one_sequence_and_a_batch(q4_llama):
    model = q4_llama
    runner = ModelRunner(model)
    assert runner.fused is not None, runner.fused_why
    count = _Counting(runner.fused)
    runner.fused = count
    cfg = DecodingConfig(max_new_tokens=40, drafts="suffix", draft_budget="all", max_draft_rows=12, W=2, N=3, G=3,
                         window_policy="always")
    ref = hf_greedy(model, REPETITIVE_PROMPT, 40)
    res = LookaheadDecoder(runner, cfg).generate(REPETITIVE_PROMPT)
    assert res.output_ids == ref and res.stats.compression_ratio > 1.0
    assert count.calls == res.stats.steps  # every forward (the prefill one of them) ran fused
    count.calls = 0
    assert batch_outputs(runner, cfg) == [hf_greedy(model, p, 40) for p in BATCH_PROMPTS]
    # every batched step but the first (which allocates the paged pool) ran the whole stack as one
    # decoder_paged call
    assert count.calls > 1 and count.stack.paged_calls == count.calls - 1, (count.calls, count.stack.paged_calls)


def test_a_stack_that_differs_is_refused(q4_llama):
    """agrees() compares logits and cached keys and values: a layer's eps changed, or its rotation
    turned off, shows; model.fused=off keeps the modules; =on where it cannot apply is an error."""
    model = q4_llama
    runner = ModelRunner(model)
    stack, why = fused_stack.build(model)
    assert stack is not None and why == ""
    assert fused_stack.agrees(model, stack, runner._check_run, lambda: PackedCache(16))
    layer = stack.layers[-1]
    layer.eps2 *= 4
    assert not fused_stack.agrees(model, stack, runner._check_run, lambda: PackedCache(16))
    layer.eps2 /= 4
    ones = torch.ones_like(model.model.rotary_emb(torch.zeros(1, 1, 1), torch.zeros(1, 1, dtype=torch.long))[0])
    rotary = model.model.rotary_emb
    stack.base = type("Base", (), {"embed_tokens": model.model.embed_tokens, "norm": model.model.norm,
                                   "rotary_emb": staticmethod(lambda h, pos: (ones.expand(1, pos.shape[1], -1),
                                                                              0 * ones.expand(1, pos.shape[1], -1)))})()
    assert not fused_stack.agrees(model, stack, runner._check_run, lambda: PackedCache(16))
    stack.base = model.model
    assert rotary is model.model.rotary_emb and fused_stack.agrees(model, stack, runner._check_run, lambda: PackedCache(16))
    assert ModelRunner(model, fused="off").fused is None


def test_where_it_does_not_apply(tiny_factory, q4_llama):
    dense = tiny_factory("llama", head_dim=32, seed=1)
    runner = ModelRunner(dense)
    assert runner.fused is None and "exact4" in runner.fused_why
    with pytest.raises(ValueError, match="model.fused=on"):
        ModelRunner(dense, fused="on")
    with pytest.raises(ValueError, match="model.fused must be"):
        ModelRunner(dense, fused="yes")
    with pytest.raises(ValueError, match="model.fused must be auto, on or off"):
        ModelConfig(fused="maybe").validate()
    hooked = copy.deepcopy(q4_llama)
    hooked.model.layers[1].mlp.register_forward_hook(lambda m, i, o: o * 2)
    stack, why = fused_stack.build(hooked)
    assert stack is None and "hooks" in why
    narrow = to_q4_blocks(copy.deepcopy(tiny_factory("llama", seed=1)))  # head size 16
    quantize(narrow, "exact4")
    layers, why = fused_stack._plan(narrow)
    assert not layers and "head size" in why  # not the C++ layers: lp's loop over the modules instead
    stack, why = fused_stack.build(narrow)
    assert isinstance(stack, fused_stack.LayerLoop) and why == ""


def test_a_refused_cpp_stack_falls_back_to_the_layer_loop(q4_llama, monkeypatch):
    """A C++ stack that differs from the model's forward (here: a layer's eps changed) gives way to
    lp's loop over the layers' modules, which is still checked and kept."""
    model = copy.deepcopy(q4_llama)
    model.__dict__.pop("_lp_fused_agrees", None)
    plan = fused_stack._plan

    def skewed(m):
        layers, why = plan(m)
        layers[-1].eps2 *= 4
        return layers, why

    monkeypatch.setattr(fused_stack, "_plan", skewed)
    runner = ModelRunner(model)
    assert isinstance(runner.fused, fused_stack.LayerLoop), runner.fused_why
    assert LookaheadDecoder(runner, DecodingConfig(max_new_tokens=12)).generate(REPETITIVE_PROMPT).output_ids == \
        hf_greedy(model, REPETITIVE_PROMPT, 12)
