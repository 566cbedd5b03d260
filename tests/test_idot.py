"""GGUF blocks on lp.kernels.idot (integer dot products with AVX-512 VNNI, float32 multiply-adds over the widened codes on AVX2): the arithmetic its docstring states, rows alone.

For every block format a file holds (random blocks, as lp.model.gguf reads them):

* unit rows give back gguf.dequantize's float32 weights bit for bit (the check ``IDotLinear.of``
  runs: layout, codes, scales);
* ``mmi`` equals ``reference`` (the stated arithmetic in torch float64) bit for bit for 1, 5 and 40
  rows (past the kernel's 32-row pass), and each row alone gets the bits it gets among the others;
* rows of any magnitude (1e-30 .. 1e30, zeros) stay within float32 rounding of the float64 product,
  and a row holding a NaN gives NaN outputs for that row only;
* the packed bytes are the file's bits within 6% (the float16 / 6-bit scales as the file holds them;
  Q4_0 / Q5_0 / Q8_0's offset C = -8 / -16 / -128 d formed in the kernel).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf_tiny import random_blocks

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "F16", "BF16")
# Q3_K: 3-bit codes and Q6_K's scales with AVX-512 (3.625 bits, the file's 3.4375; without it Q6_K's codes, 6.625);
# IQ4_XS's d per 256 and int8 scales per 32 (4.375 bits a weight, the file's 4.25); without AVX-512 IQ4 takes a byte a code
FILE_BITS = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625,
             "Q3_K": 3.625, "Q2_K": 3.25, "IQ4_NL": 4.5, "IQ4_XS": 4.375, "F16": 16.0, "BF16": 16.0}


@pytest.fixture(scope="module")
def idot():
    from lp.kernels import idot
    from lp.kernels.exact4 import extension

    if not extension().idot():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2 with FMA / F16C: lp.kernels.idot does not run here")
    return idot


def _blocks(fmt: str, n: int, k: int, rng) -> np.ndarray:
    """A file tensor's bytes [n, bytes of a row]: random blocks, or for F16 / BF16 normal floats."""
    if fmt in ("F16", "BF16"):
        w = torch.from_numpy(rng.normal(0.0, 0.05, (n, k)).astype(np.float32))
        return w.to(torch.float16 if fmt == "F16" else torch.bfloat16).view(torch.uint8).numpy()
    return random_blocks(fmt, n, k, 0.05, rng)


def _linear(raw: np.ndarray, fmt: str, n: int, k: int) -> torch.nn.Linear:
    """A meta linear holding the file blocks as lp.model.gguf sets them."""
    from lp.model.gguf import KEPT, KINDS, QKINDS, _read_blocks, blocksq_of

    lin = torch.nn.Linear(k, n, bias=False, device="meta")
    if KEPT[fmt][2] == 16:
        lin._lp_weight16 = _read_blocks(raw, fmt, n, k, 16)[0]
    elif fmt in KINDS or fmt in QKINDS:
        lin._lp_blocksq = (QKINDS.get(fmt, KINDS.get(fmt)), blocksq_of(raw, fmt, n, k))
    elif KEPT[fmt][2] == 8:
        lin._lp_blocks8 = _read_blocks(raw, fmt, n, k, 8)
    else:
        lin._lp_blocks = _read_blocks(raw, fmt, n, k, 4)
    return lin


