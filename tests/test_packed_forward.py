"""ModelRunner.forward on a packed layout equals plain forwards of every row's own path,
with every attention kernel that runs on the CPU (sdpa, eager, flex, flash = cascade)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from lp.model.kv import PackedCache
from lp.lookahead.layout import build_layout
from lp.model.runner import ModelRunner
from tests.helpers import make_tiny_model

ATOL = 1e-4

PREFIX = [3, 8, 15, 4, 42, 7, 19, 23, 11, 60, 2, 5]  # longer than the sliding windows (8)
PENDING = [31, 32, 33]
LEVELS = [[41, 42, 43], [51, 52, 53, 54], [61, 62, 63, 64]]  # W=4, N=4, steady state
CANDIDATES = [(71, 72, 73), (71, 74, 75), (76, 77, 78)]

FAMILIES = [
    ("llama", "sdpa"),
    ("llama", "eager"),
    ("qwen2", "sdpa"),
    ("mistral", "sdpa"),
    ("mistral", "eager"),
    ("gemma3", "sdpa"),
    ("gemma3", "eager"),
    ("llama", "flex"),
    ("qwen2", "flex"),
    ("mistral", "flex"),
    ("gemma3", "flex"),
    ("llama", "flash"),
    ("qwen2", "flash"),
]


def _runner(tiny_factory, family, attn):
    """(reference model, runner): flex/flash runners get their own copy of the sdpa model, so
    the reference forwards keep transformers' own kernel."""
    if attn in ("flex", "flash"):
        model = tiny_factory(family, attn="sdpa")
        return model, ModelRunner(copy.deepcopy(model), attention=attn)
    model = tiny_factory(family, attn=attn)
    return model, ModelRunner(model)


def _path_tokens(layout, row):
    chain = []
    while row >= 0:
        chain.append(layout.tokens[row])
        row = layout.parents[row]
    return chain[::-1]


@torch.inference_mode()
def _plain_last_logits(model, tokens):
    ids = torch.tensor([tokens], dtype=torch.long)
    return model(input_ids=ids).logits[0, -1].float()


