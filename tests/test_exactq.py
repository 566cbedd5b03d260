"""GGUF's codes held as the file stores them (lp.kernels.exactq): exact, rows alone, near file size.

For each kind (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) random blocks, as a file holds them, are read by
lp.model.gguf.blocksq_of and packed by packq:

* widenq's float32 weights are gguf.dequantize's bit for bit (the reference transformers' GGUF
  loader uses), and the kernel on unit rows gives back those weights (its layout and arithmetic);
* the kernel's rows: any number of rows (1-20, every tile shape) gives each row the bits it gets
  alone; the product is the float64 product of those weights up to float32 summation;
* the packed bytes are within 7% of the file's for every kind but Q5_0 / Q5_1 (their float32
  scale and offset per 32: 7 bits a weight against 5.5 / 6) and Q6_K as bytes (kind 8: 8.6 bits
  against 6.56), which also gives back a row's weights (``rows8``: a Q6_K embedding's lookup).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf_tiny import random_blocks

KINDS = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# (format, exactq kind): Q6_K both as a nibble and two bit planes (7) and as bytes (8: what it runs on)
CASES = [(kind, None) for kind in KINDS] + [("Q6_K", 7)]


@pytest.fixture(scope="module")
def ext():
    from lp.kernels.exact4 import extension

    return extension()


@pytest.mark.parametrize("kind,kid", CASES, ids=[f"{k}-{i}" if i else k for k, i in CASES])
def test_exactq_is_dequantize_bit_for_bit_and_rows_alone(kind, kid, ext):
    import gguf

    from lp.kernels.exactq import KINDS as IDS
    from lp.kernels.exactq import mmq, packq, rows8, widenq
    from lp.model.gguf import blocksq_of

    IDS = {**IDS, kind: kid or IDS[kind]}

    rng = np.random.default_rng(7)
    for n, k in ((13, 512), (40, 768)):  # 13: a padded group of outputs
        raw = random_blocks(kind, n, k, 0.05, rng)
        ref = np.ascontiguousarray(gguf.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType[kind]).reshape(n, k),
                                   dtype=np.float32)
        parts = blocksq_of(raw, kind, n, k)
        w = widenq(IDS[kind], parts)
        assert torch.equal(w.view(torch.int32), torch.from_numpy(ref).view(torch.int32)), kind
        p = packq(IDS[kind], parts)
        unit = torch.eye(k)[:: max(1, k // 97)]
        assert torch.equal(mmq(unit, p, n, IDS[kind]), w[:, :: max(1, k // 97)].t())
        if IDS[kind] == 8:  # a Q6_K embedding's rows, read back from the packed entries
            ids = torch.tensor([[0, n - 1], [5, 5], [n // 2, 1]])
            assert torch.equal(rows8(p, ids, k).view(torch.int32), w[ids].view(torch.int32))
        x = torch.randn(20, k, generator=torch.Generator().manual_seed(n))
        alone = torch.cat([mmq(x[i:i + 1], p, n, IDS[kind]) for i in range(20)])
        for m in (2, 3, 5, 8, 9, 20):
            assert torch.equal(mmq(x[:m], p, n, IDS[kind]), alone[:m]), (kind, m)
        torch.testing.assert_close(alone.double(), x.double() @ w.double().t(), rtol=0, atol=2e-5)
        file_bytes = raw.size
        if n % 8 == 0:
            ratio = p.numel() / file_bytes
            assert ratio < (1.35 if IDS[kind] == 8 else 1.3 if kind in ("Q5_0", "Q5_1") else 1.07), (kind, ratio)


def test_exactq_linear_takes_siblings_of_one_kind_only(ext):
    from lp.kernels.exactq import KINDS as IDS
    from lp.kernels.exactq import ExactQLinear, widenq
    from lp.model.gguf import blocksq_of

    rng = np.random.default_rng(3)
    lins = []
    for kind in ("Q6_K", "Q6_K", "Q5_K"):
        lin = torch.nn.Linear(512, 16, bias=False)
        lin._lp_blocksq = (IDS[kind], blocksq_of(random_blocks(kind, 16, 512, 0.05, rng), kind, 16, 512))
        lins.append(lin)
    assert ExactQLinear.of(lins) is None  # Q6_K with Q5_K: one packed kind per module
    fused = ExactQLinear.of(lins[:2])
    assert fused is not None and fused.splits == [16, 16]
    x = torch.randn(3, 512)
    w = torch.cat([widenq(*lin._lp_blocksq) for lin in lins[:2]])
    torch.testing.assert_close(fused(x).double(), x.double() @ w.double().t(), rtol=0, atol=2e-5)


def test_a_q6_k_head_is_screened_exactly(ext):
    """A Q6_K LM head (QBlockHead: exactq's kind 8) gets the greedy int8 screen: its finite
    entries are the exact head's logits bit for bit, its argmax the exact head's, and it keeps few
    tokens; the embedding's rows read from the same bytes are the file's weights."""
    from lp.kernels.exact4 import BlockEmbedding
    from lp.kernels.exactq import QBlockHead, QParts, widenq
    from lp.model.gguf import blocksq_of

    if not ext.vnni():
        pytest.skip("the screen runs on AVX-512 VNNI")
    rng = np.random.default_rng(3)
    v, k = 1003, 512
    raw = random_blocks("Q6_K", v, k, 0.05, rng)
    parts = blocksq_of(raw, "Q6_K", v, k)
    head = QBlockHead(QParts(8, parts))
    assert head.h8 is not None and head.h8.screen is not None
    w = widenq(8, parts)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1)) * 3
    exact = head.h8.logits(x)
    assert torch.equal(exact, torch.cat([head.h8.logits(x[i:i + 1]) for i in range(6)]))
    torch.testing.assert_close(exact.double(), x.double() @ w.double().t(), rtol=0, atol=1e-4)
    got = head.h8.argmax_logits(x)
    assert head.h8.screened == 1
    kept = torch.isfinite(got)
    assert torch.equal(got[kept], exact[kept]) and torch.equal(got.argmax(-1), exact.argmax(-1))
    assert kept.sum(-1).max() < v // 4, kept.sum(-1)
    emb = BlockEmbedding(head)
    assert torch.equal(emb(torch.tensor([[0, 7, v - 1]])), w[[0, 7, v - 1]][None])
