"""Logits processors along the draft tree: bias and penalties with each row's own history.

Contract: ``RowProcessor(cfg, prompt_ids, vocab_size, device)`` holds one generation's
token statistics on the device (which tokens the prompt and output hold, how often each
output token occurs); ``extend(tokens)`` adds committed output tokens; ``apply(logits_KV,
extra)`` returns the processed logits of K kept rows, where ``extra[k]`` lists the tokens
row k sees beyond the committed sequence (its uncommitted ancestors in the packed step and
the row's own token). A trie node's counts are therefore its prefix's counts, as if that
prefix had been generated. Vectorized over the rows: one scatter builds the [K, V] counts,
no Python loop per token.

Order and formulas follow transformers ``generate`` with the matching processors, so
greedy verification equals ``generate`` token for token:

    logit_bias          logits[t] += bias[t]                       (SequenceBiasLogitsProcessor,
                                                                    single-token sequences)
    repetition_penalty  seen t: logit < 0 ? logit * p : logit / p   (RepetitionPenaltyLogitsProcessor;
                                                                    seen = prompt + output + extra)
    frequency/presence  logits[t] -= f * count[t] + p * (count[t] > 0)   (OpenAI's formula; counts
                                                                    over output + extra tokens)

The sampling warpers (temperature, top_k, top_p, min_p) come after these, in lp.lookahead.sampling.

Legend: K kept rows, V vocabulary, D most extra tokens of a row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def wants_processing(cfg) -> bool:
    """Whether a DecodingConfig asks for any processor of this module."""
    return bool(cfg.logit_bias) or cfg.repetition_penalty != 1.0 or cfg.frequency_penalty != 0.0 \
        or cfg.presence_penalty != 0.0


class RowProcessor:
    def __init__(self, cfg, prompt_ids: Sequence[int], vocab_size: int, device: torch.device):
        self.vocab = vocab_size
        self.device = device
        self.rep = float(cfg.repetition_penalty)
        self.freq = float(cfg.frequency_penalty)
        self.pres = float(cfg.presence_penalty)
        self.bias_V = None
        if cfg.logit_bias:
            self.bias_V = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            ids = torch.tensor([int(t) for t in cfg.logit_bias], dtype=torch.long, device=device)
            vals = torch.tensor([float(v) for v in cfg.logit_bias.values()], dtype=torch.float32, device=device)
            self.bias_V[ids] = vals
        # one extra column (index V) absorbs the padding of ragged extra-token lists
        self.seen_V1 = torch.zeros(vocab_size + 1, dtype=torch.float32, device=device)
        self.count_V1 = torch.zeros(vocab_size + 1, dtype=torch.float32, device=device)
        if prompt_ids:
            self.seen_V1[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = 1.0

    def extend(self, tokens: Sequence[int]) -> None:
        """Committed output tokens (published this step)."""
        if not tokens:
            return
        idx = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        self.count_V1.index_add_(0, idx, torch.ones(len(tokens), dtype=torch.float32, device=self.device))
        self.seen_V1[idx] = 1.0

    def apply(self, logits_KV: torch.Tensor, extra: Sequence[Sequence[int]]) -> torch.Tensor:
        """Processed float32 logits [K, V]; ``extra[k]``: row k's tokens beyond the committed sequence."""
        K, V = logits_KV.shape
        assert len(extra) == K and V == self.vocab
        out_KV = logits_KV.float().clone()
        if self.bias_V is not None:
            out_KV += self.bias_V
        if self.rep == 1.0 and self.freq == 0.0 and self.pres == 0.0:
            return out_KV
        D = max((len(e) for e in extra), default=0)
        count_KV1 = self.count_V1.expand(K, V + 1).clone()
        if D:
            idx = [list(e) + [V] * (D - len(e)) for e in extra]
            idx_KD = torch.tensor(idx, dtype=torch.long).to(self.device, non_blocking=True)
            count_KV1.scatter_add_(1, idx_KD, torch.ones(K, D, dtype=torch.float32, device=self.device))
        count_KV = count_KV1[:, :V]
        if self.rep != 1.0:
            seen_KV = (self.seen_V1[:V] > 0) | (count_KV > 0)
            penalized_KV = torch.where(out_KV < 0, out_KV * self.rep, out_KV / self.rep)
            out_KV = torch.where(seen_KV, penalized_KV, out_KV)
        if self.freq != 0.0 or self.pres != 0.0:
            out_KV -= self.freq * count_KV + self.pres * (count_KV > 0).float()
        return out_KV


def row_extras(layout) -> list[list[int]]:
    """For each kept row of a packed step: the tokens it sees beyond the committed sequence
    (its ancestors below the pending rows, then itself), root first."""
    sk = layout.skeleton
    first = sk.num_pending  # rows before this are committed (the last of them is x)
    out = []
    for r in sk.keep:
        chain = []
        a = r
        while a >= first:
            chain.append(layout.tokens[a])
            a = sk.parents[a]
        assert a == first - 1, "every kept row is x or hangs below it"
        out.append(chain[::-1])
    return out
