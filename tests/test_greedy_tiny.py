"""Greedy lookahead decoding equals transformers' greedy generate on tiny random models."""

from __future__ import annotations

import pytest

from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT, hf_greedy, lookahead

MAX_NEW = 40
CONFIGS = [  # (W, N, G, prompt_pool)
    (1, 2, 1, True),
    (4, 3, 4, True),
    (4, 3, 4, False),
    (5, 4, 5, True),
    (5, 4, 5, False),
    (7, 4, 0, True),
    (3, 5, 8, True),
    (2, 6, 2, False),
]


def _multi_token_steps(result) -> int:
    return sum(result.stats.accept_hist[2:])


def _check_stats(result, max_new):
    hist = result.stats.accept_hist
    assert hist[0] == 0, "every step publishes at least one token"
    assert sum(k * c for k, c in enumerate(hist)) == len(result.output_ids) == max_new
    assert sum(hist) == result.stats.steps == len(result.stats.records)
    assert result.stats.new_tokens == len(result.output_ids)


@pytest.mark.parametrize(
    "family,attn",
    [
        ("llama", "sdpa"),
        ("llama", "eager"),
        ("qwen2", "sdpa"),
        ("mistral", "sdpa"),
        ("gemma3", "sdpa"),
        ("gemma3", "eager"),
    ],
)
def test_greedy_equals_generate(tiny_factory, family, attn):
    model = tiny_factory(family, attn=attn)
    ref = hf_greedy(model, REPETITIVE_PROMPT, MAX_NEW)
    assert len(ref) == MAX_NEW and len(set(ref)) > 5, f"degenerate reference output {ref}"
    runner = ModelRunner(model)
    multi = {}
    for W, N, G, pool in CONFIGS:
        res = lookahead(runner, REPETITIVE_PROMPT, W=W, N=N, G=G, prompt_pool=pool, max_new_tokens=MAX_NEW)
        assert res.output_ids == ref, f"(W,N,G,pool)={(W, N, G, pool)} hist={res.stats.accept_hist}"
        _check_stats(res, MAX_NEW)
        multi[(W, N, G, pool)] = _multi_token_steps(res)
        if G == 0:
            assert multi[(W, N, G, pool)] == 0, "no candidates: one token per step"
        if W == 1 and N == 2:
            assert len(res.stats.accept_hist) <= 3, "N=2 publishes at most 2 tokens"
    assert any(v > 0 for v in multi.values()), f"no step accepted a candidate: {multi}"


def test_greedy_short_prompts(tiny_factory):
    model = tiny_factory("llama")
    runner = ModelRunner(model)
    for prompt in ([7], [7, 7], [1, 2, 3]):
        ref = hf_greedy(model, prompt, 24)
        for W, N, G in [(5, 4, 5), (1, 3, 2)]:
            res = lookahead(runner, prompt, W=W, N=N, G=G, max_new_tokens=24)
            assert res.output_ids == ref, (prompt, W, N, G)


def test_greedy_decoder_is_reusable(tiny_factory):
    """One decoder instance, several requests: no state leaks between calls."""
    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder

    model = tiny_factory("qwen2")
    dec = LookaheadDecoder(ModelRunner(model), DecodingConfig(W=5, N=4, G=5, max_new_tokens=30))
    prompts = [REPETITIVE_PROMPT, [9, 8, 7, 6, 9, 8, 7, 6], REPETITIVE_PROMPT]
    outs = [dec.generate(p).output_ids for p in prompts]
    assert outs[0] == outs[2] == hf_greedy(model, REPETITIVE_PROMPT, 30)
    assert outs[1] == hf_greedy(model, prompts[1], 30)


def test_refuses_non_mask_attention(tiny_factory):
    from tests.helpers import make_tiny_model

    model = make_tiny_model("gemma3", attn="flex_attention")
    with pytest.raises(ValueError, match="sdpa"):
        ModelRunner(model)


def _tiny_gpt2(n_positions=32):
    """GPT-2: learned absolute position embeddings (an index per position, no extrapolation)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=n_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def test_learned_positions_greedy_equals_generate():
    model = _tiny_gpt2(n_positions=128)
    ref = hf_greedy(model, REPETITIVE_PROMPT, 30)
    for W, N, G in [(5, 4, 5), (3, 3, 2)]:
        res = lookahead(model, REPETITIVE_PROMPT, W=W, N=N, G=G, max_new_tokens=30)
        assert res.output_ids == ref, (W, N, G)


def test_learned_positions_request_filling_the_context():
    """A request that fits the context (prompt + max_new_tokens == n_positions) is accepted by
    the decoder's check, and plain generate serves it; lookahead must serve it too even though
    its window and candidate rows would sit at positions beyond the last one."""
    model = _tiny_gpt2(n_positions=32)
    prompt = REPETITIVE_PROMPT[:20]
    ref = hf_greedy(model, prompt, 12)
    res = lookahead(model, prompt, W=5, N=4, G=5, max_new_tokens=12)
    assert res.output_ids == ref
