"""The same logits settings for transformers ``generate`` (``decoding.mode=hf``, the tests' reference).

Contract: ``generate_kwargs(cfg, prompt_len)`` returns ``model.generate`` kwargs that apply cfg's
logit_bias, repetition penalty, min_p and OpenAI frequency/presence penalties as transformers'
own processors do; lp.lookahead.processors applies the same formulas to every row of a packed
step, so greedy lookahead equals ``generate`` with these kwargs token for token.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList


def generate_kwargs(cfg, prompt_len: int) -> dict:
    """``model.generate`` kwargs applying cfg's processors as transformers does (the OpenAI
    penalties through ``OpenAIPenaltyProcessor``)."""
    kw: dict = {}
    if cfg.repetition_penalty != 1.0:
        kw["repetition_penalty"] = cfg.repetition_penalty
    if cfg.logit_bias:
        kw["sequence_bias"] = {(int(t),): float(b) for t, b in cfg.logit_bias.items()}
    if cfg.do_sample and cfg.min_p > 0:
        kw["min_p"] = cfg.min_p
    if cfg.frequency_penalty or cfg.presence_penalty:
        kw["logits_processor"] = LogitsProcessorList(
            [OpenAIPenaltyProcessor(cfg.frequency_penalty, cfg.presence_penalty, prompt_len)])
    return kw


class OpenAIPenaltyProcessor(LogitsProcessor):
    """logit -= frequency x count + presence x [count > 0], counts over the generated tokens."""

    def __init__(self, frequency: float, presence: float, prompt_len: int):
        self.frequency, self.presence, self.prompt_len = frequency, presence, prompt_len

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