def _cache_kw(model):
    """The forward's cache argument: ``cache`` in transformers 5.24, ``past_key_values`` in 5.17
    (which takes ``cache=`` silently into **kwargs and fills nothing); as lp.model.runner."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def _prefill(model, prefix):
    cache = PackedCache(64)
    if prefix:
        ids = torch.tensor([prefix], dtype=torch.long)
        model(input_ids=ids, use_cache=True, **{_cache_kw(model): cache})
    return cache


def _compare_rows(model, layout, logits, prefix):
    assert logits.shape == (len(layout.keep), model.config.get_text_config().vocab_size)
    assert logits.dtype == torch.float32
    worst = 0.0
    for i, row in enumerate(layout.keep):
        ref = _plain_last_logits(model, prefix + _path_tokens(layout, row))
        err = (logits[i] - ref).abs().max().item()
        worst = max(worst, err)
        assert err < ATOL, f"row {row} (token {layout.tokens[row]}): max |diff| {err:.3g}"
    return worst


@pytest.mark.parametrize("family,attn", FAMILIES)
def test_packed_rows_match_separate_forwards(tiny_factory, family, attn):
    model, runner = _runner(tiny_factory, family, attn)
    assert runner.attention == attn
    layout = build_layout(PENDING, LEVELS, range(0, 4), CANDIDATES)
    cache = _prefill(model, PREFIX)
    logits = runner.forward(layout, cache)
    assert cache.get_seq_length() == len(PREFIX) + layout.num_rows
    _compare_rows(model, layout, logits, PREFIX)


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("gemma3", "sdpa"), ("gemma3", "eager")])
def test_packed_rows_first_step_and_partial_columns(tiny_factory, family, attn):
    model, runner = _runner(tiny_factory, family, attn)
    # first step: the whole prompt is pending, the cache is empty, warm-up window
    layout = build_layout(PREFIX + PENDING, [[41, 42, 43, 44, 45, 46]], range(0, 7), CANDIDATES[:2])
    logits = runner.forward(layout, PackedCache(64))
    _compare_rows(model, layout, logits, [])
    # a shard owning columns 1..2 of a two-level window, one candidate
    layout = build_layout(PENDING[:1], LEVELS[:2], range(1, 3), CANDIDATES[2:])
    logits = runner.forward(layout, _prefill(model, PREFIX))
    _compare_rows(model, layout, logits, PREFIX)


def test_packed_rows_are_distinct_predictions(tiny_factory):
    # guards the comparison itself: different paths really give different logits
    model = tiny_factory("llama")
    runner = ModelRunner(model)
    layout = build_layout(PENDING, LEVELS, range(0, 4), CANDIDATES)
    logits = runner.forward(layout, _prefill(model, PREFIX))
    r0 = layout.keep.index(layout.cand_rows[0][0])
    r1 = layout.keep.index(layout.cand_rows[1][0])  # same token, same position, same parent
    r2 = layout.keep.index(layout.cand_rows[2][0])
    assert torch.allclose(logits[r0], logits[r1], atol=1e-5)
    assert (logits[r0] - logits[r2]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "family,attn", [("llama", "sdpa"), ("llama", "eager"), ("gemma3", "sdpa"), ("llama", "flex"), ("llama", "flash")]
)
def test_compact_then_continue_matches_plain_forward(tiny_factory, family, attn):
    """Publishing a winner's rows by compaction leaves the cache of the accepted path."""
    model, runner = _runner(tiny_factory, family, attn)
    cache = _prefill(model, PREFIX)
    cache_len = cache.get_seq_length()
    layout = build_layout(PENDING, LEVELS, range(0, 4), CANDIDATES)
    runner.forward(layout, cache)
    winner, hits = 1, 2
    src = [cache_len + r for r in layout.cand_rows[winner][:hits]]
    runner.compact(cache, cache_len + len(PENDING), src)
    accepted = PREFIX + PENDING + list(CANDIDATES[winner][:hits])
    assert cache.get_seq_length() == len(accepted)

    # K/V equal a fresh prefill of the accepted path
    ref_cache = _prefill(model, accepted)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        n = len(accepted)
        torch.testing.assert_close(layer.keys[:, :, :n], ref_layer.keys[:, :, :n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(layer.values[:, :, :n], ref_layer.values[:, :, :n], atol=1e-5, rtol=1e-4)

    # and the next packed step is still exact
    nxt = build_layout([9], [[41, 42, 43], [51, 52, 53, 54], [61, 62, 63, 64]], range(0, 4), CANDIDATES[:1])
    logits = runner.forward(nxt, cache)
    _compare_rows(model, nxt, logits, accepted)


def test_crop_drops_rows(tiny_factory):
    model = tiny_factory("llama")
    cache = _prefill(model, PREFIX)
    ModelRunner.crop(cache, 5)
    assert cache.get_seq_length() == 5
    ref = _prefill(model, PREFIX[:5])
    torch.testing.assert_close(cache.layers[0].keys[:, :, :5], ref.layers[0].keys[:, :, :5])
    ModelRunner.crop(cache, 5)  # no-op
    assert cache.get_seq_length() == 5


def test_refuses_attention_without_custom_masks(tiny_factory):
    model = make_tiny_model("llama", attn="flex_attention")
    with pytest.raises(ValueError, match="flex_attention"):
        ModelRunner(model)
    model = make_tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        ModelRunner(model)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_mask_is_needed(tiny_factory, family):
    """Guards the sliding-window comparison: without the window the packed rows are wrong."""
    model = tiny_factory(family)
    runner = ModelRunner(model)
    assert runner.sliding_window == 8
    assert runner.mixed_layers == (family == "gemma3")
    runner.sliding_window = None  # pretend the model had no window
    layout = build_layout(PENDING, LEVELS, range(0, 4), CANDIDATES)
    logits = runner.forward(layout, _prefill(model, PREFIX))
    errs = [
        (logits[i] - _plain_last_logits(model, PREFIX + _path_tokens(layout, row))).abs().max().item()
        for i, row in enumerate(layout.keep)
    ]
    assert max(errs) > 1e-3, errs