@pytest.mark.parametrize("fmt", FORMATS)
def test_idot_is_its_stated_arithmetic_rows_alone(fmt, idot):
    import gguf

    if fmt in ("F16", "BF16") and not idot.half_kinds():
        pytest.skip("16-bit floats run on idot in its AVX2 build without AVX-512 (with it: exact4's Exact16Linear)")
    rng = np.random.default_rng(11)
    for n, k in ((13, 512), (40, 768)):  # 13: a padded group of 16 outputs
        raw = _blocks(fmt, n, k, rng)
        want_w = torch.from_numpy(np.ascontiguousarray(
            gguf.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType[fmt]).reshape(n, k), dtype=np.float32)) + 0.0
        # + 0.0: a zero weight's sign is not kept (IQ4_XS's zero scale gives 0 x value = -0.0 for a negative value;
        # D u + C gives +0.0, the same in every product)
        lin = _linear(raw, fmt, n, k)
        kind, parts = idot.codes_of(lin) or (None, None)
        if fmt.startswith("IQ4"):  # the file's nibbles where the build runs them (AVX-512), else a byte a code
            want = ((34 if fmt == "IQ4_NL" else 38),) if idot.iq4_kinds() else (31, 28)
            assert kind in want, (fmt, kind)
            if not idot.iq4_kinds():
                pytest.skip("IQ4 nibbles run in idot's AVX-512 build (here: Q8_0's kinds, covered by Q8_0)")
        if fmt == "Q3_K":  # 3-bit codes where the build runs them (AVX-512), else Q6_K's kind 25
            assert kind == (36 if idot.iq4_kinds() else 25), kind
            if not idot.iq4_kinds():
                pytest.skip("Q3_K's 3-bit codes run in idot's AVX-512 build (here: Q6_K's kind 25, covered by Q6_K)")
        if fmt == "Q2_K":  # 2-bit codes where the build runs them (AVX-512), else exact8x / float32 (no idot kind)
            if not idot.iq4_kinds():
                assert kind is None
                pytest.skip("Q2_K's 2-bit codes run in idot's AVX-512 build")
            assert kind == 37, kind
        assert kind in (*range(20, 26), 29, 30, 31, 32, 33, 34, 35, 36, 37, 38), kind  # the float16 / code-scale kinds for every real format
        assert torch.equal((idot.widened(kind, parts) + 0.0).view(torch.int32), want_w.view(torch.int32))
        cols = torch.tensor([0, 1, 31, 32, 200, 255, 256, k - 17, k - 1])  # the load's check widens these alone
        assert torch.equal((idot.widened(kind, parts, cols) + 0.0).view(torch.int32), want_w[:, cols].view(torch.int32))
        p = idot.packi(kind, parts)
        assert p.numel() * 8 / (n * k) <= FILE_BITS[fmt] * 1.06 * (-(-n // 16) * 16) / n, (fmt, p.numel())
        with pytest.MonkeyPatch.context() as mp:  # packed a slice of rows at a time: the same bytes
            mp.setattr(idot, "PACK_ROWS", 16)
            assert torch.equal(idot.packi(kind, parts), p)
        unit = torch.eye(k)[:: max(1, k // 97)]
        assert torch.equal(idot.mmi(unit, p, n, kind) + 0.0, want_w[:, :: max(1, k // 97)].t())
        g = torch.Generator().manual_seed(n)
        for m in (1, 5, 40):
            x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k // 32).repeat_interleave(32)
            y = idot.mmi(x, p, n, kind)
            assert torch.equal(y, idot.reference(x, kind, parts)), (fmt, m)
            alone = torch.cat([idot.mmi(x[i:i + 1], p, n, kind) for i in range(m)])
            assert torch.equal(alone, y)
        exact = x.double() @ want_w.double().T
        err = (y.double() - exact).abs() / (x.double().abs() @ want_w.double().abs().T)
        assert err.max() < 2e-6, err.max()  # float32-class: the bound of a float32 dot product's rounding
        assert idot.IDotLinear.of([lin]) is not None  # the module convert builds: packed, checked on unit rows


def test_idot_rows_of_any_magnitude_and_a_nan_row_alone(idot):
    rng = np.random.default_rng(3)
    n, k = 24, 512
    raw = random_blocks("Q5_0", n, k, 0.05, rng)
    kind, parts = idot.codes_of(_linear(raw, "Q5_0", n, k))
    p = idot.packi(kind, parts)
    w = idot.widened(kind, parts).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, k, generator=g)
    x[0] *= 1e-30
    x[1] *= 1e30
    x[2] = 0
    x[3, :32] = 0  # a zero block among others
    x[4, 100:110] = 1e-38  # subnormal-scale inputs beside normal ones
    x[5, 7] = float("nan")
    y = idot.mmi(x, p, n, kind)
    assert torch.isnan(y[5]).all() and torch.isfinite(y[:5]).all()
    assert torch.equal(y[2], torch.zeros(n))
    exact = x[:5].double() @ w.T
    bound = x[:5].double().abs() @ w.abs().T
    assert ((y[:5].double() - exact).abs() <= 2e-6 * bound).all()
    assert torch.equal(y[:5], idot.reference(x[:5], kind, parts))


def test_idot_errors_name_the_kind(idot):
    p = torch.zeros(1, 1, 10, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="kind must be 20..38"):
        idot.mmi(torch.zeros(1, 32), p, 16, 19)
    with pytest.raises(RuntimeError, match="packed"):
        idot.mmi(torch.zeros(1, 32), p, 16, 20)


@pytest.mark.parametrize("fmt", ("Q4_0", "Q4_1", "Q8_0", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "BF16"))
def test_idot_head_rows_and_products_are_the_files(fmt, idot):
    """``IBlockHead`` (a GGUF head and its tied embedding on idot, where the float kernels lack
    AVX-512): ``rows`` equal gguf.dequantize's rows (as floats: a Q6_K code of 32 gives +0.0 where
    d (q - 32) gives -0.0 for a negative d, as the product's unit rows do), the product equals ``reference``."""
    import gguf

    from lp.model.gguf import KEPT, QKINDS, QParts, _read_blocks, blocksq_of

    if fmt == "BF16" and not idot.half_kinds():
        pytest.skip("16-bit floats run on idot in its AVX2 build without AVX-512 (with it: exact4's 16-bit BlockHead)")
    if fmt == "Q2_K" and not idot.iq4_kinds():
        pytest.skip("Q2_K's 2-bit codes run in idot's AVX-512 build")
    rng = np.random.default_rng(5)
    n, k = 45, 512
    raw = _blocks(fmt, n, k, rng)
    want_w = torch.from_numpy(np.ascontiguousarray(
        gguf.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType[fmt]).reshape(n, k), dtype=np.float32))
    parts = (QParts(QKINDS[fmt], blocksq_of(raw, fmt, n, k)) if fmt in ("Q6_K", "Q3_K")
             else _read_blocks(raw, fmt, n, k, KEPT[fmt][2]))
    head = idot.IBlockHead.of(parts)
    assert head is not None
    with pytest.MonkeyPatch.context() as mp:  # built 16 rows at a time: the same packed bytes and row norms
        mp.setattr(idot, "HEAD_ROWS", 16)
        sliced = idot.IBlockHead.of(parts)
    assert torch.equal(sliced.p, head.p) and sliced.qkind == head.qkind
    assert (head.h8 is None) == (sliced.h8 is None)
    if head.h8 is not None:
        assert torch.equal(sliced.h8.wnorm, head.h8.wnorm)
    ids = torch.tensor([[0, 17, 44], [31, 16, 15]])
    assert torch.equal(head.rows(ids), want_w[ids] + 0.0)  # + 0.0: IQ4_XS's zero scale (test above)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    kind, cparts = idot.codes_of(_linear(raw, fmt, n, k))
    assert torch.equal(head(x), idot.reference(x, kind, cparts))
    with pytest.raises(RuntimeError, match="outside"):
        head.rows(torch.tensor([n]))


@pytest.mark.parametrize("digits", (1, 2))
@pytest.mark.parametrize("fmt", ("Q8_0", "Q6_K", "Q3_K", "Q2_K", "Q4_0", "IQ4_XS"))
def test_idot_head_screen_keeps_the_argmax_and_the_exact_logits(fmt, digits, idot, monkeypatch):
    """The idot head's greedy screen (both builds): every value it returns is the whole product's
    logit bit for bit, everything else -inf, and each row's argmax is the whole product's, also on
    rows built to sit near a tie (two tokens' weights a rounding apart) and on outlier rows."""
    from lp.kernels.exact4 import extension
    from lp.model.gguf import QKINDS, QParts, _read_blocks, blocksq_of

    if not extension().screeni_available():
        pytest.skip("screeni runs where idot does (AVX-512 VNNI, or AVX2 with FMA and F16C)")
    rng = np.random.default_rng(3)
    n, k = 1000, 512
    raw = random_blocks(fmt, n, k, 0.05, rng)
    parts = (QParts(QKINDS[fmt], blocksq_of(raw, fmt, n, k)) if fmt in ("Q6_K", "Q3_K")
             else _read_blocks(raw, fmt, n, k, 4 if fmt == "Q4_0" else 8))
    head = idot.IBlockHead.of(parts)
    assert head.h8 is not None
    monkeypatch.setattr(idot, "SCREEN_DIGITS", digits)  # x's top digits the AVX-512 screen takes (AVX2: one)
    g = torch.Generator().manual_seed(2)
    w = head.rows(torch.arange(n))
    x = torch.cat([torch.randn(6, k, generator=g),
                   w[[7, 500]] * 40,  # a row aligned with a token: one clear winner
                   torch.randn(1, k, generator=g) * torch.logspace(-3, 3, k).flip(0)])  # outliers
    full = head.logits(x)
    y = head.h8.argmax_logits(x)
    assert head.h8.screened == 1
    kept = torch.isfinite(y)
    assert kept.sum() < kept.numel() // 2  # it screens
    assert torch.equal(y[kept], full[kept])
    assert torch.equal(y.argmax(1), full.argmax(1))
    # near ties: x with x . w_a = x . w_b (in the reals), then perturbed by 1e-5 / 1e-7 of each element, which
    # x's top digits alone misorder on some rows (a bound of 1% of the stated one drops the true argmax on 5-15
    # of these 48 rows per format, in the AVX-512 build): each row alone (its own groups kept) and all together
    wd = w.double()
    for spread in (1e-5, 1e-7):
        a, b = torch.randint(0, n, (24,), generator=g), torch.randint(0, n, (24,), generator=g)
        x0, dlt = wd[a] + wd[b], wd[a] - wd[b]
        x = x0 - ((x0 * dlt).sum(1, keepdim=True) / (dlt * dlt).sum(1, keepdim=True)) * dlt
        x = x * (20 / (x * wd[a]).sum(1, keepdim=True))
        x = (x * (1 + spread * torch.randn(24, k, generator=g, dtype=torch.float64))).float()
        full = head.logits(x)
        for rows in [slice(i, i + 1) for i in range(24)] + [slice(0, 24)]:
            screened = head.h8.screened
            y = head.h8.argmax_logits(x[rows])
            assert head.h8.screened == screened + 1
            kept = torch.isfinite(y)
            assert torch.equal(y[kept], full[rows][kept])
            assert torch.equal(y.argmax(1), full[rows].argmax(1))
    assert torch.isnan(head.h8.argmax_logits(torch.full((1, k), float("nan")))).all()  # not finite: the whole product
