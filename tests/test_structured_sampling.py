"""Sampled lookahead under a grammar mask draws every token with exactly its masked probability.

The machinery of tests/test_sampling_dist.py (a tiny random model with a 12-token vocabulary,
the exact distribution of the first 3 new tokens enumerated by plain forwards, each prefix's
conditional tested, Bonferroni) with a toy llguidance vocabulary over the same 12 ids and a
regular grammar, ``\\((a|b|c|ab|cd)+,(d|e|f)+\\)``: the first token ``(`` is forced (the
grammar's forced draft, acceptance 1), the next ones are free among 5 or 6 of the 12 tokens.
The prompt repeats sentences of the language, so suffix drafts propose several tokens after
``(`` and the rows below the draft root decide what is emitted. The reference applies the same
llguidance mask to every enumerated prefix (nothing of lp's decoding is used).

Negative control: the mask applied to the committed path only (rows with no extra token), not to
the draft rows, must be rejected: tokens the grammar forbids are drawn below accepted drafts.
"""

from __future__ import annotations

from collections import Counter

import llguidance
import pytest

from lp.config import DecodingConfig
from lp.engine.decoder import LookaheadDecoder
from lp.grammar import matcher as gm
from lp.model.runner import ModelRunner
from tests.helpers import conditional_fit, exact_next_probs, fit_verdict, make_tiny_model

VOCAB = 12
NEW = 3
DRAWS = 600
BUG_DRAWS = 200
REGEX = r"\((a|b|c|ab|cd)+,(d|e|f)+\)"
TREE = dict(W=3, N=4, G=5, prompt_pool=True, drafts="suffix", draft_budget="all", max_draft_len=6,
            max_draft_rows=10, window_policy="with_candidates")


class ToyTokenizer:
    """Byte tokens for ids 0..11 (0: eos); greedy longest-match encoding."""

    eos_token_id = 0
    bos_token_id = None
    tokens = [b"<eos>", b"a", b"b", b"c", b"d", b"(", b")", b",", b"ab", b"cd", b"e", b"f"]
    special_token_ids = [0]

    def __call__(self, s):
        s = s if isinstance(s, bytes) else s.encode()
        out, i = [], 0
        while i < len(s):
            for n in (2, 1):
                if s[i:i + n] in self.tokens[1:]:
                    out.append(self.tokens.index(s[i:i + n]))
                    i += n
                    break
            else:
                raise ValueError(s)
        return out


@pytest.fixture(scope="module")
def setup():
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ToyTokenizer()), n_vocab=VOCAB)
    model = make_tiny_model("llama", vocab=VOCAB, initializer_range=0.2)
    prompt = ToyTokenizer()("(ab,d)(c,ef)(ab,e)(cd,f)(ab,d)(a,e)")
    return tok, model, ModelRunner(model), prompt, gm.compile_grammar("regex", REGEX)


class MaskEveryPrefix:
    """transformers-style processor for a batch of enumerated prefixes: each row gets the mask
    after its own new tokens (an unreachable prefix is left as is: no draw can reach it)."""

    def __init__(self, grammar, tok, prompt_len):
        self.grammar, self.tok, self.prompt_len = grammar, tok, prompt_len

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for b in range(input_ids.shape[0]):
            g = gm.RowGrammar(self.grammar, self.tok, VOCAB, "cpu", [0])
            bm, ok = g.masks([input_ids[b, self.prompt_len:].tolist()])
            if ok[0]:
                out[b] = out[b].masked_fill(~gm.unpack(bm, VOCAB, "cpu")[0], float("-inf"))
        return out


def draws(runner, prompt, grammar, tok, n):
    outs, hist = [], Counter()
    for i in range(n):
        cfg = DecodingConfig(max_new_tokens=NEW, do_sample=True, seed=i, grammar=grammar, **TREE)
        res = LookaheadDecoder(runner, cfg).generate(prompt, [0], tokenizer=tok)
        outs.append(res.output_ids)
        hist.update({k: c for k, c in enumerate(res.stats.accept_hist)})
    return outs, hist


def valid_prefix(grammar, tok, ids) -> bool:
    g = gm.RowGrammar(grammar, tok, VOCAB, "cpu", [0])
    return g.matcher.try_consume_tokens(list(ids)) == len(ids)


def test_sampled_lookahead_under_grammar_has_exact_conditionals(setup, monkeypatch):
    tok, model, runner, prompt, grammar = setup
    exact = exact_next_probs(model, prompt, NEW, processors=[MaskEveryPrefix(grammar, tok, len(prompt))])
    assert exact[()][5] == 1.0  # "(" is forced
    outs, hist = draws(runner, prompt, grammar, tok, DRAWS)
    assert all(len(d) == NEW and valid_prefix(grammar, tok, d) for d in outs)
    assert hist[2] + hist[3] > 0.3 * DRAWS, dict(hist)  # multi-token steps: draft rows decided tokens
    ok, report = fit_verdict(conditional_fit(outs, exact))
    assert ok, report

    # negative control: the mask on the committed path only (rows with no extra tokens)
    real = gm.RowGrammar.masks

    def committed_only(self, extra):
        bm, ok = real(self, extra)
        for k, e in enumerate(extra):
            if e:
                bm[k] = -1
        return bm, ok

    monkeypatch.setattr(gm.RowGrammar, "masks", committed_only)
    bad, _ = draws(runner, prompt, grammar, tok, BUG_DRAWS)
    invalid = [d for d in bad if not valid_prefix(grammar, tok, d)]
    # a draw ends where its matcher dead-ends (finish "length"): test the first two tokens
    ok, report = fit_verdict(conditional_fit([d[:2] for d in bad if len(d) >= 2], exact))
    assert invalid and not ok, f"the planted committed-path-only mask went unnoticed: {len(invalid)} invalid; {report}"
