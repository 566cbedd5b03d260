"""GGUF's 5- and 6-bit and K-quant blocks run at about the file's size (issue 50, item 1).

Contract: a linear whose ``_lp_blocksq`` holds ``(kind, parts)`` (lp.model.gguf reads them from the
file: ``KINDS``) becomes an ``ExactQLinear`` whose products are those of the float32 weights
``widenq(kind, parts)`` gives, which are bit for bit what ``gguf.dequantize`` makes of the file
(each weight one float32 rounding of an exact value: csrc/lp_exact4.cpp's ``WeightsQ``). Parts, N
output rows, K inputs, B = K / 32 blocks, S = K / 256 super-blocks, q the unsigned code:

* kind 4, Q5_0 / Q5_1: (q uint8 [N, K], D, C float32 [N, B]): w = fma(q, D, C);
* kind 5 / 6, Q4_K / Q5_K: (q, sc, mn uint8 [N, B], d, nm float32 [N, S]): w = fma(q, d sc, nm mn);
* kind 7, Q6_K: (q, sc int8 [N, 2 B], d float32 [N, S]): w = (q - 32) (d sc), a scale per 16;
* kind 8, Q6_K as bytes: kind 7's parts and weights, q - 32 packed as an int8 a weight (what Q6_K
  runs on: ``KINDS``).

``packq(kind, parts)`` lays them out for ``mmq``: per group of 8 outputs and super-block, the
codes as the file holds them (a nibble and 1-2 bit planes a weight, the 6- or 8-bit scale codes,
the super-block's float32 scales once): Q4_K 4.75 bits a weight (file 4.5), Q5_K 5.75 (5.5), Q6_K
6.625 (6.5625; kind 8: 8.625), Q5_0 / Q5_1 7 (5.5 / 6), against 6 to 12 in lp's 4- and 8-bit kinds. The kernel's
tiles, chains and summation order are the other kinds': a row's result depends on that row only.

Why: a Q4_K_M file's Q6_K and Q5_0 tensors held at 9-12 bits a weight made lp hold 1.3-1.8x the
file. Fewer bytes do not make a one-row product faster here (it is bound by instructions, not by
memory: bench/results/gguf_formats/exactq_kernels.md); Q4_K stays exact4 for that reason, and Q6_K
runs as kind 8, whose bytes decode as exact8's do: at 1-2 rows 0.67-0.75 ms against kind 7's
0.94-1.01 and exact8x's 0.80-0.92 on a [4864, 2048] matrix, as fast or faster at 4-16 rows, in 1.08
bytes a weight (kind 7: 0.83, exact8x: 1.5). A Q6_K embedding / LM head (Llama 3.2's, Qwen3's) is
held as kind 8 too (``QBlockHead``), not as exact8x.
"""

from __future__ import annotations

import torch
from torch import nn

from lp.kernels.exact4 import BlockHead, Exact4Linear, Head8, _unit_rows, extension, staged

KINDS = {"Q5_0": 4, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 8}
HI = {4: 1, 5: 0, 6: 1, 7: 2, 8: 0}  # bit planes above the nibble (8: none, the codes are bytes)
GROUP, BLOCK = 8, 32


def mmq(x_MK: torch.Tensor, p: torch.Tensor, n: int, kind: int) -> torch.Tensor:
    """``x @ W.T`` [M, n] for float32 ``x`` [M, K] and W packed by ``packq``."""
    return torch.ops.lp_exact4.mmq(x_MK, p, n, kind)


