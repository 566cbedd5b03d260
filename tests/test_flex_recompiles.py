"""Compiled flex attention without recompiles (issue 37): the path ``model.attention=flex`` takes on
CUDA (``lp.kernels.attention.compiled_flex``: flex_attention under torch.compile, dynamic shapes), run
here on the CPU with the aot_eager backend (inductor's CPU flex template does not build with dynamic
shapes on torch 2.13; the guards that decide a recompile are dynamo's, the same for every backend).

Contract: after a warm-up (a prefill and a step over the cache: one graph per mask function), more
than 50 steps of changing draft trees and window shapes, keys crossing the BlockMask's 128-key blocks,
compile nothing new (dynamo's ``frames`` counter does not move), and the tokens equal transformers'
greedy ``generate``: for one sequence's lookahead steps (lp.model.runner's masks: Llama, Mistral's
sliding window, Gemma 3's mixed layers) and for the batched engine's packed steps over several
sequences (lp.engine.batch's mask).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine
from lp.kernels import attention
from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT, hf_greedy, lookahead


def compiles() -> int:
    return counters["frames"]["total"]


@pytest.fixture
def flex_compiled_on_cpu(monkeypatch):
    monkeypatch.setitem(attention.FLEX_COMPILE, "cpu", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    shapes = []  # (rows, keys) of every flex call
    forward = attention.flex_attention_forward

    def counted(module, query, key, value, *args, **kwargs):
        shapes.append((query.shape[2], key.shape[2]))
        return forward(module, query, key, value, *args, **kwargs)

    from transformers import AttentionInterface

    attention.register()
    AttentionInterface.register(attention.FLEX, counted)
    yield shapes
    AttentionInterface.register(attention.FLEX, forward)
    torch._dynamo.reset()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family,graphs", [("llama", 1), ("mistral", 1), ("gemma3", 2)])
def test_lookahead_steps_compile_flex_once(tiny_factory, flex_compiled_on_cpu, family, graphs):
    """One graph per mask function (Mistral's sliding window; Gemma 3's full and sliding layers: two)."""
    model = tiny_factory(family)
    runner = ModelRunner(model, attention="flex")
    warm = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=6, W=3, N=3, G=3)
    assert warm.output_ids == hf_greedy(model, REPETITIVE_PROMPT, 6)
    assert compiles() == graphs  # the compiled path ran: one graph for the prefill and the steps
    shapes, steps = flex_compiled_on_cpu, 0
    shapes.clear()
    # a 200-row prefill (2 query blocks), then trees of changing shapes over 20..290 keys (1-3 blocks)
    for prompt, cfg in [(_prompt(200, 1), dict(W=5, N=4, G=5)), (_prompt(40, 2), dict(W=2, N=3, G=2)),
                        (_prompt(20, 3), dict(W=4, N=2, G=6))]:
        res = lookahead(runner, prompt, max_new_tokens=60, **cfg)
        assert res.output_ids == hf_greedy(model, prompt, 60)
        steps += len(res.stats.records)
    assert steps >= 50 and len({q for q, _ in shapes}) >= 10 and max(k for _, k in shapes) > 256, (steps, shapes)
    assert compiles() == graphs, f"{compiles() - graphs} recompiles of flex over {steps} steps"


def test_batched_steps_compile_flex_once(tiny_factory, flex_compiled_on_cpu):
    model = tiny_factory("llama")
    engine = BatchEngine(ModelRunner(model, attention="flex"), kv_tokens=2048, block_size=8, max_batch=4)
    assert engine.runner.attention == "flex"

    def serve(prompts, cfg):
        ids = [engine.add(p, cfg) for p in prompts]
        outs, steps = {rid: [] for rid in ids}, 0
        while engine.has_work:
            steps += 1
            for o in engine.step():
                outs[o.request_id].extend(o.new_tokens)
        for rid, p in zip(ids, prompts):
            assert outs[rid] == hf_greedy(model, p, cfg.max_new_tokens)
        return steps

    serve([REPETITIVE_PROMPT, _prompt(9, 4)], DecodingConfig(max_new_tokens=4, W=3, N=3, G=3))
    assert compiles() == 1
    shapes = flex_compiled_on_cpu
    shapes.clear()
    steps = serve([_prompt(30, 5), REPETITIVE_PROMPT, _prompt(50, 6), _prompt(11, 7)],
                  DecodingConfig(max_new_tokens=50, W=3, N=3, G=3))
    steps += serve([_prompt(140, 8), _prompt(7, 9)], DecodingConfig(max_new_tokens=20, W=4, N=2, G=5))
    assert steps >= 50 and len({q for q, _ in shapes}) >= 10 and max(k for _, k in shapes) > 256, (steps, shapes)
    assert compiles() == 1, f"{compiles() - 1} recompiles of flex over {steps} batched steps"
