"""The cascade's prefill in pieces (issue 37): ``model.attention=flash`` (lp.kernels.attention's
cascade) computes its fp32 local block over at most ``LP_CASCADE_CHUNK_ROWS`` query rows at once, so a
long prompt's prefill never materializes [H, Q, Q] scores; each piece attends the whole prefix and
local block with its own rows of the tree mask.

Contract: with pieces of 7 rows, a 90-token prompt's prefill runs no local block of more than 7 rows,
and the generated tokens equal the one-piece run's and transformers' greedy ``generate``, token for
token (on the CPU: torch's CPU flash kernel for the prefix); the kernel's rows equal the one-piece
kernel's to rounding; a bad setting is a ValueError naming it.
"""

from __future__ import annotations

import pytest
import torch

from lp.kernels import attention
from lp.model.runner import ModelRunner
from tests.helpers import hf_greedy, lookahead


@pytest.fixture
def local_rows(monkeypatch):
    """The query rows of every local block the cascade computes."""
    rows, math = [], attention._math_attention

    def spy(q_BHQD, *args):
        rows.append(q_BHQD.shape[2])
        return math(q_BHQD, *args)

    monkeypatch.setattr(attention, "_math_attention", spy)
    return rows


def test_chunked_prefill_equals_the_one_piece_run_and_generate(tiny_factory, monkeypatch, local_rows):
    model = tiny_factory("llama")
    prompt = torch.randint(1, 128, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = ModelRunner(model, attention="flash")
    whole = lookahead(runner, prompt, max_new_tokens=30, W=3, N=3, G=3).output_ids
    assert max(local_rows) >= 90  # one piece: the prefill step's whole block (the prompt and its first drafts)
    local_rows.clear()
    monkeypatch.setenv("LP_CASCADE_CHUNK_ROWS", "7")
    chunked = lookahead(runner, prompt, max_new_tokens=30, W=3, N=3, G=3).output_ids
    assert max(local_rows) == 7 and local_rows.count(7) >= 2 * 12  # 13 pieces of the prefill in each layer
    assert chunked == whole == hf_greedy(model, prompt, 30)


@pytest.mark.parametrize("prefix", [0, 40])
def test_chunked_kernel_rows_equal_one_piece(monkeypatch, prefix):
    g = torch.Generator().manual_seed(prefix)
    q, h, h_kv, d = 23, 4, 2, 16
    query = torch.randn(1, h, q, d, generator=g)
    key, value = torch.randn(2, 1, h_kv, prefix + q, d, generator=g)
    tree_QQ = torch.rand(q, q, generator=g) < 0.5
    tree_QQ = (tree_QQ.tril(-1) | torch.eye(q, dtype=torch.bool))
    mask = torch.zeros(q, q).masked_fill(~tree_QQ, torch.finfo(torch.float32).min)[None, None]
    whole, _ = attention.cascade_attention_forward(None, query, key, value, mask, scaling=0.25)
    for rows in ("1", "5", "23", "100"):
        monkeypatch.setenv("LP_CASCADE_CHUNK_ROWS", rows)
        got, _ = attention.cascade_attention_forward(None, query, key, value, mask, scaling=0.25)
        torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", ["0", "-3", "x", ""])
def test_bad_chunk_setting_is_refused(monkeypatch, bad):
    monkeypatch.setenv("LP_CASCADE_CHUNK_ROWS", bad)
    with pytest.raises(ValueError, match="LP_CASCADE_CHUNK_ROWS must be an integer >= 1"):
        attention.cascade_chunk_rows()
