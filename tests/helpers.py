"""Helpers shared by the tests: tiny random causal LMs, reference generation, lookahead runs."""

from __future__ import annotations

import torch

from lp.config import DecodingConfig
from lp.decoding import LookaheadDecoder
from lp.model import ModelRunner

TINY_VOCAB = 128

# A prompt that repeats itself, so that prompt n-grams become accepted candidates.
REPETITIVE_PROMPT = [5, 17, 33, 9, 5, 17, 33, 9, 5, 17, 33, 9, 5, 17, 40, 3, 5, 17, 33, 9, 5, 17]


def _family_config(family: str, vocab: int, attn: str, max_positions: int, **overrides):
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        attn_implementation=attn,
        initializer_range=0.1,  # a peakier random model: fewer near-ties, more repetition
    )
    if family == "llama":
        cfg = dict(common)
        cls = LlamaConfig
    elif family == "qwen2":
        cfg = dict(common)
        cls = Qwen2Config
    elif family == "mistral":
        # Mistral applies one sliding window to every layer.
        cfg = dict(common, sliding_window=8, head_dim=16)
        cls = MistralConfig
    elif family == "gemma3":
        # Mixed sliding/full layers: the runner must hand a dict of masks to the model.
        cfg = dict(
            common,
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            initializer_range=0.02,  # gemma scales embeddings up: 0.1 makes it repeat one token
        )
        cls = Gemma3TextConfig
    else:
        raise KeyError(family)
    cfg.update(overrides)
    return cls(**cfg)


def make_tiny_model(
    family: str = "llama",
    attn: str = "sdpa",
    vocab: int = TINY_VOCAB,
    seed: int = 0,
    max_positions: int = 512,
    **overrides,
):
    """A small random float32 causal LM in eval mode, generation config without eos."""
    from transformers import AutoModelForCausalLM

    config = _family_config(family, vocab, attn, max_positions, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    assert model.config._attn_implementation == attn
    return model


def hf_greedy(model, prompt_ids, max_new_tokens, **kwargs) -> list[int]:
    """Reference: plain transformers greedy generation, new tokens only."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            **kwargs,
        )
    return out[0, ids.shape[1] :].tolist()


def lookahead(model_or_runner, prompt_ids, **cfg_kwargs):
    """Run LookaheadDecoder once; returns the GenerationResult."""
    gen_kwargs = {k: cfg_kwargs.pop(k) for k in ("eos_token_ids", "streamer", "tokenizer") if k in cfg_kwargs}
    runner = model_or_runner if isinstance(model_or_runner, ModelRunner) else ModelRunner(model_or_runner)
    cfg = DecodingConfig(**cfg_kwargs)
    return LookaheadDecoder(runner, cfg).generate(list(prompt_ids), **gen_kwargs)


def step_spans(result) -> list[tuple[int, int]]:
    """[start, stop) of the output tokens each step published."""
    spans, pos = [], 0
    for rec in result.stats.records:
        spans.append((pos, pos + rec.emitted))
        pos += rec.emitted
    assert pos == len(result.output_ids)
    return spans


