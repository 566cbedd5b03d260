"""The static-shape step behind CUDA graphs (lp.model.graphs), run uncaptured on the CPU: rows
padded to buckets, the cache written at device-tensor positions and read whole, the mask
buffer updated column by column. Greedy output must still equal transformers generate."""

from __future__ import annotations

import pytest

from lp import DecodingConfig, LookaheadDecoder, ModelRunner
from lp.model.graphs import bucket_for
from tests.helpers import REPETITIVE_PROMPT, hf_greedy


def test_buckets():
    assert [bucket_for(q) for q in (1, 8, 9, 33, 512)] == [8, 8, 16, 64, 512]
    assert bucket_for(513) is None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("W,N,G,prompt", [(5, 4, 5, "short"), (15, 5, 15, "short"), (3, 3, 2, "long"), (1, 2, 0, "long")])
def test_static_shapes_equal_generate(tiny_factory, family, W, N, G, prompt):
    model = tiny_factory(family)
    ids = REPETITIVE_PROMPT if prompt == "short" else (REPETITIVE_PROMPT * 6)[:120]  # long: eager prefill
    runner = ModelRunner(model, static_shapes=True)
    dec = LookaheadDecoder(runner, DecodingConfig(W=W, N=N, G=G, max_new_tokens=40))
    for _ in range(2):  # the second generation reuses the stepper's cache and buffers
        res = dec.generate(ids)
        assert res.output_ids == hf_greedy(model, ids, 40)
    assert sum(k * c for k, c in enumerate(res.stats.accept_hist)) == 40
    assert runner._static.inputs, "no step went through the bucketed path"
    assert runner._static.cache.layers[0].keys.shape[2] == runner._static.cache.capacity  # read whole


def test_cuda_graphs_need_cuda(tiny_factory):
    with pytest.raises(ValueError, match="cuda_graphs"):
        ModelRunner(tiny_factory("llama"), cuda_graphs=True)


def test_static_shapes_refuse_flex(tiny_factory):
    with pytest.raises(ValueError, match="cuda_graphs"):
        ModelRunner(tiny_factory("llama"), attention="flex", static_shapes=True)
