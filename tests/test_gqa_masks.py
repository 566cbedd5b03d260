"""No float mask with GQA on the fast kernels (issue 37): on CUDA, torch's sdpa with a float
(additive) ``attn_mask`` and grouped K/V heads (``enable_gqa`` or fewer K/V heads than query heads)
takes neither flash (no mask) nor mem-efficient (no GQA) but the math kernel.

Contract checked: on every attention path a CUDA run takes (``model.attention=auto``: the cascade
``flash`` with flash-attn, ``flex`` without; the static-shape / CUDA-graph runner's dense sdpa; the
batched engine's flex for a flash runner and its paged sdpa, ``lp::paged_attention``), run here on
the CPU on a tiny GQA model (4 query heads, 2 K/V heads), no call of
``torch.nn.functional.scaled_dot_product_attention`` gets a floating-point mask together with
grouped heads, and the tokens equal transformers' greedy ``generate``. The CPU's own choice (only
2-8 masked rows fold, ``FOLD_MEASURED``) is switched off to run the CUDA choice.
"""

from __future__ import annotations

import pytest
import torch

from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine
from lp.engine.decoder import LookaheadDecoder
from lp.kernels import attention
from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT, hf_greedy

CUDA = torch.device("cuda")  # a device object only: nothing runs on it
NEW = 12
CFG = dict(max_new_tokens=NEW, W=3, N=3, G=3)
PROMPTS = [REPETITIVE_PROMPT, [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], list(range(20, 50))]


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every sdpa call: (query heads, key heads, mask dtype or None, enable_gqa)."""
    real, calls = torch.nn.functional.scaled_dot_product_attention, []

    def recorded(query, key, value, attn_mask=None, *args, enable_gqa=False, **kwargs):
        calls.append((query.shape[-3], key.shape[-3], None if attn_mask is None else attn_mask.dtype, enable_gqa))
        return real(query, key, value, attn_mask, *args, enable_gqa=enable_gqa, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    # the CUDA path: masked GQA calls fold whatever their rows, no C++ op (CPU-only)
    monkeypatch.setattr(attention, "FOLD_MEASURED", set())
    monkeypatch.setattr(attention, "_NATIVE", None)
    monkeypatch.setattr(attention, "native_attention", lambda: None)
    return calls


def _float_gqa(calls) -> list:
    return [c for c in calls if c[2] is not None and c[2].is_floating_point and (c[3] or c[0] != c[1])]


def _batched(runner, prompts, **engine_kw) -> list[list[int]]:
    engine = BatchEngine(runner, kv_tokens=1024, block_size=8, max_batch=4, **engine_kw)
    ids = [engine.add(p, DecodingConfig(**CFG)) for p in prompts]
    outs = {rid: [] for rid in ids}
    while engine.has_work:
        for o in engine.step():
            outs[o.request_id].extend(o.new_tokens)
    return [outs[rid] for rid in ids]


@pytest.mark.parametrize("kernel", ["flash", "flex", "static"])
def test_one_sequence_cuda_kernels_pass_no_float_mask_with_gqa(tiny_factory, sdpa_calls, kernel):
    """auto on CUDA: flash (the cascade: flash-attn's prefix, its local block in plain torch), flex
    (a BlockMask), or with CUDA graphs the static runner's dense sdpa (transformers repeats the
    K/V heads when a mask is passed)."""
    model = tiny_factory("llama")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    if kernel == "static":
        runner = ModelRunner(model, attention="sdpa", static_shapes=True)
    else:
        runner = ModelRunner(model, attention=kernel)
    expected = [hf_greedy(model, p, NEW) for p in PROMPTS[:2]]
    sdpa_calls.clear()  # generate's own calls (no mask)
    for prompt, want in zip(PROMPTS[:2], expected):
        assert LookaheadDecoder(runner, DecodingConfig(**CFG)).generate(list(prompt)).output_ids == want
    if kernel == "static":
        assert any(c[2] is not None for c in sdpa_calls), "the dense path called sdpa with its mask"
    assert _float_gqa(sdpa_calls) == []


def test_batched_steps_on_the_cuda_path_pass_no_float_mask_with_gqa(tiny_factory, sdpa_calls, monkeypatch):
    """The batched engine on CUDA: a flash runner's batches on flex; an sdpa runner's through
    lp::paged_attention, whose masked calls (prefill chunks of 9+ rows, trees) fold the query heads
    onto their K/V head instead of ``enable_gqa`` with the float mask."""
    model = tiny_factory("llama")
    real_batch_attention = attention.batch_attention
    monkeypatch.setattr(attention, "batch_attention", lambda name, device: real_batch_attention(name, CUDA))
    expected = [hf_greedy(model, p, NEW) for p in PROMPTS]
    sdpa_calls.clear()  # generate's own calls (no mask)
    assert _batched(ModelRunner(model, attention="flash"), PROMPTS) == expected
    assert sdpa_calls == []  # flex: no sdpa at all
    assert _batched(ModelRunner(model, attention="sdpa"), PROMPTS, max_prefill_tokens=16) == expected
    masked = [c for c in sdpa_calls if c[2] is not None]
    assert masked, "the paged sdpa ran masked calls"
    assert _float_gqa(sdpa_calls) == []
