"""GGUF files read as stored (issue 50, item 1): ``model.path`` may name a ``.gguf`` file, or a
folder holding exactly one and no ``config.json``.

Contract: ``gguf_file(path)`` returns the file a path names (None: not a GGUF path).
``load_gguf(file, dtype, device, quant, tokenizer)`` returns (model, tokenizer or None) like
lp.model.loader.load_model: the config and tokenizer (with its chat template) come from the file
through transformers' own GGUF readers, the model is built on the meta device, and every tensor is
read from the file with transformers' name map and tensor processors (the same names, the same
permutations, the same dequantization: ``gguf.dequantize``), except that a decoder linear
stored in a format of ``KEPT`` keeps its blocks (its bias, if any, read as float32), taken from the file's bytes (rows permuted
as the processor permutes them), never formed as float32 weights. ``model.quant=auto`` /
``exact4`` then runs them on lp.kernels.exact4's kernels, whose products are those of the float32
weights transformers' GGUF loader makes, because gguf.dequantize forms each weight with one
float32 rounding of an exact value:

* 4-bit, ``fma(q, d, c)`` (``Exact4Linear``): Q4_1 ``d * q + m``; Q4_0 ``d * (q - 8)`` (c = -8 d);
  Q4_K ``(d * scale) * q - dmin * min`` per 32 weights (d * scale and dmin * min are exact);
* the file's codes (lp.kernels.exactq's ``ExactQLinear``, ``blocksq_of``): Q5_0 ``d * (q - 16)``,
  Q5_1 ``d * q + m``, Q5_K as Q4_K with 5-bit q, Q6_K ``(d * scale) * (q - 32)`` (a decoder
  linear; the embedding and head in these formats take the 8-bit kinds below);
* 8-bit, ``q * d`` (``Exact8Linear``): Q8_0 ``d * q``; Q5_0 ``d * (q - 16)``; IQ4_NL ``d * value``
  (q the code's int8 value); IQ4_XS ``(d * (scale - 32)) * value`` per 32 (lp.kernels.idot's AVX-512
  build takes IQ4's values back to the file's nibbles: kinds 34 / 35, 4.5 / 5 bits a weight);
* 8-bit, ``fma(q, D, C)`` per 16 weights (``Exact8xLinear``): Q6_K ``(d * scale) * q``; Q5_K as
  Q4_K with 5-bit q; Q5_1 ``d * q + m``; Q2_K ``(d * scale) * q - dmin * min`` (its scale and min
  per 16: no idot kind takes it, float32 on AVX2);
* Q3_K ``(d * (scale - 32)) * q`` as Q6_K's codes (``QKINDS``: the same weights, 6.6 bits a weight);
* the codebook formats (``CODES8``: IQ2_XXS / XS / S, IQ3_XXS / S, IQ1_S, TQ1_0 / TQ2_0) as int8 codes q
  with the file's own scale D per 32 (IQ2_XS / S: per 16) inputs (``codes8_of``: D read from the
  block's fields, q = w / D from gguf.dequantize's weights, kept only where D q gives back every
  weight bit for bit): lp's 8-bit kernels (idot's kinds 28 / 31, exact8x per 16), ~10-12 bits a
  weight instead of float32's 32 (on SmolLM2 / Gemma-3 IQ3_M files one served step 15.7 -> 5.7 ms
  and 17.4 -> 10.4 ms, the process 737 -> 536 and 867 -> 681 MiB).

Where the blocks do not run (``model.quant=none``, a CPU without exact4's AVX-512 path, a non-CPU
device) they are widened to those same float32 weights. The token embedding and the LM head in a
kept format stay blocks as well (``_ends_from_blocks``: lp.kernels.exact4's ``BlockEmbedding`` and
``BlockHead``, one copy for a tied pair). F16 / BF16 tensors keep their 2-byte floats
(``Exact16Linear`` and a 16-bit ``BlockHead``: widened in the kernel, exact); the other formats
(IQ1_M, a codebook tensor whose weights are not D q) are dequantized to float32 as transformers does, so the loaded model always
computes what ``from_pretrained(gguf_file=...)`` on the same file computes in float32, up to the
kernels' summation order.

Under exact4 with a ``cache_dir`` the loaded model is kept beside the file's metadata
(lp.model.packed: its packed tensors, fingerprinted by lp's kernel and loader sources, torch,
transformers and the CPU's kernel paths) and served from that file by memory map, the first start
included; a restart reads it in ~0.3 s instead of parsing, unpacking and packing the file again.

Why: llama.cpp and Ollama users hold GGUF files; before this lp converted its default model once to
a float32 folder and could not open any other GGUF. Legend: N output rows, K inputs, B blocks of
32 along K.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import numpy as np
import torch

from lp.kernels.exact4 import trim_heap  # noqa: F401  (lp.serve, lp.server.batched: after a phase, a burst)
from lp.kernels.exactq import KINDS, QParts
from lp.model import packed
from lp.model.tokenizer import keep as keep_tokenizer
from lp.model.tokenizer import load_kept

log = logging.getLogger(__name__)

BLOCK = 32
# bytes of one 32-weight block: (offset of d, offset of m or None, offset of the 16 nibble bytes, size)
LAYOUTS = {"Q4_0": (0, None, 2, 18), "Q4_1": (0, 2, 4, 20)}
SUPER = 256  # weights of a K-quant super-block
# the formats kept as blocks: bytes per block (of 32, or of 256 for K-quants), the kernel's bits
KEPT = {"Q4_0": (18, 32, 4), "Q4_1": (20, 32, 4), "Q4_K": (144, SUPER, 4), "Q8_0": (34, 32, 8), "Q5_0": (22, 32, 8),
        "Q5_1": (24, 32, 8), "Q5_K": (176, SUPER, 8), "Q6_K": (210, SUPER, 8), "Q2_K": (84, SUPER, 8),
        "Q3_K": (110, SUPER, 8), "IQ4_NL": (18, 32, 8), "IQ4_XS": (136, SUPER, 8), "F16": (64, 32, 16),
        "BF16": (64, 32, 16)}
# held as the file codes them (lp.kernels.exactq); Q4_K stays exact4 (6 bits a weight, not exactq's 4.75):
# its table-driven loads ran 1.1-1.3x faster at 1-2 rows, the steps that stream the weights (bench/results/gguf_formats);
# where lp.kernels.idot runs (AVX-512 VNNI), Q4_K is held as its codes too (_read_tensors)
# Q3_K as Q6_K's parts: (d (scale - 32)) q = (d sc) (u - 32) with sc = scale - 32 and u = q + 32 (q in -4..3), the
# same float32 weights (each d sc exact, then one exact product), at Q6_K's 6.6 bits a weight (the file: 3.4375;
# exact8x's form was 12 bits, and no idot kind took it: float32 on AVX2)
QKINDS = {**{kind: kid for kind, kid in KINDS.items() if kind != "Q4_K"}, "Q3_K": KINDS["Q6_K"]}
QHEAD = ("Q6_K", "Q3_K")  # embedding / head formats held as exactq parts (kind 8: lp.kernels.exact4.BlockHead)
SCALED8 = ("Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS")  # 8-bit kinds w = q * d per 32 (the others: fma(q, D, C) per 16)
# the codebook formats, held as int8 codes q with the file's own float32 scale D per 32 (or 16) inputs, w = D q
# exactly (each weight gguf.dequantize's float32 product of D and a small integer: its grid value times a sign,
# IQ1_S's grid value plus its delta of 1/8 times 8): inputs per D. Where a tensor's weights are not D q the
# loader dequantizes it to float32 as transformers does. (IQ1_M holds no d field: float32.)
CODES8 = {"IQ2_XXS": 32, "IQ3_XXS": 32, "IQ3_S": 32, "IQ1_S": 32, "TQ1_0": 32, "TQ2_0": 32, "IQ2_XS": 16, "IQ2_S": 16}
# IQ4_NL / IQ4_XS's sixteen 4-bit code values (gguf.quants.IQ4_NL.kvalues)
IQ4_VALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), dtype=np.int8)


def gguf_file(path) -> Path | None:
    """The GGUF file ``path`` names: itself when it ends in .gguf, the one .gguf of a folder
    without config.json; None otherwise. A folder with several .gguf files is a ValueError."""
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"model.path names a GGUF file that does not exist: {p}")
        return p
    if p.is_dir() and not (p / "config.json").exists():
        found = sorted(p.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"model.path {p} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}): "
                             "name one of them")
        return found[0] if found else None
    return None


def model_config(path, cache_dir: Path | None = None):
    """The transformers config of ``path``: a GGUF file's (kept in ``metadata_dir`` by an earlier
    load, else read by transformers' GGUF reader) or a folder's config.json."""
    from transformers import AutoConfig

    file = gguf_file(path)
    if file is None:
        return AutoConfig.from_pretrained(path)
    meta = metadata_dir(file, cache_dir) if cache_dir is not None else None
    if meta is not None and (meta / "config.json").is_file():
        return AutoConfig.from_pretrained(meta)
    return AutoConfig.from_pretrained(file.parent, gguf_file=file.name)


def blocks_of(data: np.ndarray, kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K / 2] uint8, d [N, B] float32, c [N, B] float32) of a Q4_0 / Q4_1 tensor's bytes, in
    lp.kernels.exact4's layout (byte j of a block: weight j in its low nibble, weight j + 16 in its
    high one, as GGUF stores them), with w = fma(q, d, c) the weight gguf.dequantize computes."""
    d_off, m_off, q_off, size = LAYOUTS[kind]
    raw = np.ascontiguousarray(data).reshape(n, k // BLOCK, size)
    d = raw[..., d_off:d_off + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    if m_off is None:
        c = -8.0 * d  # exact: a power of two times a float16 value
    else:
        c = raw[..., m_off:m_off + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = raw[..., q_off:q_off + 16].reshape(n, k // 2)
    return torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(c)


def blocks_q4k(data: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, c) in exact4's layout of a Q4_K tensor: super-blocks of 256 weights with float16 d
    and dmin and eight 6-bit (scale, min) pairs, one per 32 weights. gguf.dequantize computes
    (d * scale) * q - dmin * min in float32: d * scale (11 x 6 bits) and dmin * min are exact, so
    is their product with a 4-bit q, and the subtraction rounds once, which is the kernel's
    fma(q, D, -M) with D = d * scale and M = dmin * min per 32 weights."""
    nb = k // SUPER
    raw = np.ascontiguousarray(data).reshape(n, nb, 144)
    d, dmin = _f16(raw[..., 0:2]), _f16(raw[..., 2:4])
    sc, mn = _scale_min(raw[..., 4:16])
    big_d = (d[..., None] * sc).reshape(n, nb * 8)
    big_m = (dmin[..., None] * mn).reshape(n, nb * 8)
    qs = raw[..., 16:144].reshape(n, nb, 4, 32)
    v = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb * 8, 32)  # sub-blocks 2j (low), 2j + 1 (high)
    q = (v[..., :16] | (v[..., 16:] << 4)).reshape(n, k // 2)
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(big_d), torch.from_numpy(-big_m)


def _scale_min(raw12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's eight 6-bit (scale, min) pairs of a super-block's 12 bytes, as float32."""
    s = raw12.reshape(*raw12.shape[:-1], 3, 4)
    lo6, hi6, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([lo6 & 0x3F, (mix & 0x0F) | ((lo6 >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([hi6 & 0x3F, (mix >> 4) | ((hi6 >> 2) & 0x30)], axis=-1).astype(np.float32)
    return sc, mn


def _f16(raw: np.ndarray) -> np.ndarray:
    """float32 of the float16 held in a trailing axis of 2 bytes."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def blocks8x_of(data: np.ndarray, kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, D [N, K / 16], C [N, K / 16] float32) of a Q6_K, Q5_K or Q5_1 tensor, with
    fma(q, D, C) the weight gguf.dequantize computes: Q6_K (d * scale) * q (q - 32 in -32..31, a
    signed 8-bit scale per 16; C = -0.0 keeps a zero product's sign); Q5_K (d * scale) * q - dmin *
    min per 32 (as Q4_K, 5-bit q); Q5_1 d * q + m per 32. Each D * q is exact (at most 11 + 7 + 5
    significant bits), so the one rounding is dequantize's."""
    size, per, _ = KEPT[kind]
    raw = np.ascontiguousarray(data).reshape(n * (k // per), size)
    if kind == "Q6_K":
        ql, qh, scales, d = raw[:, :128], raw[:, 128:192], raw[:, 192:208], _f16(raw[:, 208:210])
        big_d = d[:, None] * scales.view(np.int8).astype(np.float32)  # [blocks, 16]
        lo = ((ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)
        hi = ((qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03).reshape(-1, 8, 32)
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
        big_c = np.full_like(big_d, -0.0)
    elif kind == "Q5_K":
        d, dmin = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
        sc, mn = _scale_min(raw[:, 4:16])
        qh, qs = raw[:, 16:48], raw[:, 48:176]
        lo = ((qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)
        hi = ((qh.reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 0x01).reshape(-1, 8, 32)
        q = (lo | (hi << 4)).astype(np.int8)
        big_d = np.repeat(d[:, None] * sc, 2, axis=1)
        big_c = np.repeat(-(dmin[:, None] * mn), 2, axis=1)
    elif kind == "Q2_K":  # 16 scale bytes (scale | min << 4 per 16), 64 bytes of 2-bit q, d, dmin
        scales, qs, d, dmin = raw[:, :16], raw[:, 16:80], _f16(raw[:, 80:82]), _f16(raw[:, 82:84])
        big_d = d[:, None] * (scales & 0x0F).astype(np.float32)
        big_c = -(dmin[:, None] * (scales >> 4).astype(np.float32))
        q = ((qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03)
        q = q.reshape(-1, 16, 16).astype(np.int8)
    elif kind == "Q3_K":  # 32 bytes of high-bit masks, 64 of 2-bit q, 12 of 6-bit scales, d: (d * (s - 32)) * q
        hmask, qs, d = raw[:, :32], raw[:, 32:96], _f16(raw[:, 108:110])
        big_d = d[:, None] * _q3k_scales(raw[:, 96:108]).astype(np.float32)
        ql = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(-1, 16, 16) & 0x03
        qh = (hmask.reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).reshape(-1, 16, 16) & 0x01
        q = ql.astype(np.int8) - ((qh ^ 1) << 2).astype(np.int8)  # the 4 subtracted where the mask bit is 0
        big_c = np.full_like(big_d, -0.0)
    else:  # Q5_1: d, m, 4 bytes of high bits (bit i for weight i), then weight j | weight j + 16 << 4
        d, m = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
        qh = raw[:, 4:8].copy().view("<u4")[:, 0]
        high = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        low = np.concatenate([raw[:, 8:24] & 0x0F, raw[:, 8:24] >> 4], axis=-1)
        q = (low | (high << 4)).astype(np.int8)
        big_d, big_c = np.repeat(d[:, None], 2, axis=1), np.repeat(m[:, None], 2, axis=1)
    return (torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
            torch.from_numpy(np.ascontiguousarray(big_d, dtype=np.float32).reshape(n, k // 16)),
            torch.from_numpy(np.ascontiguousarray(big_c, dtype=np.float32).reshape(n, k // 16)))


def _q3k_scales(sc: np.ndarray) -> np.ndarray:
    """Q3_K's sixteen 6-bit scales of each super-block (its 12 scale bytes [blocks, 12]), minus 32: int8 [blocks, 16]."""
    lo = (sc[:, None, :8] >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
    hi = (sc[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(-1, 16)
    return ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(np.int8) - np.int8(32)


def blocks8_of(data: np.ndarray, kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, d [N, K / 32] float32) of a Q8_0, Q5_0, IQ4_NL or IQ4_XS tensor, w = q * d
    exactly as gguf.dequantize computes it (d * x, x an int8, Q5_0's 5-bit value minus 16 or an
    IQ4 code's value; IQ4_XS's d * (6-bit scale - 32) per 32 is exact, 11 + 5 bits, and so is its
    product with a value of 7 bits)."""
    size = KEPT[kind][0]
    if kind == "IQ4_XS":
        raw = np.ascontiguousarray(data).reshape(n * (k // SUPER), size)
        d = _f16(raw[:, 0:2])
        high = raw[:, 2:4].copy().view("<u2")[:, 0]
        low = (raw[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(-1, 8) & 0x0F
        high = ((high[:, None] >> (2 * np.arange(8, dtype=np.uint16))[None, :]).astype(np.uint8)) & 0x03
        scale = (low | (high << 4)).astype(np.int8) - np.int8(32)
        dl = d[:, None] * scale.astype(np.float32)  # [super-blocks, 8]
        codes = (raw[:, 8:].reshape(-1, 8, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        q = IQ4_VALUES[codes.reshape(-1, 8, 32)]
        return (torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
                torch.from_numpy(np.ascontiguousarray(dl, dtype=np.float32).reshape(n, k // BLOCK)))
    raw = np.ascontiguousarray(data).reshape(n, k // BLOCK, size)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = raw[..., 2:34].copy().view(np.int8)
    elif kind == "IQ4_NL":  # d, then code j | code j + 16 << 4
        q = IQ4_VALUES[np.concatenate([raw[..., 2:18] & 0x0F, raw[..., 2:18] >> 4], axis=-1)]
    else:  # Q5_0: its unsigned 5-bit codes minus 16
        q = (_q5_codes(raw) - np.uint8(16)).view(np.int8)
    return torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)), torch.from_numpy(d)


def codes8_of(data: np.ndarray, kind: str, n: int, k: int) -> tuple | None:
    """A ``CODES8`` tensor [N, K] as int8 codes with its file's scales: (q int8 [N, K], D float32 [N, K / 32])
    for the per-32 formats (what ``blocks8_of`` gives for Q8_0), (q, D, C = -0.0) [N, K / 16] for IQ2_XS / IQ2_S
    (``blocks8x_of``'s form); None where the bytes are not N x K of ``kind`` or some weight is not D q with
    |q| <= 127 (then: float32)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    qtype = GGMLQuantizationType[kind]
    per_block, size = GGML_QUANT_SIZES[qtype]
    if k % per_block or data.size != n * k // per_block * size:
        return None
    raw = np.ascontiguousarray(data).reshape(n * (k // per_block), size)
    f32 = np.float32
    if kind in ("TQ1_0", "TQ2_0"):  # one d a block of 256, at its end
        d = _f16(raw[:, size - 2:size])
        D = np.repeat(d[:, None], 8, axis=1)
    else:
        d = _f16(raw[:, 0:2])[:, None]
        if kind in ("IQ2_XXS", "IQ3_XXS"):  # the top 4 bits of each 32's uint32 (IQ2_XXS: its second word)
            words = raw[:, 2:66].copy().view("<u4")[:, 1::2] if kind == "IQ2_XXS" else raw[:, 66:98].copy().view("<u4")
            ls = (words >> 28).astype(f32)
            D = d * (f32(0.5) + ls) * (f32(0.25) if kind == "IQ2_XXS" else f32(0.5))
        elif kind == "IQ3_S":  # a nibble a 32, low first
            sc = (raw[:, 106:110, None] >> np.array([0, 4], dtype=np.uint8)).reshape(-1, 8) & 0x0F
            D = d * (1 + 2 * sc.astype(f32))
        elif kind == "IQ1_S":  # per 32: d (2 ((qh >> 12) & 7) + 1), the weights (grid + delta) in eighths
            qh = raw[:, 34:50].copy().view("<u2")
            D = d * (2 * ((qh >> 12) & 7).astype(f32) + 1) / f32(8)
        else:  # IQ2_XS / IQ2_S: a nibble a 16, low first
            off = 66 if kind == "IQ2_XS" else 74
            sc = (raw[:, off:off + 8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(-1, 16) & 0x0F
            D = d * (f32(0.5) + sc.astype(f32)) * f32(0.25)
    per = CODES8[kind]
    D = np.ascontiguousarray(D, dtype=f32).reshape(n, k // per)
    w = dequantize(np.ascontiguousarray(data).reshape(-1), qtype).reshape(n, k).astype(f32, copy=False)
    wide = np.repeat(D, per, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(wide != 0, np.rint(w / np.where(wide != 0, wide, 1)), 0)
    if np.abs(q).max(initial=0) > 127 or not np.array_equal(wide * q.astype(f32), w):
        return None
    q8 = torch.from_numpy(q.astype(np.int8))
    if per == 32:
        return q8, torch.from_numpy(D)
    return q8, torch.from_numpy(D), torch.full(D.shape, -0.0)


def _q5_codes(raw: np.ndarray) -> np.ndarray:
    """The unsigned 5-bit codes uint8 [..., 32] of Q5_0 blocks [..., 22 bytes]: 4 bytes of high bits
    (bit i of the little-endian word for weight i), then weight j | weight j + 16 << 4."""
    high = np.unpackbits(raw[..., 2:6], axis=-1, bitorder="little")  # [..., 32]: bit i of byte i // 8 = weight i
    low = np.concatenate([raw[..., 6:22] & 0x0F, raw[..., 6:22] >> 4], axis=-1)
    return low | (high << 4)


def blocksq_of(data: np.ndarray, kind: str, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """A Q5_0, Q5_1, Q4_K, Q5_K or Q6_K tensor's codes as lp.kernels.exactq's parts (its module
    doc): the unsigned q [N, K] uint8 and the scales as the file codes them, so that widenq (and
    the kernel) give gguf.dequantize's float32 weights bit for bit. A Q3_K tensor gives Q6_K's
    parts (``QKINDS``): u = q + 32, sc = its 6-bit scale - 32, its d."""
    size, per, _ = KEPT[kind]
    raw = np.ascontiguousarray(data).reshape(n * (k // per), size)
    if kind in ("Q5_0", "Q5_1"):
        if kind == "Q5_0":
            blocks = raw.reshape(n, k // BLOCK, size)
            q = _q5_codes(blocks)
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            parts = (d, -16.0 * d)  # exact: a power of two times a float16 value
        else:
            q8, big_d, big_c = blocks8x_of(data, kind, n, k)
            q = q8.numpy().astype(np.uint8)
            parts = (big_d.numpy()[:, ::2], big_c.numpy()[:, ::2])
        return (torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
                *(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32).reshape(n, k // BLOCK)) for x in parts))
    d = _f16(raw[:, 208:210]) if kind == "Q6_K" else (_f16(raw[:, 108:110]) if kind == "Q3_K" else _f16(raw[:, 0:2]))
    if kind in ("Q6_K", "Q3_K"):
        q8 = blocks8x_of(data, kind, n, k)[0].numpy()
        q = (q8.astype(np.int16) + 32).astype(np.uint8)
        sc = raw[:, 192:208].copy().view(np.int8) if kind == "Q6_K" else _q3k_scales(raw[:, 96:108])
        return (torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
                torch.from_numpy(np.ascontiguousarray(sc).reshape(n, k // 16)),
                torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32).reshape(n, k // SUPER)))
    sc, mn = _scale_min(raw[:, 4:16])
    nm = -_f16(raw[:, 2:4])
    if kind == "Q4_K":
        qs = raw[:, 16:144].reshape(-1, 4, 32)
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # sub-blocks 2j (low), 2j + 1 (high)
    else:
        q = blocks8x_of(data, kind, n, k)[0].numpy().astype(np.uint8)
    return (torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8).reshape(n, k)),
            torch.from_numpy(np.ascontiguousarray(sc, dtype=np.uint8).reshape(n, k // BLOCK)),
            torch.from_numpy(np.ascontiguousarray(mn, dtype=np.uint8).reshape(n, k // BLOCK)),
            torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32).reshape(n, k // SUPER)),
            torch.from_numpy(np.ascontiguousarray(nm, dtype=np.float32).reshape(n, k // SUPER)))


def _row_permutation(processor, name: str, n: int, mapping: dict, parsed: dict) -> np.ndarray | None:
    """The rows the tensor processor puts where (a llama q/k un-permutation), or None when it does
    more than move whole rows (then the tensor is dequantized like any other)."""
    probe = np.arange(n, dtype=np.float64)[:, None]
    out = processor.process(weights=probe, name=name, tensor_key_mapping=mapping, parsed_parameters=parsed)
    if out.name != name or out.weights.shape != probe.shape:
        return None
    rows = np.asarray(out.weights)[:, 0]
    if not np.array_equal(np.sort(rows), probe[:, 0]):
        return None
    return rows.astype(np.int64)


class FileTensor:
    """One tensor of a GGUF file: ``name``, ``tensor_type`` (gguf's GGMLQuantizationType) and
    ``data``, its bytes mapped from the file as uint8 [*reversed(dims[1:]), bytes of a row], the
    shape gguf.dequantize reads (F32 / F16 rows view as their floats)."""

    __slots__ = ("name", "tensor_type", "data")

    def __init__(self, name, tensor_type, data):
        self.name, self.tensor_type, self.data = name, tensor_type, data


def file_tensors(file: Path) -> list[FileTensor]:
    """The tensors of a GGUF file (format v2 / v3), read from its header alone: the key-value fields
    are skipped, not parsed. gguf.GGUFReader parses every field into numpy views, one per string of
    a tokenizer's vocabulary: for Gemma-3's 262,144 tokens 8.6 s and 685 MB, freed only after the
    load's peak; this reads the same tensor index in a fraction of a second."""
    return _read_header(file)[1]


def file_fields(file: Path, keys) -> dict:
    """The values of the GGUF file's string and scalar fields named in ``keys`` (those present), read
    as ``file_tensors`` reads the index: every other field skipped."""
    return _read_header(file, frozenset(keys))[0]


def _read_header(file: Path, keys: frozenset = frozenset()) -> tuple[dict, list[FileTensor]]:
    """(the wanted string / scalar fields, the tensors) of a GGUF file's header."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mm = np.memmap(file, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        out = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return out[0] if len(out) == 1 else out

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def skip(kind: int):
        nonlocal pos
        if kind == 8:
            n = take("Q")  # read before the add: take moves pos
            pos += n
        elif kind == 9:
            inner, count = take("I"), take("Q")
            if inner in scalar:
                pos += count * struct.calcsize("<" + scalar[inner])
            else:
                for _ in range(count):
                    skip(inner)
        elif kind in scalar:
            pos += struct.calcsize("<" + scalar[kind])
        else:
            raise ValueError(f"{file}: a GGUF field of unknown value type {kind}")

    magic, version = take("4s"), None
    if magic != b"GGUF":
        raise ValueError(f"{file} is not a GGUF file (its first bytes are {magic!r})")
    version = take("I")
    if version not in (2, 3):
        raise ValueError(f"{file}: GGUF version {version}; lp reads versions 2 and 3")
    n_tensors, n_fields = take("Q"), take("Q")
    alignment = 32
    fields = {}
    for _ in range(n_fields):
        key, kind = string(), take("I")
        if key == "general.alignment" and kind == 4:
            alignment = take("I")
        elif key in keys and kind == 8:
            fields[key] = string()
        elif key in keys and kind in scalar:
            fields[key] = take(scalar[kind])
        else:
            skip(kind)
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, GGMLQuantizationType(take("I")), dims, take("Q")))
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, kind, dims, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        row = dims[0] // block * size
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        data = mm[start + offset:start + offset + rows * row]
        tensors.append(FileTensor(name, kind, data.reshape(*reversed(dims[1:]), row)))
    return fields, tensors


def metadata_dir(file: Path, cache_dir: Path) -> Path:
    """Where a GGUF file's metadata is kept once read (never its weights): ``cache_dir/gguf/<stem>-
    <size>-<mtime>``, holding the transformers config, the tokenizer and ``gguf.json`` (the
    architecture, the tensor processor's config and the GGUF -> transformers name map). Reading
    them through transformers parses the whole file (its tokenizer: ~590k fields for SmolLM2) a
    time each; a restart reads these small files instead."""
    st = file.stat()
    return Path(cache_dir) / "gguf" / f"{file.stem}-{st.st_size}-{st.st_mtime_ns}"


def _save_dir(target: Path, write) -> None:
    """``write(tmp)`` into a fresh folder, then renamed to ``target`` (another process's copy wins)."""
    import os
    import shutil

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(file: Path, dtype: torch.dtype | None = None, device: str = "cpu", quant: str = "auto",
              tokenizer: bool = True, cache_dir: Path | None = None):
    """(model, tokenizer or None) from a GGUF file (module doc). ``dtype``: the model's float dtype
    (None, ``model.dtype=auto``: float32, whose products the file's blocks give exactly); ``quant``:
    lp.model.quant's schemes, applied after loading (``auto`` runs the kept blocks on exact4);
    ``cache_dir``: where the file's metadata is kept (``metadata_dir``; None: read from the file).
    Stages: the model's config and empty modules, the file's tensors (kept as blocks or
    dequantized), then the quantization scheme and the embedding's and head's ends."""
    dev = torch.device(device)
    torch_dtype = torch.float32 if dtype is None else dtype
    keep = dev.type == "cpu" and quant in ("auto", "exact4") and torch_dtype == torch.float32
    kept_at = packed.path_for(metadata_dir(file, cache_dir), quant) if keep and cache_dir is not None else None
    model = packed.read(kept_at) if kept_at is not None else None
    built = model is None
    if model is not None:  # a restart: the model as the first load packed it (lp.model.packed)
        log.info("model.path=%s: the packed model kept by its first load (%s, %.0f MiB, mapped)", file, kept_at.name,
                 kept_at.stat().st_size / 2**20)
    else:
        model, info = _empty_model(file, cache_dir, tokenizer)
        ends = _ends(model) if keep else {}  # the embedding's and head's weight names -> their module
        file_blocks = _read_tensors(file, model, info, keep, ends)
        _finish(file, model, quant, dev, file_blocks, ends)
        if kept_at is not None and packed.write(model, kept_at):
            # served from the kept file from the first start on, as a restart is: its pages mapped, the
            # build's heap (its unpacked copies among it) freed below rather than left to fragment
            mapped = packed.read(kept_at)
            model = model if mapped is None else mapped
    if torch_dtype != torch.float32:
        model.to(torch_dtype)
    model.to(dev).eval()
    model._lp_gguf = str(file)
    model._lp_gguf_id = f"{file.name}:{file.stat().st_size}"  # lp.model.calibrate keys its t(Q) cache by it
    tok = gguf_tokenizer(file, cache_dir) if tokenizer else None
    if built:
        import gc

        gc.collect()  # the replaced linears and their unpacked codes sit in reference cycles (1B shape: ~650 MB)
    trim_heap()
    return model, tok


def _empty_model(file: Path, cache_dir: Path | None, tokenizer: bool):
    """(float32 model on the meta device, info: the file's architecture, config dict and GGUF -> HF
    tensor name map), read from the kept metadata when ``cache_dir`` holds it, else parsed from the
    file and kept there (with the tokenizer's files when ``tokenizer``)."""
    import json

    from transformers import AutoConfig

    meta = metadata_dir(file, cache_dir) if cache_dir is not None else None
    known = meta is not None and (meta / "gguf.json").is_file()
    if known:
        config = AutoConfig.from_pretrained(meta)
        info = json.loads((meta / "gguf.json").read_text())
    else:
        with _parsed_once():
            return _first_read(file, meta, tokenizer)
    return _meta_model(file, config), info


def _first_read(file: Path, meta: Path | None, tokenizer: bool):
    """``_empty_model`` for a file read the first time: its config and name map (and tokenizer) parsed,
    then kept in ``meta``."""
    import json

    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    model = _meta_model(file, config)
    # the tensor processors read the config transformers parsed (the same keys as config.json);
    # not load_gguf_checkpoint's second parse of the whole file
    arch = file_fields(file, ("general.architecture",)).get("general.architecture")
    if arch is None:
        raise ValueError(f"{file}: no general.architecture field")
    info = {"arch": arch, "config": config.to_dict()}
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=info["config"])
    info["mapping"] = get_gguf_hf_weights_map(model, processor)
    if meta is not None:
        def write(tmp: Path) -> None:
            config.save_pretrained(tmp)
            (tmp / "gguf.json").write_text(json.dumps(info, default=str))
            if tokenizer:
                _file_tokenizer(file).save_pretrained(tmp)
                keep_tokenizer(None, tmp)  # a restart loads its tokenizer.json as it is (lp.model.tokenizer)

        _save_dir(meta, write)
    return model, info


def _meta_model(file: Path, config):
    """The float32 model of ``config`` with its weights on the meta device (sdpa attention, else eager)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        try:
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        except ValueError:  # a family without sdpa (Gemma 2's soft-capped attention): its eager kernel
            log.info("%s: transformers has no sdpa attention for %s; eager", file.name, type(config).__name__)
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")


@contextlib.contextmanager
def _parsed_once():
    """transformers' legacy GGUF parse (``load_gguf_checkpoint`` without tensors: every field of the file,
    each string of the vocabulary a numpy view; Gemma-3-270M ~16 s) run once for a file while a first
    read needs it twice (the config, then the tokenizer's model type), each caller given its own copy
    of the config; transformers' function is back in place on exit."""
    import copy

    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    real, seen = hf_gguf.load_gguf_checkpoint, {}

    def once(path, return_tensors=False, model_to_load=None, torch_dtype=None):
        if return_tensors or model_to_load is not None or torch_dtype is not None:
            return real(path, return_tensors, model_to_load, torch_dtype)
        key = os.path.realpath(path)
        if key not in seen:
            seen[key] = real(path, return_tensors=False)
        return {**seen[key], "config": copy.deepcopy(seen[key]["config"])}  # the part its callers read and change

    hf_gguf.load_gguf_checkpoint = once
    try:
        yield
    finally:
        hf_gguf.load_gguf_checkpoint = real


def _read_tensors(file: Path, model, info: dict, keep: bool, ends: dict) -> dict:
    """Every tensor of the file into ``model``: with ``keep``, a decoder linear's KEPT blocks go on
    the module as they are stored (rows in transformers' order; read by lp.kernels.exact4.convert)
    and the embedding's and head's into the returned {hf name: blocks}; the rest dequantized and
    processed as transformers' GGUF loader does."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from lp.kernels.exact4 import Staged

    parsed = {"config": info["config"], "tensors": {}}  # what the tensor processors may read
    processor = TENSOR_PROCESSORS.get(info["arch"], TensorProcessor)(config=info["config"])
    mapping = info["mapping"]
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    file_blocks: dict = {}
    kept = dequantized = 0
    qkinds, qhead = _coded_formats(keep)
    for t in file_tensors(file):
        kind = t.tensor_type.name
        hf = mapping.get(t.name)
        owner = modules.get(hf.rsplit(".", 1)[0]) if hf else None
        if hf in ends and kind in KEPT:
            n, k = ends[hf].weight.shape
            size, per, bits = KEPT[kind]
            if k % per == 0 and t.data.size == n * k // per * size:
                file_blocks[hf] = (QParts(QKINDS[kind], blocksq_of(t.data, kind, n, k)) if kind in qhead
                                   else _read_blocks(t.data, kind, n, k, bits))
                kept += 1
                continue
        if keep and hf in ends and kind in CODES8:  # a codebook embedding / head: int8 codes, the file's scales
            codes = codes8_of(t.data, kind, *ends[hf].weight.shape)
            if codes is not None:
                file_blocks[hf] = codes
                kept += 1
                continue
        if (keep and kind in KEPT and hf.endswith(".weight") and type(owner) is torch.nn.Linear
                and owner is not head and owner.in_features % KEPT[kind][1] == 0):
            n, k = owner.out_features, owner.in_features
            size, per, bits = KEPT[kind]
            rows = _row_permutation(processor, t.name, n, mapping, parsed)
            if rows is not None and t.data.size == n * k // per * size:
                # the rows moved as the file's bytes (a row's blocks are its own), before any unpacking
                data = t.data if np.array_equal(rows, np.arange(n)) else t.data.reshape(n, -1)[rows]
                # staged as the file's bytes, unpacked when a kernel's maker reads them (lp.kernels.exact4.Staged)
                if kind in qkinds:  # lp.kernels.exactq / idot: the file's codes, at about its size
                    owner._lp_blocksq = Staged(lambda q=qkinds[kind], a=(data, kind, n, k): (q, blocksq_of(*a)))
                    kept += 1
                    continue
                unpack = lambda a=(data, kind, n, k, bits): _read_blocks(*a)  # noqa: E731
                if bits == 16:
                    owner._lp_weight16 = Staged(lambda f=unpack: f()[0])
                elif bits == 8:
                    owner._lp_blocks8 = Staged(unpack)
                else:
                    owner._lp_blocks = Staged(unpack)
                kept += 1
                continue
        if keep and kind in CODES8 and hf and hf.endswith(".weight") and type(owner) is torch.nn.Linear and owner is not head:
            codes = _codebook_linear(t, owner, processor, mapping, parsed)  # Exact8 / idot kinds
            if codes is not None:
                owner._lp_blocks8 = codes
                kept += 1
                continue
        weights = dequantize(t.data, t.tensor_type)
        out = processor.process(weights=weights, name=t.name, tensor_key_mapping=mapping, parsed_parameters=parsed)
        hf = mapping.get(out.name)
        if hf is None:
            continue
        _assign(model, hf, torch.from_numpy(np.copy(out.weights)))
        dequantized += 1
    model.tie_weights()
    log.info("model.path=%s: %d tensors kept as their blocks (%s), %d dequantized to float32 (as "
             "transformers' GGUF loader does)", file, kept, " / ".join(KEPT), dequantized)
    return file_blocks


def _coded_formats(keep: bool) -> tuple[dict, tuple]:
    """(the formats a decoder linear keeps as exactq / idot parts: format -> kind, the embedding / head formats
    held as such parts) on this CPU."""
    qkinds, qhead = dict(QKINDS), QHEAD
    if keep:
        from lp.kernels import idot
        from lp.kernels.exact4 import extension

        if idot.available():  # Q4_K as its codes too: idot runs them at 4.75 bits a weight, faster than exact4
            qkinds["Q4_K"] = KINDS["Q4_K"]
            if not extension().avx512():  # a Q5_1 / Q5_K head as codes too: idot's head takes them (_block_head)
                qhead = QHEAD + ("Q5_1", "Q5_K")
    return qkinds, qhead


def _codebook_linear(t: FileTensor, owner, processor, mapping: dict, parsed: dict) -> tuple | None:
    """A decoder linear's ``CODES8`` tensor as ``codes8_of``'s int8 codes and scales, its rows where the tensor
    processor puts them (moved as the file's bytes, as the KEPT formats' are); None: dequantize it."""
    n, k = owner.out_features, owner.in_features
    rows = _row_permutation(processor, t.name, n, mapping, parsed)
    if rows is None or t.data.size % n:
        return None
    data = t.data if np.array_equal(rows, np.arange(n)) else t.data.reshape(n, -1)[rows]
    return codes8_of(data, t.tensor_type.name, n, k)


def _finish(file: Path, model, quant: str, dev: torch.device, file_blocks: dict, ends: dict) -> None:
    """The quantization scheme over the loaded model, the embedding and head from their blocks,
    blocks no kernel took widened to float32; a ValueError where a weight was never read."""
    scheme = "none"
    if quant != "none":
        from lp.model.quant import quantize

        scheme = quantize(model, quant, dev)
    _ends_from_blocks(model, file_blocks, ends, exact=scheme == "exact4")
    widened = _widen_left(model)
    if widened:
        log.info("model.quant=%s: %d linears' blocks widened to float32 (the weights transformers' GGUF loader "
                 "makes)", scheme, widened)
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise ValueError(f"{file}: the GGUF file holds no tensor for {missing[:4]}{' ...' if len(missing) > 4 else ''}: "
                         "transformers' GGUF name map does not cover this model")


# llama-server's template for a file that holds none (llama.cpp common/chat.cpp, CHATML_TEMPLATE_SRC)
CHATML = ("{%- for message in messages -%}\n"
          "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
          "{%- endfor -%}\n"
          "{%- if add_generation_prompt -%}\n"
          "  {{- '<|im_start|>assistant\\n' -}}\n"
          "{%- endif -%}")


def gguf_tokenizer(file: Path, cache_dir: Path | None = None):
    """The file's tokenizer through transformers' GGUF reader, with the file's own chat template
    (``tokenizer.chat_template``) where that reader leaves it unset; read from ``metadata_dir``
    where an earlier load kept it. A file that holds no template (a base model's) gets ChatML,
    the template llama-server falls back to there, with a warning saying so
    (``model.chat_template`` replaces it): the same chat prompts as llama.cpp's users get, not a 400."""
    tok = _file_tokenizer(file, cache_dir)
    if not getattr(tok, "chat_template", None):
        log.warning("%s holds no chat template (tokenizer.chat_template): chat requests use ChatML, the template "
                    "llama-server falls back to (model.chat_template=<file.jinja> gives the model its own)", file.name)
        tok.chat_template = CHATML
    return tok


def _file_tokenizer(file: Path, cache_dir: Path | None = None):
    """``gguf_tokenizer`` without the fallback template (what ``metadata_dir`` keeps)."""
    from transformers import AutoTokenizer

    meta = metadata_dir(file, cache_dir) if cache_dir is not None else None
    if meta is not None and (meta / "tokenizer_config.json").is_file():
        return load_kept(meta)
    tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    if not getattr(tok, "chat_template", None):
        template = file_fields(file, ("tokenizer.chat_template",)).get("tokenizer.chat_template")
        if template is not None:
            tok.chat_template = template
    if meta is not None and meta.is_dir():  # kept by a load without the tokenizer: add it (5 s saved a start)
        import os
        import shutil

        tmp = meta.with_name(meta.name + f".tok{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "tokenizer_config.json"):  # the marker last
            os.replace(f, meta / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
        keep_tokenizer(None, meta)
    return tok


def _read_blocks(data: np.ndarray, kind: str, n: int, k: int, bits: int) -> tuple:
    """A kept tensor's blocks in lp.kernels.exact4's layouts: (q nibbles, d, c) for 4-bit kinds,
    (q, d) or (q, D, C) 8-bit ones."""
    if bits == 16:  # the stored floats, as they are
        w = torch.from_numpy(np.ascontiguousarray(data).view(np.int16).reshape(n, k).copy())
        return (w.view(torch.bfloat16 if kind == "BF16" else torch.float16),)
    if bits == 4:
        return blocks_q4k(data, n, k) if kind == "Q4_K" else blocks_of(data, kind, n, k)
    return blocks8_of(data, kind, n, k) if kind in SCALED8 else blocks8x_of(data, kind, n, k)


# token embeddings whose forward is a row lookup (times ``embed_scale`` for the scaled ones)
EMBEDDINGS = ("Embedding", "Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding")  # same forward: rows x embed_scale


def _ends(model) -> dict:
    """The weight names of the token embedding and the LM head that may stay blocks -> their module:
    an ``EMBEDDINGS`` embedding, a bias-free linear head."""
    ends = {}
    names = {id(m): name for name, m in model.named_modules()}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(emb).__name__ in EMBEDDINGS and isinstance(emb, torch.nn.Embedding):
        ends[f"{names[id(emb)]}.weight"] = emb
    if type(head) is torch.nn.Linear and head.bias is None and id(head) in names:
        ends[f"{names[id(head)]}.weight"] = head
    return ends


def _ends_from_blocks(model, file_blocks: dict, ends: dict, exact: bool) -> None:
    """The embedding and head read as blocks: under exact4 (``exact``) swapped for lp.kernels.exact4's
    ``BlockEmbedding`` / ``BlockHead`` (a tied pair sharing one packed copy), else given the float32
    weights those blocks widen to (tied again)."""
    from lp.kernels.exact4 import BlockEmbedding, widen, widen8
    from lp.kernels.exactq import widenq

    if not file_blocks:
        return
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {m: n for n, m in ends.items()}
    emb_name, head_name = names.get(emb), names.get(head)
    tied = head is not None and emb is not None and head.weight is emb.weight
    if not exact:
        for hf, parts in file_blocks.items():
            w = (widenq(*parts) if isinstance(parts, QParts) else parts[0].float() if len(parts) == 1
                 else widen8(*parts) if parts[0].dtype == torch.int8 else widen(*parts))
            ends[hf].weight = torch.nn.Parameter(w, requires_grad=False)
        if tied:
            head.weight = emb.weight
        return
    block_head = None
    if head_name in file_blocks or (tied and emb_name in file_blocks):
        block_head = _block_head(file_blocks[head_name if head_name in file_blocks else emb_name])
        model.set_output_embeddings(block_head)
    if emb_name in file_blocks:
        source = block_head if tied and block_head is not None else _block_head(file_blocks[emb_name], screen=False)
        model.set_input_embeddings(BlockEmbedding(source, getattr(emb, "embed_scale", None)))
    log.info("model.quant=exact4: the %s run on the file's blocks (no float32 copy)",
             " and ".join(w for w, on in (("embedding", emb_name in file_blocks), ("LM head", block_head is not None))
                          if on))
    file_blocks.clear()  # their unpacked codes: packed now
    trim_heap()


def _block_head(parts, screen: bool = True):
    """The head (or embedding source) over a file tensor's blocks: lp.kernels.idot's ``IBlockHead``
    (the file's codes as stored, its greedy screen on them) for ``QParts`` (Q5_x, Q6_K: exactq's
    ``QBlockHead`` held them as bytes, Q6_K with an int8 screen beside them: two bytes a weight) and,
    on a CPU without AVX-512 (where exact4's kernels run a scalar loop), for every format idot takes;
    else lp.kernels.exact4's ``BlockHead`` over its 8-bit (or 16-bit) form (Q8_0 / Q4_x: with AVX-512
    VNNI its int8 screen, measured faster at one row than idot's on SmolLM2's and Gemma-3's heads)."""
    from lp.kernels.exact4 import BlockHead, eight_bit, extension
    from lp.kernels.exactq import QBlockHead
    from lp.kernels.idot import IBlockHead

    if isinstance(parts, QParts) or not extension().avx512():
        head = IBlockHead.of(parts)  # None where idot does not run (LP_IDOT=0, no VNNI / AVX2) or takes other blocks
        if head is not None:
            return head
    return QBlockHead(parts, screen) if isinstance(parts, QParts) else BlockHead(eight_bit(parts), screen)


def _assign(model, hf: str, value: torch.Tensor) -> None:
    """Parameter or buffer ``hf`` of ``model`` set to ``value`` (float32), replacing a meta one."""
    owner_name, _, attr = hf.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    old = getattr(owner, attr)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"GGUF tensor for {hf} has shape {tuple(value.shape)}, the model expects {tuple(old.shape)}")
    if attr in owner._parameters:
        owner._parameters[attr] = torch.nn.Parameter(value.to(torch.float32), requires_grad=False)
    else:
        owner._buffers[attr] = value.to(old.dtype)


def _widen_left(model) -> int:
    """Every linear still holding file blocks (not run on exact4) gets their float32 weights."""
    from lp.kernels.exact4 import Staged, widen, widen8
    from lp.kernels.exactq import widenq

    count = 0
    for m in model.modules():
        blocks, blocks8, blocksq, w16 = (m.__dict__.pop(name, None) for name in
                                          ("_lp_blocks", "_lp_blocks8", "_lp_blocksq", "_lp_weight16"))
        blocks, blocks8, blocksq, w16 = (v.get() if isinstance(v, Staged) else v for v in (blocks, blocks8, blocksq, w16))
        if isinstance(m, torch.nn.Linear) and m.weight.is_meta and (blocks or blocks8 or blocksq or w16 is not None):
            w = (widen(*blocks) if blocks else widen8(*blocks8) if blocks8 else widenq(*blocksq) if blocksq
                 else w16.float())
            m.weight = torch.nn.Parameter(w, requires_grad=False)
            count += 1
    return count
