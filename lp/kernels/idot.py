"""GGUF block formats on integer dot products: a one-row product at llama.cpp's instruction count,
still a row's own (issue 50, items 2 and 6).

Contract: ``IDotLinear.of(linears)`` takes sibling linears that hold one block format as lp.model.gguf
read it (``_lp_blocks``: Q4_0 / Q4_1; ``_lp_blocks8``: Q8_0; ``_lp_blocksq``: Q5_0 / Q5_1 / Q4_K /
Q5_K / Q6_K) or float32 weights that are exact 4-bit blocks (lp.kernels.exact4.encode: a Q4 GGUF
converted to a transformers folder runs as its file does) and returns a linear whose product ``mmi`` computes, per output and row, the float32
rounding of a double-precision sum over the input's blocks of exact products of the file's real
weights ``w = D u + C`` (u the block's unsigned code) and x held per 32 inputs as a 21- to 23-bit
integer X = round(x 2^e) (e from the block's largest |x|; the width per kind: ``INT32``). ``reference`` is that arithmetic in torch
(float64, bit for bit the kernel's for kinds 20-25); unit rows give the file's float32 weights
exactly (the check ``of`` runs). A row's output depends on that row only: the decode of the weights
is shared by the rows of a call, no sum is. Where the build has AVX-512 VNNI.

On AVX2 (no VNNI: an int8 digit's product takes vpmaddubsw + vpmaddwd, three digits a row) ``mmi``
widens the same packed codes to the file's float32 weights ``fma(D, u, C)`` in the kernel and sums
``w x`` in float32 multiply-adds, four partial sums per output (``reference_float``): at one row
0.6-1.0x the digits' time, at 8-16 rows 0.5-0.9x (a Q5_0 / Q8_0 / Q4_K / Q6_K product, AMD EPYC
Zen 3). The greedy head's screen (``IScreen``) stays on x's top int8 digit there; its bound covers
the float32 sums. The AVX-512 build's screen takes X's top digit too (``SCREEN_DIGITS``: 2 takes
X less its last digit, a bound ~2^7 tighter for twice the dots, measured 1.4x slower at 16 rows on
Gemma-3's head), on the file's codes themselves: a head's greedy rows need no second copy of its
weights. lp.model.gguf puts Q5_x / Q6_K heads here on AVX-512 too (exactq held a Q6_K head as bytes
with an int8 screen beside them, two bytes a weight: a 128,256 x 2048 head 522 -> 208 MiB, one greedy
row 9.2 ms against 9.6, 16 rows 42 against 28: bench.idot_head); Q8_0 / Q4_x heads stay on exact4's
int8 screen there (one row faster on SmolLM2's and Gemma-3's heads, at a second copy).

Why: the float kernels (exact4, exactq) widen each weight to float32 before the multiply-add: at one
row that decode is the cost (bench/results/gguf_formats/exactq_kernels.md: bound by instructions,
not memory). Here a 32-input block of 16 outputs is 8 code vectors and 24 ``vpdpbusd`` a row (the
three int8 digits of X), and the packed codes hold the file's bits (Q4_0 4.5 bits a weight, Q5_0 5.5,
Q4_K 4.75, Q6_K 6.6; scales float16 where the file's are).

Kinds (csrc ``IDot<CODE, SCALE>``): 29 Q4_0, 30 Q5_0, 31 Q8_0 (D float16, C = -8 / -16 / -128 D
formed in the kernel), 20 Q4_1, 21 Q5_1, 22 8-bit codes with D and C float16, 23 Q4_K, 24 Q5_K,
25 Q6_K (and Q3_K, as lp.model.gguf holds it), and 26 / 27 / 28 as 20 / 21 / 22 with float32 scales
(where a D or C is not a float16 value). In the AVX-512 build also 34 / 38: IQ4_NL / IQ4_XS as the
file's nibbles, each looked up in IQ4's sixteen int8 values (+ 128: one ``vpshufb`` a code vector)
and then Q8_0's arithmetic (C = -128 D), D float16 (34: IQ4_NL's d) or, for IQ4_XS, d (scale - 32) per
32 inputs as the file holds it (38: d float32 per 256 in the entry's header, the scale - 32 as an int8
per block; D = d sc formed exactly in the kernel; ``_factor`` recovers d and sc from the loader's
per-32 products; 35 holds D float32 per 32 where that fails), 4.5 / 4.375 (35: 5) bits a weight
(38 against 35: a 16384 x 4096 matrix at one row 1.47 / 1.77 ms against 1.65 / 1.97, min / median,
bit-equal results; 4 rows alike); lp.model.gguf reads both as 8-bit values, and
``codes_of`` takes the nibbles back where every value is one of IQ4's (elsewhere, and on AVX2, they
run as kinds 31 / 28, a byte a code). On SmolLM2's and Gemma-3's IQ4_XS files one served step went
7.8 -> 5.2 ms and 13.1 -> 10.0 ms (bench/results/gguf_formats/files.md). And 36: Q3_K as 2-bit codes
(2 x 64 bytes a block, bits 2h of byte 4 i + t of vector s holding u[4 (4 s + h) + t]) and one bit
plane, u = q + 4, with Q6_K's scales and C = -4 D (3.6 bits a weight, the file's 3.44; elsewhere Q3_K
runs as Q6_K's codes, kind 25, 6.6 bits): ``codes_of`` takes Q6_K parts whose codes all lie in
28..35 (lp.model.gguf reads Q3_K as such parts) as kind 36, the same weights. On a Llama-3.2-1B-shaped
Q3_K_M file (Q3_K q/k/o/gate/up) one served step went 29.4 -> 24.4 ms, llama.cpp's 29.9, and the
process 1307 -> 1075 MiB. And 37: Q2_K as those 2-bit codes alone with Q4_K's scales per 16 inputs
(a header d[16], nm[16] float32 a super-block; per block the 4-bit sc and m of each half as bytes),
w = u (d sc) + nm mn; lp.model.gguf reads Q2_K as exact8x's per-16 products D, C, which ``_factor``
factors back exactly (3.25 bits a weight, the file's 2.625; exact8x held 12): on a 1B-shaped Q2_K
file one served step went 47.4 -> 25.4 ms (llama.cpp 21.9), the process 1822 -> 990 MiB. On AVX2 also 32 / 33: 16-bit float weights (float16 /
bfloat16: a GGUF F16 / BF16 tensor, or a float32 weight whose every value is one, as a bf16 / fp16
checkpoint holds), 2 bytes a weight, widened in the kernel (exact) and summed as ``reference_float``
(with AVX-512 those run as exact4's ``Exact16Linear``). The greedy screen takes kinds 20-31, 34, 35.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from lp.kernels.exact4 import BlockHead, Exact4Linear, _code, _unit_rows, extension, staged, trim_heap
from lp.kernels.exactq import grouped_rows, scales16, widenq

GROUP, BLOCK = 16, 32
BITS = {20: 5.0, 21: 6.0, 22: 9.0, 23: 4.75, 24: 5.75, 25: 6.625, 26: 6.0, 27: 7.0, 28: 10.0, 29: 4.5, 30: 5.5, 31: 8.5,
        32: 16.0, 33: 16.0, 34: 4.5, 35: 5.0, 36: 3.625, 37: 3.25, 38: 4.375}
HALF = {32: torch.float16, 33: torch.bfloat16}  # the 16-bit kinds (AVX2 build)
OFFSET = {29: -8.0, 30: -16.0, 31: -128.0, 34: -128.0, 35: -128.0, 38: -128.0}  # C = OFFSET D: Q4_0, Q5_0, Q8_0, IQ4 hold D alone
# a nibble indexing IQ4's values (AVX-512 build): D float16 (34: IQ4_NL), float32 (35), IQ4_XS's d per 256 times an
# int8 scale per 32 (38: (u, sc int8 [N, K / 32], d float32 [N, K / 256]))
IQ4 = (34, 35, 38)
IQ4XS = 38
Q3K = 36  # Q3_K as 2-bit codes and a bit plane (AVX-512 build), Q6_K's scales, C = -4 D
Q2K = 37  # Q2_K as 2-bit codes (AVX-512 build), Q4_K's scales per 16 inputs: (u, sc, mn, d, nm), w = u (d sc) + nm mn
SIXK = {25: 32, 36: 4}  # the kinds with Q6_K's scales (an int8 scale per 16, d per 256): their centre k, C = -k D
# IQ4_NL / IQ4_XS's sixteen code values (gguf.quants.IQ4_NL.kvalues) + 128: what a kind-34 / 35 nibble stands for
IQ4_CODES = torch.tensor((1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241), dtype=torch.uint8)
_IQ4_INDEX = torch.full((256,), 255, dtype=torch.uint8)
_IQ4_INDEX[IQ4_CODES.long()] = torch.arange(16, dtype=torch.uint8)


def available() -> bool:
    """Whether ``mmi`` runs here (a build with AVX-512 VNNI and BW, or AVX2) and ``LP_IDOT`` is not ``0``
    (the float kernels instead: benchmarks, A/B runs)."""
    return os.environ.get("LP_IDOT", "1") != "0" and bool(extension().idot())


def mmi(x_MK: torch.Tensor, p: torch.Tensor, n: int, kind: int) -> torch.Tensor:
    """``x @ W.T`` [M, n] for float32 ``x`` [M, K] and W packed by ``packi``."""
    return torch.ops.lp_exact4.mmi(x_MK, p, n, kind)


def iq4_kinds() -> bool:
    """Whether the AVX-512 build's kinds run here: IQ4 nibbles (34, 35, 38), Q3_K's and Q2_K's 2-bit codes
    (36, 37) (elsewhere IQ4 takes the 8-bit kinds, a byte a code, Q3_K Q6_K's kind 25, Q2_K exact8x)."""
    return available() and bool(extension().idot_iq4())


def _iq4_nibbles(u: torch.Tensor) -> torch.Tensor | None:
    """The nibble [N, K] uint8 of 8-bit codes u (value + 128) that are all IQ4 values, else None."""
    if not iq4_kinds():
        return None
    table = _IQ4_INDEX.numpy()
    if (table[u[:1].numpy()] == 255).any():  # one row first: a Q8_0 tensor fails here, without a pass over the whole
        return None
    idx = table[u.contiguous().numpy()]  # numpy's uint8-indexed lookup: ~4x torch's (an int64 copy of the indices)
    return None if (idx == 255).any() else torch.from_numpy(idx)


def _factor(v: torch.Tensor, group: int = 16, lo: int = 0, hi: int = 15) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(f [N, S] float32, s [N, group S] float32 integers) with f s == v exactly in float32, s in lo..hi, for
    v [N, group S]: a K-quant's products d sc of a small integer sc and one d a super-block (Q2_K's D per 16,
    and its C with nm = -dmin: 0..15; IQ4_XS's d (scale - 32) per 32: -32..31), else None."""
    n, m = v.shape
    if m % group:
        return None
    vb = v.reshape(n, m // group, group)
    top = vb.gather(-1, vb.abs().argmax(-1, keepdim=True))  # the largest |v| of each super-block, signed
    f = torch.zeros_like(top)
    done = top == 0
    for cand in sorted((c for c in range(lo, hi + 1) if c), key=abs, reverse=True):
        fc = top / cand  # the scale of the largest: f = top / cand, exact where top = f cand
        q = torch.round(vb / fc)
        ok = (~done & ((q >= lo) & (q <= hi) & (fc * q == vb)).all(-1, keepdim=True))
        f = torch.where(ok, fc, f)
        done |= ok
        if bool(done.all()):
            break
    if not bool(done.all()):
        return None
    s = torch.where(f == 0, 0.0, torch.round(vb / torch.where(f == 0, 1.0, f)))
    return f[..., 0], s.reshape(n, m)


def _q2k(q: torch.Tensor, D: torch.Tensor, C: torch.Tensor) -> tuple[int, tuple] | None:
    """Kind 37's parts of exact8x's (q, D, C) where q is 2-bit (Q2_K) and D, C factor as d sc, nm mn
    (``_factor``), else None."""
    if not iq4_kinds() or q.dtype != torch.int8 or q.shape[1] % 256 or int(q.min()) < 0 or int(q.max()) > 3:
        return None
    dd, nn_ = _factor(D), _factor(C)
    if dd is None or nn_ is None:
        return None
    return Q2K, (q.view(torch.uint8), dd[1].to(torch.uint8), nn_[1].to(torch.uint8), dd[0], nn_[0])


def half_kinds() -> bool:
    """Whether 16-bit float weights run on idot here (kinds 32 / 33): its AVX2 build on a CPU whose
    exact4 float kernels lack AVX-512 (with AVX-512 they run as exact4's ``Exact16Linear``)."""
    return available() and bool(extension().idot_float()) and not extension().avx512()


def _f16(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.half().float(), t)) and bool(torch.isfinite(t.half()).all())


def codes_of(lin: nn.Module) -> tuple[int, tuple] | None:
    """(kind, (u uint8 [N, K], scales...)) of a linear's file blocks (module doc), else None.
    Scales: kinds 20-22 / 26-28 (D, C float32 [N, K / 32]); 23 / 24 (sc, mn uint8 [N, K / 32],
    d, nm float32 [N, K / 256]); 25 (sc int8 [N, K / 16], d float32 [N, K / 256]). Kinds 32 / 33
    (the AVX2 build): (w float16 / bfloat16 [N, K],)."""
    if half_kinds():
        from lp.kernels.exact4 import _weight16

        w16 = _weight16(lin) if isinstance(lin, nn.Linear) else None
        if w16 is not None and w16.dim() == 2 and not w16.shape[1] % BLOCK:
            return (33 if w16.dtype == torch.bfloat16 else 32), (w16,)
    q = staged(lin, "_lp_blocksq")
    if q is not None:
        kind, parts = q
        if kind == 4:
            u, D, C = parts
            return _legacy(21, 30, 27, u, D, C)
        if kind in (5, 6):
            return (23 if kind == 5 else 24), parts
        u = parts[0]  # 7, 8: Q6_K's parts; Q3_K's (lp.model.gguf.QKINDS) hold u = q + 32 in 28..35
        if iq4_kinds() and u.numel() and int(u.min()) >= 28 and int(u.max()) <= 35:
            return Q3K, (u - 28, *parts[1:])  # 3 bits a code, the same weights: (u - 28 - 4) D = (u - 32) D
        return 25, parts
    b8 = staged(lin, "_lp_blocks8")
    if b8 is not None:
        if len(b8) == 3:  # exact8x's (q, D, C) per 16: Q2_K's 2-bit codes are the one idot kind of these
            return _q2k(*b8)
        if len(b8) != 2:
            return None
        q8, d = b8
        u = q8.view(torch.uint8) ^ 0x80  # q + 128 as a byte (its sign bit flipped), no wider copy
        nib = _iq4_nibbles(u)  # IQ4_NL / IQ4_XS: the file's nibbles, 4 bits a code
        if nib is not None:
            if _f16(d):
                return 34, (nib, d, d * -128.0)
            xs = _factor(d, 8, -32, 31)  # IQ4_XS's d (scale - 32) per 32 as the file holds it: d per 256, int8 scales
            if xs is not None:
                return IQ4XS, (nib, xs[1].to(torch.int8), xs[0])
            return 35, (nib, d, d * -128.0)
        return _legacy(22, 31, 28, u, d, d * -128.0)
    if not isinstance(lin, nn.Linear) or lin.weight.dtype != torch.float32:
        return None
    code = _code(lin)  # a file's 4-bit blocks, or those a float32 weight holds exactly (exact4.encode)
    if code is None:
        return None
    q, d, c = code
    n = q.shape[0]
    q_NB16 = q.reshape(n, -1, 16)
    u = torch.cat([q_NB16 & 0x0F, q_NB16 >> 4], dim=2).reshape(n, -1).contiguous()
    return _legacy(20, 29, 26, u, d, c)


def _legacy(f16: int, d0: int, f32: int, u: torch.Tensor, D: torch.Tensor, C: torch.Tensor) -> tuple[int, tuple]:
    """The kind of (u, D, C) blocks: C = OFFSET D with D float16 values (Q4_0, Q5_0, Q8_0: D alone
    held), else D and C float16 values (Q4_1, Q5_1), else float32 ones."""
    if _f16(D) and torch.equal(C, D * OFFSET[d0]):
        return d0, (u, D, C)
    return (f16 if _f16(D) and _f16(C) else f32), (u, D, C)


def widened(kind: int, parts: tuple, cols: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights [N, K] (each one rounding of D u + C: gguf.dequantize's), or only the
    columns ``cols`` [N, len(cols)] (the same arithmetic a weight, without widening the matrix:
    ``IDotLinear.of``'s check at load)."""
    if cols is None:
        if kind in HALF:
            return parts[0].float()
        if kind in (23, 24):
            return widenq(5, parts)
        if kind == Q2K:
            u, sc, mn, d, nm = parts
            D16, C16 = d.repeat_interleave(16, dim=1) * sc.float(), nm.repeat_interleave(16, dim=1) * mn.float()
            return (u.float() * D16.repeat_interleave(16, dim=1) + C16.repeat_interleave(16, dim=1))
        if kind == 25:
            return widenq(7, parts)
        if kind == Q3K:
            return widenq(7, (parts[0] + 28, *parts[1:]))
        u, D, C = parts
        n, k = u.shape
        if kind in IQ4:  # (v + 128) D needs up to 25 bits (IQ4_XS's 17-bit D): in float64, one rounding
            D, C = _dc(kind, parts)
            w = _u(kind, u).double().reshape(n, -1, BLOCK) * D.double()[..., None] + C.double()[..., None]
            return w.float().reshape(n, k)
        return (u.float().reshape(n, -1, BLOCK) * D[..., None] + C[..., None]).reshape(n, k)
    k = parts[0].shape[1]

    def at(t: torch.Tensor) -> torch.Tensor:  # a per-block tensor [N, K / size] at the columns' blocks
        return t[:, cols // (k // t.shape[1])]

    u = _u(kind, parts[0][:, cols])
    if kind in HALF:
        return u.float()
    if kind == Q2K:  # per 16: D = d sc, C = nm mn, then u D + C
        _, sc, mn, d, nm = parts
        return u.float() * (at(d) * at(sc).float()) + at(nm) * at(mn).float()
    if kind in (23, 24):  # widenq(5): D = d sc, C = nm mn per 32, then u D + C
        _, sc, mn, d, nm = parts
        return u.float() * (at(d) * at(sc).float()) + at(nm) * at(mn).float()
    if kind in SIXK:  # widenq(7): (u - 32) D16; Q3_K (u - 4) D16
        return (u.float() - SIXK[kind]) * at(scales16(*parts[1:]))
    if kind in IQ4:
        D, C = _dc(kind, parts)
        return (u.double() * at(D).double() + at(C).double()).float()
    return u.float() * at(parts[1]) + at(parts[2])


def _dc(kind: int, parts: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, C) float32 [N, K / 32] of a per-32 kind's parts (kind 38: D = d sc, exact, C = -128 D)."""
    if kind == IQ4XS:
        _, sc, d = parts
        D = d.repeat_interleave(8, dim=1) * sc.float()
        return D, D * -128.0
    return parts[1], parts[2]


def _u(kind: int, u: torch.Tensor) -> torch.Tensor:
    """The unsigned codes the kernel multiplies: an IQ4 nibble's value + 128, else the codes as held."""
    return IQ4_CODES[u.long()] if kind in IQ4 else u


def _scales(kind: int, parts: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, C) float64 per (output, 16 inputs) [N, K / 16], exact."""
    if kind in (23, 24):
        _, sc, mn, d, nm = parts
        D = d.double().repeat_interleave(8, dim=1) * sc.double()
        C = nm.double().repeat_interleave(8, dim=1) * mn.double()
        return D.repeat_interleave(2, dim=1), C.repeat_interleave(2, dim=1)
    if kind == Q2K:
        _, sc, mn, d, nm = parts
        return d.double().repeat_interleave(16, dim=1) * sc.double(), nm.double().repeat_interleave(16, dim=1) * mn.double()
    if kind in SIXK:
        _, sc, d = parts
        D = d.double().repeat_interleave(16, dim=1) * sc.double()
        return D, -float(SIXK[kind]) * D
    D, C = _dc(kind, parts)
    return D.double().repeat_interleave(2, dim=1), C.double().repeat_interleave(2, dim=1)


def reference(x_MK: torch.Tensor, kind: int, parts: tuple) -> torch.Tensor:
    """``mmi``'s arithmetic on this build: ``reference_float`` on AVX2, else ``reference_digits``."""
    if extension().idot_float():
        return reference_float(x_MK, kind, parts)
    return reference_digits(x_MK, kind, parts)


def reference_float(x_MK: torch.Tensor, kind: int, parts: tuple) -> torch.Tensor:
    """The AVX2 build's arithmetic (csrc ``fdot_group``) in torch: the file's float32 weights
    (``widened``), per row and output four float32 partial sums, input i's ``fma(w, x, p)`` into
    partial i mod 4 in input order, y = (p_0 + p_1) + (p_2 + p_3). Each multiply-add is formed in
    float64 (the product exact) and rounded to float32: the kernel's bits wherever that sum is exact
    in float64 (operands within 2^29 of each other: random rows in tests)."""
    w = widened(kind, parts).double()  # [N, K]
    x = x_MK.double()
    m, k = x.shape
    acc = torch.zeros(4, m, w.shape[0], dtype=torch.float32)
    for i in range(k):
        acc[i % 4] = (acc[i % 4].double() + x[:, i:i + 1] * w[:, i][None, :]).float()
    return (acc[0] + acc[1]) + (acc[2] + acc[3])


# The AVX-512 build's int32 block sums (csrc IDotInt): kind -> (X's top bit, centre k where C = -k D, or 0)
INT32 = {29: (22, 8), 20: (21, 0), 23: (21, 0), 30: (21, 16), 21: (20, 0), 24: (20, 0), 25: (21, 32), 36: (22, 4)}


def reference_digits(x_MK: torch.Tensor, kind: int, parts: tuple) -> torch.Tensor:
    """The AVX-512 VNNI build's arithmetic in torch (module doc): per row and 32-input block, e with the block's
    largest |x| 2^e in [2^top, 2^(top + 1)) (one less where it would pass the cap: 8355711 for top 22, else
    2^(top + 1) - 1), X = round(x 2^e) (ties to even), then in float64 per block (and per half of it for Q6_K's
    scales per 16): acc += t (D 2^-e); acc += C (sum X 2^-e), t = sum u X; float32 at the end. The kinds of
    ``INT32`` take a top (22 elsewhere) for which t fits int32; those whose C is -k D take t = sum (u - k) X
    and no C term. Bit for bit the kernel's where each product is exact in float64 (kinds 20-25, 29-31)."""
    x = x_MK.double()
    m, k = x.shape
    top, centre = INT32.get(kind, (22, 0))
    cap = 8355711.0 if top == 22 else 2.0 ** (top + 1) - 1
    u = _u(kind, parts[0]).to(torch.int64) - centre
    n = u.shape[0]
    xb = x.reshape(m, k // BLOCK, BLOCK)
    mx = xb.abs().amax(-1)
    e = torch.where(mx > 0, top - (torch.frexp(mx).exponent.to(torch.int64) - 1), 0)  # ilogb(mx) = exponent - 1
    e = torch.where(torch.ldexp(mx, e.double()) > cap, e - 1, e)
    X = torch.round(torch.ldexp(xb, e.double()[..., None])).to(torch.int64)  # [M, B, 32]
    s = torch.ldexp(torch.ones_like(mx), -e.double())  # [M, B]
    D, C = _scales(kind, parts)  # [N, K / 16]
    halves = 2 if kind in SIXK or kind == Q2K else 1
    per = BLOCK // halves
    ub = u.reshape(n, k // per, per)
    Xh = X.reshape(m, k // per, per)
    t = torch.einsum("nbj,mbj->mnb", ub, Xh)  # exact
    assert kind not in INT32 or t.abs().max() < 2 ** 31, "IDotInt: t must fit int32"
    t = t.double()
    sx = Xh.sum(-1).double()  # [M, K / per]
    sh = s.repeat_interleave(halves, dim=1)  # [M, K / per]
    Dh, Ch = D[:, ::2 // halves], C[:, ::2 // halves]  # [N, K / per]
    acc = torch.zeros(m, n, dtype=torch.float64)
    for j in range(k // per):
        acc = acc + t[:, :, j] * (Dh[:, j][None, :] * sh[:, j:j + 1])
        if not centre:
            acc = acc + Ch[:, j][None, :] * (sx[:, j:j + 1] * sh[:, j:j + 1])
    return acc.float()


PACK_ROWS = 4096  # rows packed at once (a multiple of GROUP): packing's copies stay a slice's, not a head's


def packi(kind: int, parts: tuple) -> torch.Tensor:
    """``parts`` (``codes_of``) in ``mmi``'s layout: uint8 [groups of 16, entries, entry bytes],
    ``PACK_ROWS`` rows at a time into the one output (each group of 16 outputs is packed from its
    own rows alone: Qwen2.5's 151,936-token Q8_0 embedding held 3-4 copies of its codes at once)."""
    n = parts[0].shape[0]
    if n <= PACK_ROWS:
        return _packi(kind, parts)
    first = _packi(kind, tuple(t[:PACK_ROWS] for t in parts))
    out = first.new_empty((-(-n // GROUP), *first.shape[1:]))
    out[:first.shape[0]] = first
    del first
    for r0 in range(PACK_ROWS, n, PACK_ROWS):
        chunk = _packi(kind, tuple(t[r0:r0 + PACK_ROWS] for t in parts))
        out[r0 // GROUP:r0 // GROUP + chunk.shape[0]] = chunk
    return out


def _packi(kind: int, parts: tuple) -> torch.Tensor:
    if kind in HALF:  # per group of 16 and block of 32 inputs: [half o][input][8 outputs] of 2 bytes
        w = parts[0].view(torch.int16)
        n, k = w.shape
        g, b = -(-n // GROUP), k // BLOCK
        w_GoLbI = grouped_rows(w, GROUP).reshape(g, 2, 8, b, BLOCK)
        return w_GoLbI.permute(0, 3, 1, 4, 2).contiguous().view(torch.uint8).reshape(g, b, 1024)
    supers, head, code_bytes, block_bytes, entry_bytes = extension().layouti(kind)
    u = parts[0]
    n, k = u.shape
    g = -(-n // GROUP)
    b = k // BLOCK
    s = b // supers

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return grouped_rows(t, GROUP)

    def per_output(t: torch.Tensor) -> torch.Tensor:
        """[N, B] -> bytes [groups, B, 16 * itemsize] (outputs inner)."""
        return grouped(t).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(g, b, -1)

    u_G16B = grouped(u).reshape(g, GROUP, b, BLOCK)
    if kind in (22, 28, 31):  # vector c holds u[4c + t] of output i at byte 4 i + t
        codes = [u_G16B.reshape(g, GROUP, b, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, b, 512)]
    elif kind in (Q3K, Q2K):  # bits 2h of byte 4 i + t of vector s: u[4 (4 s + h) + t]; Q3_K: then bit 2's plane
        u5 = u_G16B.reshape(g, GROUP, b, 2, 4, 4)  # [g, i, b, s, h, t]
        crumbs = u5[..., 0, :] & 0x03
        for h in range(1, 4):
            crumbs = crumbs | ((u5[..., h, :] & 0x03) << (2 * h))
        codes = [crumbs.permute(0, 2, 3, 1, 4).reshape(g, b, 128)]
        if kind == Q3K:
            bit = ((u_G16B.reshape(g, GROUP, b, 8, 4) >> 2) & 1).permute(0, 2, 3, 1, 4).reshape(g, b, 64, 8)
            byte = bit[..., 0].clone()
            for j in range(1, 8):
                byte |= bit[..., j] << j
            codes.append(byte)
    else:
        u6 = u_G16B.reshape(g, GROUP, b, 4, 2, 4)  # [.., c, h, t]: u[8c + 4h + t]
        nib = (u6[..., 0, :] & 0x0F) | ((u6[..., 1, :] & 0x0F) << 4)  # [g, i, b, c, t]
        codes = [nib.permute(0, 2, 3, 1, 4).reshape(g, b, 256)]
        planes = {21: 1, 24: 1, 27: 1, 30: 1, 25: 2}.get(kind, 0)
        for p in range(planes):
            bit = ((u6 >> (4 + p)) & 1).permute(0, 2, 3, 4, 1, 5).reshape(g, b, 64, 8)  # [g, b, (c, h, i, t)]
            byte = bit[..., 0].clone()  # uint8 throughout: a matrix's codes, never 8 bytes a weight
            for j in range(1, 8):
                byte |= bit[..., j] << j
            codes.append(byte)
    if kind in (20, 21, 22):
        assert _f16(parts[1]) and _f16(parts[2]), "kinds 20-22 hold float16 scales"
        scales = [per_output(parts[1].half()), per_output(parts[2].half())]
    elif kind == IQ4XS:  # int8 scales per 32; d per 256 in the header; C = -128 D formed in the kernel
        scales = [per_output(parts[1])]
    elif kind == 35:  # IQ4 with float32 D; C = -128 D formed in the kernel
        assert torch.equal(parts[2], parts[1] * OFFSET[kind])
        scales = [per_output(parts[1].float())]
    elif kind in OFFSET:  # C = OFFSET D, formed in the kernel
        assert _f16(parts[1]) and torch.equal(parts[2], parts[1] * OFFSET[kind])
        scales = [per_output(parts[1].half())]
    elif kind in (26, 27, 28):
        scales = [per_output(parts[1].float()), per_output(parts[2].float())]
    elif kind in (23, 24):
        scales = [per_output(parts[1]), per_output(parts[2])]
    elif kind == Q2K:  # sc of inputs 0-15, of 16-31, then mn alike
        sc, mn = parts[1].reshape(n, b, 2), parts[2].reshape(n, b, 2)
        scales = [per_output(t[..., h].contiguous()) for t in (sc, mn) for h in (0, 1)]
    else:
        sc = parts[1].reshape(n, b, 2)
        scales = [per_output(sc[..., 0].contiguous()), per_output(sc[..., 1].contiguous())]
    blocks = torch.cat(codes + scales, dim=-1)
    assert blocks.shape[-1] == block_bytes and sum(c.shape[-1] for c in codes) == code_bytes, blocks.shape
    entry = [blocks.reshape(g, s, supers * block_bytes)]
    if head:
        floats = parts[3:] if kind in (23, 24, Q2K) else parts[2:]
        entry = [grouped(t.float()).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(g, s, -1)
                 for t in floats] + entry
    out = torch.cat(entry, dim=-1).contiguous()
    assert out.shape[-1] == entry_bytes, (out.shape, entry_bytes)
    return out


class IDotLinear(Exact4Linear):
    """``y = x @ W.T`` for float32 ``x`` with W held as the file's block codes, run by ``mmi``
    (module doc); siblings of one kind stacked as ``Exact4Linear``'s."""

    def __init__(self, linears: list[nn.Linear], p: torch.Tensor, kind: int):
        super().__init__(linears, p)
        self.ikind = kind
        self.bits = BITS[kind]

    def kernel(self, x_MK: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:  # Exact4Linear.forward calls it
        return mmi(x_MK, p, n, self.ikind)

    @classmethod
    def of(cls, linears: list[nn.Linear]) -> IDotLinear | None:
        """The siblings' codes stacked, packed and checked through the kernel on unit rows against
        their float32 weights; None unless every sibling holds file blocks of one kind."""
        if not available():
            return None
        codes = [codes_of(lin) for lin in linears]
        if any(c is None for c in codes) or len({c[0] for c in codes}) != 1:
            return None
        kind = codes[0][0]
        parts = tuple(torch.cat([c[1][i] for c in codes]) for i in range(len(codes[0][1])))
        p = packi(kind, parts)
        n = parts[0].shape[0]
        idx, unit_RK = _unit_rows(parts[0].shape[1])
        if not torch.equal(mmi(unit_RK, p, n, kind), widened(kind, parts, idx).t()):
            return None
        return cls(linears, p, kind)

    def extra_repr(self) -> str:
        return super().extra_repr().replace(f"exact {self.bits}-bit weights", f"GGUF codes on int8 dots (kind {self.ikind})")


def has_codes(model: nn.Module) -> bool:
    """Whether some float32 linear of ``model`` other than its head holds blocks ``codes_of`` takes
    (a GGUF file's, or exact 4-bit ones in float32 weights); stops at the first that does."""
    from lp.kernels.exact4 import _blocks, _head, _local, _plain

    from lp.kernels.exact4 import _weight16

    half = half_kinds()

    def takes(m) -> bool:  # codes_of's cases, without building the codes
        if half and _weight16(m) is not None:
            return True
        q, b8 = staged(m, "_lp_blocksq"), staged(m, "_lp_blocks8")  # the first such linear's, unpacked once
        if q is not None:
            return q[0] in (4, 5, 6, 7, 8)
        if b8 is not None:
            return len(b8) == 2
        return getattr(m, "_lp_blocks", None) is not None or (
            not m.weight.is_meta and m.weight.dtype == torch.float32 and _blocks(_local(m.weight.detach())) is not None)

    head = _head(model)
    return any(_plain(m) and m is not head and takes(m) for m in model.modules())


def rowsi(p: torch.Tensor, ids: torch.Tensor, n: int, kind: int) -> torch.Tensor:
    """Rows ``ids`` of a ``packi``-packed weight of ``n`` rows, float32 [*ids.shape, K]: each weight
    what a unit row's product gives (the file's float32 weight)."""
    if kind in HALF:  # packi's 16-bit layout, gathered
        flat = ids.reshape(-1).long()
        bad = flat[(flat < 0) | (flat >= n)]
        if bad.numel():
            raise RuntimeError(f"rowsi: row {int(bad[0])} outside 0..{n - 1}")
        w = p.view(torch.int16).reshape(p.shape[0], p.shape[1], 2, BLOCK, 8)  # [g, b, o, i, l]
        rows = w[flat // GROUP, :, (flat % GROUP) // 8, :, flat % 8].reshape(flat.numel(), -1)
        return rows.view(HALF[kind]).float().reshape(*ids.shape, rows.shape[-1])
    rows = extension().rowsi(p, ids, n, kind)
    return rows.reshape(*ids.shape, rows.shape[-1])


HEAD_ROWS = 4096  # rows of a head IBlockHead.of builds at once (a multiple of GROUP)


def _staged(parts) -> nn.Linear | None:
    """A meta linear holding a file tensor's ``parts`` as lp.model.gguf stages a linear's (what
    ``codes_of`` reads), or None for parts of no kind it takes."""
    q = parts[0]
    lin = nn.Linear(1, 1, bias=False, device="meta")
    if len(parts) == 1 and q.dtype in (torch.float16, torch.bfloat16):  # a F16 / BF16 tensor (AVX2 build)
        lin._lp_weight16 = q
    elif isinstance(q, int):  # lp.model.gguf.QParts (kind, parts)
        lin._lp_blocksq = tuple(parts)
    elif len(parts) in (2, 3) and q.dtype == torch.int8:  # 3: exact8x's (q, D, C), of which Q2_K's (kind 37)
        lin._lp_blocks8 = tuple(parts)
    elif len(parts) == 3 and q.dtype == torch.uint8:
        lin._lp_blocks = tuple(parts)
    else:
        return None
    return lin


class IBlockHead(BlockHead):
    """An LM head (and the tied embedding's source) held as a GGUF file's codes on ``mmi``: its
    products for any number of float32 rows, greedy-only rows through ``IScreen`` (kinds 20-31, 34, 35), its
    rows (``rows``) decoded from the same packed codes. Built by ``of`` from the file's parts as
    lp.model.gguf reads them (4-bit, 8-bit or exactq ``QParts``; on AVX2 also a F16 / BF16 tensor's
    2-byte floats, kinds 32 / 33, without the screen)."""

    def __init__(self, p: torch.Tensor, kind: int, n: int, k: int, wnorm: torch.Tensor | None = None):
        nn.Module.__init__(self)
        self.qkind = kind
        self.out_features, self.in_features = n, k
        self.offsets, self.bits = True, (16 if kind in HALF else 8)
        self.register_buffer("p", p)
        # BlockHead.forward (and the runner, through exact4.head8) route greedy-only rows to h8.argmax_logits
        self.h8 = (IScreen(self, wnorm) if wnorm is not None and kind not in HALF and extension().screeni_available()
                   else None)

    def kernel(self, x_MK: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:  # BlockHead.forward calls it
        return mmi(x_MK, p, n, self.qkind)

    @classmethod
    def of(cls, parts) -> IBlockHead | None:
        """The head over ``parts`` (a file tensor's blocks: (q, d, c) 4-bit, (q, d) 8-bit, or exactq's
        (kind, parts)), checked on unit rows like ``IDotLinear.of``; None where idot does not run
        here or does not take these blocks. Built ``HEAD_ROWS`` rows at a time (codes, packing,
        checks and row norms): a head's whole codes and float32 weights never exist at once
        (Gemma-3's 262,144-token head is 671 MB in float32; its codes alone are 168 MB)."""
        if not available():
            return None
        qparts = isinstance(parts[0], int)  # lp.model.gguf.QParts (kind, parts)
        n = (parts[1][0] if qparts else parts[0]).shape[0]
        kind = p = idx = unit_RK = None
        probe, probe_w, norms = [0, n // 2, n - 1], {}, []
        for r0 in range(0, n, HEAD_ROWS):
            r1 = min(n, r0 + HEAD_ROWS)
            rows = (parts[0], tuple(t[r0:r1] for t in parts[1])) if qparts else tuple(t[r0:r1] for t in parts)
            lin = _staged(rows)
            code = codes_of(lin) if lin is not None else None
            if code is None or (kind is not None and code[0] != kind):
                return None
            kind, cparts = code
            pc = packi(kind, cparts)
            if p is None:
                k = cparts[0].shape[1]
                idx, unit_RK = _unit_rows(k)
                p = pc.new_empty((-(-n // GROUP), *pc.shape[1:]))
            p[r0 // GROUP:r0 // GROUP + pc.shape[0]] = pc  # HEAD_ROWS is a multiple of GROUP
            w = widened(kind, cparts)
            if not torch.equal(mmi(unit_RK, pc, r1 - r0, kind), w[:, idx].t()):
                return None
            probe_w.update({v: w[v - r0].clone() for v in probe if r0 <= v < r1})
            if kind not in HALF:  # the screen's (kinds 20-31, 34, 35)
                norms.append(torch.linalg.vector_norm(w, dim=1, dtype=torch.float64))  # each token's ||w_v||
            del lin, rows, cparts, pc, w
            trim_heap()  # the slice's copies back to the OS before the next (glibc keeps them otherwise)
        probe_rows = rowsi(p, torch.tensor(probe), n, kind)  # rows decoded from the whole packed head
        if any(not torch.equal(probe_rows[i], probe_w[v]) for i, v in enumerate(probe)):
            return None
        # rounded up to float32 (the screen's bound)
        wnorm = torch.nextafter(torch.cat(norms).float(), torch.tensor(float("inf"))) if norms else None
        return cls(p, kind, n, k, wnorm)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return rowsi(self.p, ids, self.out_features, self.qkind)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        y_MN = mmi(x.reshape(-1, self.in_features).float(), self.p, self.out_features, self.qkind)
        return y_MN.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"GGUF codes on int8 dots (kind {self.qkind})")


SCREEN_MAX_ROWS = 64  # more rows: the whole product (a row of the screen costs 1/3 of it on AVX2, 2/3 on AVX-512)
SCREEN_DIGITS = 1  # x's top digits the AVX-512 screen takes (1 or 2; the AVX2 one: 1)
SCREEN_MAX_GROUPS = 256  # groups of 16 tokens the exact pass may take (4096 tokens); more: the whole product


class IScreen:
    """``IBlockHead``'s greedy screen (``screeni``). The screen's product y1_v uses x's top int8
    digit per element (x' = 2^16 x1 2^-e per block, |x - x'| <= 2^-7 of the block's largest |x|; in
    the AVX-512 build mmi's own X, and with ``SCREEN_DIGITS`` 2 its top two, x' = (2^16 x1 + 2^8 x2)
    2^-e, within 2^-14 of the block's largest), on the exact codes; Cauchy-Schwarz bounds
    |y1_v - y_v| by ||w_v|| ||x - x'|| (with slack for the sums' roundings: float32 in the AVX2
    product, double in the AVX-512 one) plus the float32 roundings of y1 and of the exact logit
    y_v (2^-20 |y1_v|). A token whose y1_v + E_v is below max_u (y1_u - E_u) is proved below the
    row's maximum. The kept tokens' groups of 16 then run ``mmi`` itself (each output's bits
    depend only on its own group's codes), so every value returned is the exact logit the whole
    product gives, -inf elsewhere: the argmax, first index on ties, is the whole product's."""

    def __init__(self, head: IBlockHead, wnorm: torch.Tensor):
        self.head = head
        self.wnorm = wnorm.contiguous()
        self.screen = True
        self.calls = self.screened = 0

    def argmax_logits(self, x: torch.Tensor) -> torch.Tensor:
        head = self.head
        x_MK = x.reshape(-1, head.in_features)
        self.calls += 1
        if x_MK.dtype != torch.float32 or not 1 <= x_MK.shape[0] <= SCREEN_MAX_ROWS:
            return head.logits(x)
        ok, groups = extension().screeni(x_MK, head.p, head.out_features, head.qkind, self.wnorm, SCREEN_MAX_GROUPS,
                                         SCREEN_DIGITS)
        if not ok:
            return head.logits(x)
        self.screened += 1
        y_MG = mmi(x_MK, head.p.index_select(0, groups).contiguous(), 16 * groups.numel(), head.qkind)
        cols = (groups[:, None] * 16 + torch.arange(16)).reshape(-1)
        live = cols < head.out_features
        y_MV = torch.full((x_MK.shape[0], head.out_features), float("-inf"))
        y_MV[:, cols[live]] = y_MG[:, live]
        return y_MV.reshape(*x.shape[:-1], head.out_features)