def scales16(sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q6_K's exact scale per 16 weights, d * sc (an 11-bit d times a 7-bit sc: no rounding), from
    sc [..., K / 16] and d [..., K / 256]."""
    return d.repeat_interleave(16, dim=-1) * sc.float()


def widenq(kind: int, parts: tuple) -> torch.Tensor:
    """The float32 weights [N, K] of ``parts`` (module doc), each product exact, one rounding."""
    q = parts[0].to(torch.float32)
    n, k = q.shape
    if kind == 4:
        D, C = (t.repeat_interleave(BLOCK, dim=1) for t in parts[1:3])
        return q * D + C  # q * D exact: the add is the one rounding, as the kernel's fma
    if kind in (5, 6):
        sc, mn, d, nm = parts[1:]
        D = (d.repeat_interleave(8, dim=1) * sc.float()).repeat_interleave(BLOCK, dim=1)
        C = (nm.repeat_interleave(8, dim=1) * mn.float()).repeat_interleave(BLOCK, dim=1)
        return q * D + C
    D = scales16(*parts[1:]).repeat_interleave(16, dim=1)
    return (q - 32) * D


def grouped_rows(t: torch.Tensor, group: int) -> torch.Tensor:
    """[N, ...] -> [ceil(N / group), group, ...], zero rows padded: the packed layouts' output groups
    (``packq``'s 8, lp.kernels.idot's 16)."""
    pad = -t.shape[0] % group
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(-1, group, *t.shape[1:])


def packq(kind: int, parts: tuple) -> torch.Tensor:
    """``parts`` in ``mmq``'s layout: uint8 [groups, entries, entry bytes] (csrc ``WeightsQ``)."""
    supers, head, block_bytes, entry_bytes = extension().layoutq(kind)
    q = parts[0]
    n, k = q.shape
    g = -(-n // GROUP)
    b = k // BLOCK
    s = b // supers

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return grouped_rows(t, GROUP)

    def per_block(t: torch.Tensor) -> torch.Tensor:
        """[N, B, x] -> bytes [groups, S, supers, 8 * x * itemsize] (outputs inner)."""
        t = grouped(t).reshape(g, GROUP, s, supers, -1).permute(0, 2, 3, 1, 4).contiguous()
        return t.view(torch.uint8).reshape(g, s, supers, -1)

    q_NB32 = q.reshape(n, b, BLOCK)
    if kind == 8:  # q - 32 as int8, one a weight
        pieces = [per_block((q_NB32.to(torch.int16) - 32).to(torch.int8))]
    else:
        nib = (q_NB32[..., :16] & 0x0F) | ((q_NB32[..., 16:] & 0x0F) << 4)
        pieces = [per_block(nib)]
    bits = (1 << torch.arange(BLOCK, dtype=torch.int64))
    for p in range(HI[kind]):
        word = (((q_NB32.to(torch.int64) >> (4 + p)) & 1) * bits).sum(-1).to(torch.int32)
        pieces.append(per_block(word.unsqueeze(-1)))
    if kind not in (7, 8):  # (D, C) float32 or (sc, mn) codes per block
        pieces += [per_block(parts[1].unsqueeze(-1)), per_block(parts[2].unsqueeze(-1))]
    else:  # the scale of weights 0-15 of every output, then of 16-31
        sc = parts[1].reshape(n, b, 2)
        pieces += [per_block(sc[..., 0:1].contiguous()), per_block(sc[..., 1:2].contiguous())]
    blocks = torch.cat(pieces, dim=-1)
    assert blocks.shape[-1] == block_bytes, (blocks.shape, block_bytes)
    entry = [blocks.reshape(g, s, supers * block_bytes)]
    if head:
        heads = [grouped(t).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(g, s, -1)
                 for t in parts[3 if kind in (5, 6) else 2:]]
        entry = heads + entry
    out = torch.cat(entry, dim=-1).contiguous()
    assert out.shape[-1] == entry_bytes, (out.shape, entry_bytes)
    return out


class ExactQLinear(Exact4Linear):
    """``y = x @ W.T`` for float32 ``x`` with W held as GGUF's own codes (module doc), run by
    ``mmq``; siblings of one kind stacked as ``Exact4Linear``'s."""

    bits = 6

    def __init__(self, linears: list[nn.Linear], p: torch.Tensor, kind: int):
        super().__init__(linears, p)
        self.qkind = kind

    def kernel(self, x_MK: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:  # Exact4Linear.forward calls it
        return mmq(x_MK, p, n, self.qkind)

    @classmethod
    def of(cls, linears: list[nn.Linear]) -> ExactQLinear | None:
        """The siblings' codes stacked, packed and checked through the kernel on unit rows against
        ``widenq``; None unless every sibling holds ``_lp_blocksq`` of one kind."""
        codes = [staged(lin, "_lp_blocksq") for lin in linears]
        if any(c is None for c in codes) or len({c[0] for c in codes}) != 1:
            return None
        kind = codes[0][0]
        parts = tuple(torch.cat([c[1][i] for c in codes]) for i in range(len(codes[0][1])))
        p = packq(kind, parts)
        idx, unit_RK = _unit_rows(parts[0].shape[1])
        if not torch.equal(mmq(unit_RK, p, parts[0].shape[0], kind), widenq(kind, parts)[:, idx].t()):
            return None
        return cls(linears, p, kind)

    def extra_repr(self) -> str:
        return super().extra_repr().replace(f"exact {self.bits}-bit weights", f"GGUF codes (kind {self.qkind})")


class QParts(tuple):
    """(kind, parts): a GGUF file's embedding or head tensor read as exactq parts (lp.model.gguf)."""

    def __new__(cls, kind: int, parts: tuple):
        return super().__new__(cls, (kind, parts))


def rows8(p: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The float32 weight rows ``ids`` of a kind-8 packed tensor (``packq(8, ...)``), read from its
    entries with the kernel's arithmetic ((q - 32) times the exact d * sc): [*ids.shape, k]."""
    supers, head, block_bytes, _ = extension().layoutq(8)
    flat = ids.reshape(-1).long()
    n, s = flat.shape[0], p.shape[1]
    entry = p[flat // GROUP]  # [n, S, entry bytes]
    j = (flat % GROUP)[:, None, None]
    d = torch.gather(entry, 2, (4 * j + torch.arange(4)[None, None, :]).expand(n, s, 4)).contiguous().view(torch.float32)
    blocks = entry[:, :, head:].reshape(n, s, supers, block_bytes)
    jb = j[..., None]
    codes = torch.gather(blocks, 3, (jb * BLOCK + torch.arange(BLOCK)).expand(n, s, supers, BLOCK)).view(torch.int8)
    sc = torch.gather(blocks, 3, (GROUP * BLOCK + jb + torch.tensor([0, GROUP])).expand(n, s, supers, 2)).view(torch.int8)
    D = (d[..., None] * sc.float()).repeat_interleave(16, dim=3)  # [n, S, supers, 32]: d * sc, exact
    return (codes.float() * D).reshape(*ids.shape, k)


class QBlockHead(BlockHead):
    """``BlockHead`` over a Q6_K tensor's ``QParts`` (kind 8, 1.08 bytes a weight): ``mmq`` for its
    products, ``rows8`` for the tied embedding's rows, and (``screen``) the greedy int8 screen over
    its exact weights (the codes - 32 times d * sc per 16, ``Head8``)."""

    def __init__(self, parts: QParts, screen: bool = True):
        nn.Module.__init__(self)
        self.qkind, qparts = parts
        assert self.qkind == 8, self.qkind
        self.out_features, self.in_features = qparts[0].shape
        self.offsets, self.bits = True, 8
        self.register_buffer("p", packq(self.qkind, qparts))
        self.h8 = None
        if screen:
            q, sc, d = qparts
            self.h8 = Head8(self.p, self.out_features, (q.to(torch.int16) - 32).to(torch.int8), scales16(sc, d), kind=8)

    def kernel(self, x_MK: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:  # BlockHead.forward calls it
        return mmq(x_MK, p, n, 8)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return rows8(self.p, ids, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, GGUF codes (kind {self.qkind})"
                f"{', int8 greedy screen' if self.h8 and self.h8.screen else ''}")
