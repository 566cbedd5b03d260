"""Exact 4-bit weights (``model.quant=exact4``): linears whose float32 weights *are* 4-bit blocks
run a kernel that streams those blocks and forms every float32 weight from them exactly.

Contract: ``encode(w_NK)`` returns ``(q, d, c)`` (see ``csrc/lp_exact4.cpp`` for the layout) when
every weight of ``w_NK`` [out N, in K] is ``fma(q, d, c)`` of a 4-bit ``q`` and a per-block
(32 weights along K) pair of float16 values ``d``, ``c`` — checked bit for bit, in float32 and
through the kernel itself — else None. ``convert(model)`` replaces each group of sibling
linears (q/k/v, gate/up: ``lp.kernels.linears.FUSED``) whose weights all encode by one
``Exact4Linear`` (and each other float32 linear that encodes by its own; a bias is added after
the product, as ``F.linear`` adds it), leaves
the rest (the LM head, any linear that does not encode) as they are, and returns (linears
converted, linears left). Nothing is approximated: a weight that does not encode stays a
float32 ``nn.Linear``. The model's float32 weights are replaced (their bytes freed).

Why: a model shipped as a GGUF Q4_1 (or Q4_0) file and dequantized to float32 — lp's default
SmolLM2-135M-Instruct: every one of its 210 decoder linears is Q4_1, ``w = d * q + m`` per 32
weights with float16 ``d``, ``m`` — holds only 16 distinct values a block, yet a float32 matmul
streams 32 bits a weight, and batch-1 decoding on a CPU waits on those bytes. The same weights
as 4 bits plus 8 bytes a block are 5.3x fewer bytes. torch's own int4 CPU GEMM
(``aten._weight_int4pack_mm_for_cpu``) takes float32 inputs but measured 121 ms a SmolLM2 step
against 44 dense here, hence lp's kernel (``csrc/lp_exact4.cpp``, built once per machine with
torch's C++ extension loader, ~30 s): each weight ``fma(q, d, c)`` in float32 (``q * d`` is
exact, so the one rounding gives the checkpoint's weight), then the same multiply-adds as a
float32 matmul in another order. Each row's output depends on that row only (the same
operations whatever the row count), so lookahead == ``generate`` on the converted model, and
the products differ from the dense model's only by summation order, like any change of
kernel (lp.kernels.linears). Measured on a 2-vCPU Sapphire Rapids VM, SmolLM2's 30 layers of
linears, weights streamed from memory, both threads (the kernel's ``at::parallel_for`` is
OpenMP: built with ``-fopenmp``, else it runs on one thread): 1 row 9.3 ms vs 21.5 dense, 8 rows
13.8 vs 42.7, 16 rows 23.4 vs 49.0, 64 rows 74 vs 81 (compute-bound past a few rows).

How the blocks are found: per block, ``c`` = the block's minimum, ``d`` = float16 of (max - c) /
15, ``q`` = round((w - c) / d) clamped to 0..15 (Q4_1's own construction), and both must be
float16 values; then the checks above accept or reject the whole linear. CPU and float32 only.

Legend: N out features, K in features, M rows, B = K / 32 blocks.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from lp.kernels.build import build_extension
from lp.kernels.linears import SharedProduct, fuse_siblings, is_linear

log = logging.getLogger(__name__)

BLOCK = 32  # weights per (d, c) pair along K: Q4_0 / Q4_1's block


@functools.lru_cache(maxsize=1)
def extension():
    """The compiled kernel (``torch.ops.lp_exact4.mm``), built on first use and cached by torch
    (lp.kernels.build.build_extension); a ValueError naming what is missing when it cannot be built."""
    mod = build_extension("lp_exact4", "model.quant=exact4")
    torch.library.register_fake("lp_exact4::mm")(_mm_shape)
    torch.library.register_fake("lp_exact4::mm8")(_mm8_shape)
    torch.library.register_fake("lp_exact4::mm8x")(_mm8_shape)
    torch.library.register_fake("lp_exact4::mm16")(lambda x, p, n, bf16: x.new_empty(x.shape[0], n))
    torch.library.register_fake("lp_exact4::mmq")(lambda x, p, n, kind: x.new_empty(x.shape[0], n))
    torch.library.register_fake("lp_exact4::mmi")(lambda x, p, n, kind: x.new_empty(x.shape[0], n))
    torch.library.register_fake("lp_exact4::rms_norm")(lambda x, w, eps: torch.empty_like(x))
    return mod


def _mm_shape(x, p, n):
    return x.new_empty(x.shape[0], n)


def _mm8_shape(x, p, n):
    return x.new_empty(x.shape[0], n)


def pack(q: torch.Tensor, d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``encode``'s (q, d, c) in the kernel's layout: outputs in groups of 8, one 192-byte chunk
    per (group, block) (``csrc/lp_exact4.cpp``), a forward stream the kernel prefetches."""
    return extension().pack(q, d, c)


def mm(x_MK: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:
    """``x @ W.T`` [M, n] for float32 ``x`` [M, K] and W's blocks packed by ``pack``."""
    return torch.ops.lp_exact4.mm(x_MK, p, n)


def pack8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``encode8``'s (q, d) in the kernel's layout (288-byte chunks, as ``pack``)."""
    return extension().pack8(q, d)


def mm8(x_MK: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:
    """``x @ W.T`` [M, n] for float32 ``x`` [M, K] and W's 8-bit blocks packed by ``pack8``."""
    return torch.ops.lp_exact4.mm8(x_MK, p, n)


def pack8x(q: torch.Tensor, d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """8-bit blocks with a scale and an offset per 16 weights (q [N, K] int8, d, c [N, K / 16]
    float32; w = fma(q, d, c)) in the kernel's layout (384-byte chunks, as ``pack``)."""
    return extension().pack8x(q, d, c)


def pack16(w_NK: torch.Tensor) -> torch.Tensor:
    """bfloat16 or float16 weights [N, K] in the kernel's layout (512-byte chunks of 8 outputs x 32
    weights, as ``pack``): the weights as stored, widened to float32 in the kernel, exactly."""
    return extension().pack16(w_NK.contiguous())


def mm16(x_MK: torch.Tensor, p: torch.Tensor, n: int, bf16: bool) -> torch.Tensor:
    """``x @ W.T`` [M, n] for float32 ``x`` [M, K] and W's 16-bit weights packed by ``pack16``."""
    return torch.ops.lp_exact4.mm16(x_MK, p, n, bf16)


def mm8x(x_MK: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:
    """``x @ W.T`` [M, n] for float32 ``x`` [M, K] and W's blocks packed by ``pack8x``."""
    return torch.ops.lp_exact4.mm8x(x_MK, p, n)


def _blocks(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [N, B, 32], d [N, B], c [N, B]) in float32 with ``q * d + c == w`` bit for bit (the
    kernel's arithmetic in torch), or None; no kernel involved."""
    if w_NK.dtype != torch.float32 or w_NK.dim() != 2 or w_NK.device.type != "cpu":
        return None
    n, k = w_NK.shape
    if k % BLOCK or not torch.isfinite(w_NK).all():
        return None
    w_NBb = w_NK.reshape(n, k // BLOCK, BLOCK)
    c_NB = w_NBb.amin(dim=2)
    d_NB = ((w_NBb.amax(dim=2) - c_NB) / 15).half().float()
    if not torch.equal(c_NB.half().float(), c_NB) or not torch.isfinite(d_NB).all():
        return None  # not float16 values: no 4-bit block reproduces them
    safe_NB = torch.where(d_NB > 0, d_NB, torch.ones_like(d_NB))
    q_NBb = torch.round((w_NBb - c_NB[..., None]) / safe_NB[..., None]).clamp_(0, 15)
    # the kernel's weight, in float32: q * d is exact (4 x 11 significant bits), so adding c
    # rounds once, as the kernel's fused multiply-add does
    if not torch.equal(q_NBb * d_NB[..., None] + c_NB[..., None], w_NBb):
        return None
    return q_NBb, d_NB, c_NB


def has_blocks(model: nn.Module) -> bool:
    """Whether some float32 linear of ``model`` other than its head holds exact 4-bit
    blocks (the torch-side check of ``encode``, no kernel built): what ``model.quant=auto`` asks
    before it builds exact4's kernel. Stops at the first linear that does."""
    head = _head(model)
    return any(_plain(m) and m is not head and (getattr(m, "_lp_blocks", None) is not None
                                                or getattr(m, "_lp_blocks8", None) is not None
                                                or getattr(m, "_lp_blocksq", None) is not None
                                                or getattr(m, "_lp_weight16", None) is not None
                                                or (not m.weight.is_meta and _blocks(_local(m.weight.detach())) is not None))
               for m in model.modules())


def _head(model: nn.Module) -> nn.Module | None:
    """The LM head's linear (under lp.parallel.tp's quantized path a gathered head wraps its
    local shard as ``linear``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return getattr(head, "linear", head)


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel weight (a DTensor of lp.parallel.tp), else ``w``."""
    return w.to_local() if hasattr(w, "to_local") else w


def encode(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [N, K / 2] uint8, d [N, B] float32, c [N, B] float32) reproducing ``w_NK`` bit for bit
    through the kernel, or None (see module doc). The blocks are found by the kernel's own one-pass
    encoder (``lp_exact4.encode``: the arithmetic of ``encode_torch``, ~50x faster than its dozen
    whole-tensor passes; tests/test_exact4.py holds them equal)."""
    code = _found(w_NK)
    return code if code is not None and _kernel_reproduces(w_NK, pack(*code)) else None


def _found(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The one-pass encoder's blocks, not yet checked through the kernel (``encode`` checks them;
    ``convert`` checks a group of siblings once, stacked and packed as they will run)."""
    if w_NK.dtype != torch.float32 or w_NK.dim() != 2 or w_NK.device.type != "cpu" or w_NK.shape[1] % BLOCK:
        return None
    ok, q, d, c = extension().encode(w_NK.detach())
    return (q, d, c) if ok else None


def encode_torch(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``encode`` in torch ops (the reference the one-pass encoder is tested against)."""
    blocks = _blocks(w_NK)
    if blocks is None:
        return None
    q_NBb, d_NB, c_NB = blocks
    n, k = w_NK.shape
    qi = q_NBb.to(torch.uint8)
    q = (qi[..., :16] | (qi[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    d, c = d_NB.contiguous(), c_NB.contiguous()
    return (q, d, c) if _kernel_reproduces(w_NK, pack(q, d, c)) else None


def _unit_rows(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(columns idx, unit rows [len(idx), k] with a 1 at each): ~64 columns spread over every block."""
    step = max(1, k // 64)
    idx = (torch.arange(0, k, step) + torch.arange(len(range(0, k, step))) % BLOCK).clamp_(max=k - 1)
    unit_RK = torch.zeros(len(idx), k, dtype=torch.float32)
    unit_RK[torch.arange(len(idx)), idx] = 1.0
    return idx, unit_RK


def _kernel_reproduces(w_NK: torch.Tensor, p: torch.Tensor) -> bool:
    """The kernel itself on its packed blocks ``p`` and unit rows spread over every block
    (I[idx] @ W.T = W[:, idx].T, one product a column: exact): its layout and arithmetic, checked
    on these weights."""
    idx, unit_RK = _unit_rows(w_NK.shape[1])
    return torch.equal(mm(unit_RK, p, w_NK.shape[0]), w_NK[:, idx].t())


class Exact4Linear(nn.Module):
    """``y = x @ W.T`` for float32 ``x`` with W held as exact 4-bit blocks (``encode``); built from
    one bias-free linear or from siblings that read the same input (their blocks stacked along
    N, one kernel call; each sibling becomes a ``lp.kernels.linears.SharedInputPart``)."""

    def __init__(self, linears: list[nn.Linear], p: torch.Tensor):
        super().__init__()
        assert linears
        self.in_features = linears[0].in_features
        self.splits = [lin.out_features for lin in linears]
        self.out_features = sum(self.splits)
        self.register_buffer("p", p)  # the stacked blocks in the kernel's layout (``pack``)
        # the siblings' biases stacked (a bias-free sibling's zeros), added after the product as
        # F.linear adds it (x @ W.T + b, one rounding); None where no sibling has one
        biases = [lin.bias for lin in linears]
        b = None
        if any(bias is not None for bias in biases):
            b = torch.cat([torch.zeros(lin.out_features) if bias is None else bias.detach().float()
                           for lin, bias in zip(linears, biases)])
        self.register_buffer("b", b)
        self._share = SharedProduct(len(self.splits))

    @classmethod
    def of(cls, linears: list[nn.Linear]) -> "Exact4Linear | None":
        """The siblings' blocks stacked and packed once, checked through the kernel as they will
        run; None where any weight is not exact 4-bit blocks."""
        codes = [_code(lin) for lin in linears]
        if any(code is None for code in codes):
            return None
        p = pack(*(torch.cat([code[i] for code in codes]) for i in range(3)))
        w_NK = torch.cat([_weight(lin, code) for lin, code in zip(linears, codes)])
        return cls(linears, p) if _kernel_reproduces(w_NK, p) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x_MK = x.reshape(-1, self.in_features)
        if dtype != torch.float32:
            x_MK = x_MK.float()
        y_MN = self.kernel(x_MK, self.p, self.out_features)
        if self.b is not None:
            y_MN += self.b
        if dtype != torch.float32:
            y_MN = y_MN.to(dtype)
        return y_MN.reshape(*x.shape[:-1], self.out_features)

    def shared(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """The stacked product for ``x``, computed once for the parts that read it one after the
        other (lp.kernels.linears.SharedProduct)."""
        return self._share.get(x, part, self)

    kernel = staticmethod(lambda x_MK, p, n: mm(x_MK, p, n))
    bits = 4

    def extra_repr(self) -> str:
        fused = f", fused {self.splits}" if len(self.splits) > 1 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}{fused}, "
                f"exact {self.bits}-bit weights{', bias' if self.b is not None else ''}")


class Exact8Linear(Exact4Linear):
    """``y = x @ W.T`` for float32 ``x`` with W held as exact 8-bit blocks (``w = q * d``, q int8,
    one float32 d per 32 weights along K: a GGUF file's Q8_0 or Q5_0 blocks, lp.model.gguf's
    ``_lp_blocks8``), run by ``mm8`` (the head's kernel); siblings stacked as ``Exact4Linear``'s."""

    kernel = staticmethod(lambda x_MK, p, n: mm8(x_MK, p, n))
    bits = 8

    @classmethod
    def of(cls, linears: list[nn.Linear]) -> "Exact8Linear | None":
        """The siblings' 8-bit blocks stacked, packed and checked as they will run: all (q, d)
        (``mm8``) or all (q, d, c) per 16 weights (``Exact8xLinear``); None otherwise."""
        codes = [staged(lin, "_lp_blocks8") for lin in linears]
        if any(code is None for code in codes) or len({len(code) for code in codes}) != 1:
            return None
        parts = [torch.cat([code[i] for code in codes]) for i in range(len(codes[0]))]
        kind = cls if len(parts) == 2 else Exact8xLinear
        p = kind.pack(*parts)
        idx, unit_RK = _unit_rows(parts[0].shape[1])
        return kind(linears, p) if torch.equal(kind.kernel(unit_RK, p, parts[0].shape[0]), widen8(*parts)[:, idx].t()) else None

    pack = staticmethod(lambda q, d: pack8(q, d))


class Exact8xLinear(Exact8Linear):
    """``Exact8Linear`` with a scale and an offset per 16 weights, ``w = fma(q, d, c)`` (GGUF Q6_K,
    Q5_K, Q5_1: lp.model.gguf's three-part ``_lp_blocks8``), run by ``mm8x``."""

    kernel = staticmethod(lambda x_MK, p, n: mm8x(x_MK, p, n))
    pack = staticmethod(lambda q, d, c: pack8x(q, d, c))


def _weight16(lin: nn.Module) -> torch.Tensor | None:
    """A linear's 16-bit weights: as a GGUF file stores them (``_lp_weight16``), else its float32
    weight when every value of it is a bfloat16 (or else a float16) value, as a bf16 / fp16
    checkpoint loaded in float32 holds (the round trip checked bit for bit); None otherwise."""
    w16 = staged(lin, "_lp_weight16")
    if w16 is not None or lin.weight.is_meta:
        return w16
    w = lin.weight.detach()
    key = (w.data_ptr(), w._version)  # the check's answer is kept until the weight changes
    seen = getattr(lin, "_lp_weight16_of", None)
    if seen is not None and seen[0] == key:
        return seen[1]
    w16 = None
    if w.dtype == torch.float32 and w.dim() == 2 and w.device.type == "cpu" and not w.shape[1] % BLOCK and w.numel():
        for dtype in (torch.bfloat16, torch.float16):
            w16 = w.to(dtype)
            if torch.equal(w16.float(), w):  # -0.0, infs and nans compare as values: widen(w16) is w
                w16 = w16 if torch.equal(w16.float().view(torch.int32), w.view(torch.int32)) else None
                break
            w16 = None
    lin._lp_weight16_of = (key, w16)
    return w16


def has_16bit(model: nn.Module) -> bool:
    """Whether some float32 linear other than the head holds 16-bit floats (``_weight16``)."""
    head = _head(model)
    return any(_plain(m) and m is not head and _weight16(m) is not None for m in model.modules())


class Exact16Linear(Exact4Linear):
    """``y = x @ W.T`` for float32 ``x`` with W held as its 16-bit floats (a GGUF file's F16 / BF16
    tensor: lp.model.gguf's ``_lp_weight16``; a bf16 / fp16 checkpoint's weights loaded as float32:
    ``_weight16``), each widened to float32 in the kernel (exact), run by ``mm16`` in the same tiles
    and summation order as the block kinds: 2 bytes a weight, not 4."""

    bits = 16

    def __init__(self, linears: list[nn.Linear], p: torch.Tensor, bf16: bool):
        super().__init__(linears, p)
        self.bf16 = bf16

    def kernel(self, x_MK, p, n):
        return mm16(x_MK, p, n, self.bf16)

    @classmethod
    def of(cls, linears: list[nn.Linear]) -> "Exact16Linear | None":
        """The siblings' 16-bit weights stacked, packed and checked through the kernel on unit rows;
        None unless every sibling holds them, in one dtype."""
        ws = [_weight16(lin) for lin in linears]
        if any(w is None for w in ws) or len({w.dtype for w in ws}) != 1:
            return None
        w_NK = torch.cat(ws)
        p = pack16(w_NK)
        bf16 = w_NK.dtype == torch.bfloat16
        idx, unit_RK = _unit_rows(w_NK.shape[1])
        return cls(linears, p, bf16) if torch.equal(mm16(unit_RK, p, w_NK.shape[0], bf16), w_NK.float()[:, idx].t()) else None


def widen8(q: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights [N, K] of 8-bit blocks: q * d per 32 weights, exact (8 x 11 significant
    bits); with ``c`` (d and c per 16 weights) q * d + c, one rounding (q * d exact), as the
    kernel's fused multiply-add forms them."""
    n, k = q.shape
    if c is None:
        return (q.float().reshape(n, k // BLOCK, BLOCK) * d[..., None]).reshape(n, k)
    return (q.float().reshape(n, k // 16, 16) * d[..., None] + c[..., None]).reshape(n, k)


def _code(lin: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A linear's blocks: as a GGUF file stores them (``_lp_blocks``, set by lp.model.gguf: its
    weight is never formed), else found in its float32 weight."""
    blocks = staged(lin, "_lp_blocks")
    if blocks is not None or lin.weight.is_meta:  # a meta weight: a file's 8-bit blocks (Exact8Linear's)
        return blocks
    return _found(lin.weight.detach())


def _weight(lin: nn.Module, code) -> torch.Tensor:
    """The float32 weight the kernel must reproduce: the linear's own, or a file's blocks widened
    (q * d + c, one rounding: what gguf.dequantize computes), for the check alone."""
    if getattr(lin, "_lp_blocks", None) is None:
        return lin.weight.detach()
    return widen(*code)


def widen(q: torch.Tensor, d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] of (q, d, c) blocks in ``encode``'s layout: q * d (exact) + c,
    one rounding, as the kernel's fused multiply-add forms them."""
    n = q.shape[0]
    q_NBb = torch.cat([(q & 0xF).reshape(n, -1, 16), (q >> 4).reshape(n, -1, 16)], dim=2).float()
    return (q_NBb * d[..., None] + c[..., None]).reshape(n, -1)


def _plain(m) -> bool:
    """A float32 linear (with or without a bias): nn.Linear, or lp.kernels.linears' swap of one (a
    runner built on this model before shares its weight)."""
    return is_linear(m) and m.weight.dtype == torch.float32 and (m.bias is None or m.bias.dtype == torch.float32)


STAGED = ("_lp_blocks", "_lp_blocks8", "_lp_blocksq", "_lp_weight16", "_lp_weight16_of")


class Staged:
    """A linear's file blocks unpacked on first use: lp.model.gguf stages each tensor as the file's
    bytes and the function that unpacks them, so a whole model's unpacked codes (about a byte a
    weight) never sit in memory at once; ``staged`` unpacks one when a kernel's maker reads it."""

    __slots__ = ("unpack", "value")

    def __init__(self, unpack):
        self.unpack, self.value = unpack, None

    def get(self):
        if self.value is None:
            self.value = self.unpack()
        return self.value

    def release(self) -> None:
        """Drop the unpacked codes (a maker declined them): unpacked again when read again."""
        self.value = None


def staged(lin, name: str):
    """``getattr(lin, name, None)`` for a ``STAGED`` attribute, a ``Staged`` one unpacked."""
    value = getattr(lin, name, None)
    return value.get() if isinstance(value, Staged) else value


def trim_heap() -> None:
    """Hand the heap the process freed back to the OS (a load's staging copies and parse, a start-up
    measurement's engine, a finished burst's activations): glibc keeps it otherwise (Gemma-3-270M's
    load: resident 1294 -> 1125 MB); its malloc_trim also releases free pages inside the heap. A
    no-op where there is no glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _consuming(make):
    """``make`` that, once it has built a module from linears, drops their staged file blocks
    (``STAGED``: lp.model.gguf's unpacked codes, about a byte a weight), and where it declines them
    releases what it unpacked: the replaced linears stay referenced until the walk over the model
    ends, and a whole model's unpacked codes beside its packed ones were the load's peak."""
    def made(linears):
        module = make(linears)
        for lin in linears:
            for name in STAGED:
                if module is not None:
                    lin.__dict__.pop(name, None)
                elif isinstance(lin.__dict__.get(name), Staged):  # declined (say q / k / v of two formats)
                    lin.__dict__[name].release()
        if module is not None:
            trim_heap()  # the unpacked codes and the packing's copies, freed now, back to the OS (~ms)
        return module

    return made


def convert(model: nn.Module, first=(), float_kernels: bool = True) -> tuple[int, int]:
    """Swap the linears whose weights encode exactly (see module doc); (converted, left).
    ``first``: makers tried before this module's (``IDotLinear.of``, ``ExactQLinear.of``:
    lp.kernels.idot / exactq, which build on this module). ``float_kernels`` False (a build
    without their AVX-512 path, where they run a scalar loop): ``first``'s first maker alone
    (idot), other linears left as they are."""
    head = _head(model)
    makers = (*first, Exact4Linear.of, Exact8Linear.of, Exact16Linear.of) if float_kernels else tuple(first[:1])
    makers = tuple(_consuming(make) for make in makers)
    done = sum(fuse_siblings(model, make, accept=_plain) for make in makers)
    left = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            linear = None
            if _plain(child) and child is not head:
                linear = next((m for m in (make([child]) for make in makers) if m is not None), None)
            if linear is None:
                left += 1
                continue
            setattr(parent, name, linear)
            done += 1
    norms = convert_norms(model)
    log.info("model.quant=exact4: %d linears run on exact 4- or 8-bit blocks or 16-bit floats, %d left as they were; "
             "%d RMSNorms run as one op", done, left, norms)
    return done, left


# -- RMSNorm as one op ------------------------------------------------------------------------------
# The eager module is seven ops (to, pow, mean, add, rsqrt, mul, mul), ~25-40 us a call on this
# project's CPU for one row, 61 calls a SmolLM2 step. ``lp_exact4::rms_norm`` runs the same formula
# in one call; only the mean's summation order differs (like any change of kernel), a row's output
# depends on that row only. Swapped under exact4 (a float32 CPU model whose linears lp converts
# anyway), so lookahead == ``generate`` on the converted model still holds.

# classes whose forward is LlamaRMSNorm's: w * (x * rsqrt(mean(x^2, -1) + eps)) in float32
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "SmolLM3RMSNorm", "Phi3RMSNorm")
# classes whose forward is Gemma's: (x * rsqrt(mean(x^2, -1) + eps)) * (1 + w), float32 (``eps``):
# the same formula with the scale 1 + w, rounded once, as each call rounds it
RMS_NORMS_PLUS_ONE = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


class FusedRMSNorm(nn.Module):
    """A Llama-style RMSNorm (its ``weight`` Parameter shared, its ``variance_epsilon``) computed by
    ``lp_exact4::rms_norm``: float32 on the CPU. A Gemma one holds its scale ``1 + weight`` (float32)
    as its own Parameter instead."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        if type(norm).__name__ in RMS_NORMS_PLUS_ONE:
            self.weight = nn.Parameter(1.0 + norm.weight.detach().float(), requires_grad=False)
            self.variance_epsilon = float(norm.eps)
        else:
            self.weight = norm.weight
            self.variance_epsilon = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.lp_exact4.rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, one op"


def convert_norms(model: nn.Module) -> int:
    """Swap each float32 CPU RMSNorm of a class in ``RMS_NORMS`` for a ``FusedRMSNorm``, after
    checking on random rows that the op computes what the module does (to float32 rounding):
    a class whose formula changed stays as it is. Returns how many were swapped."""
    extension()
    gen = torch.Generator().manual_seed(0)
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            w = getattr(child, "weight", None)
            kind = type(child).__name__
            if (kind not in RMS_NORMS + RMS_NORMS_PLUS_ONE or type(w) is not nn.Parameter or w.dim() != 1
                    or w.dtype != torch.float32 or w.device.type != "cpu"
                    or not hasattr(child, "variance_epsilon" if kind in RMS_NORMS else "eps")):
                continue
            fused = FusedRMSNorm(child)
            x = torch.randn(3, w.shape[0], generator=gen) * 4
            with torch.no_grad():
                if not torch.allclose(fused(x), child(x), rtol=1e-5, atol=1e-6):
                    log.info("%s: the one-op RMSNorm does not reproduce %s; left as it was", name, type(child).__name__)
                    continue
            setattr(parent, name, fused)
            done += 1
    return done


# -- the LM head as exact 8-bit blocks ------------------------------------------------------------
# A GGUF Q8_0 tensor dequantized to float32 (SmolLM2's tied embedding and head: 49,152 x 576) holds
# per 32 weights w = d * q, q an int8 in -127..127 and d a float16 value, the block's largest
# weight 127 d. ``lp_exact4.mm8`` streams those 1.06 bytes a weight (the fp32 head's 4) and forms
# each weight as q * d, exact in float32: the head's own weights, in another summation order,
# like exact4's linears. Measured on this project's 2-vCPU Xeon (bench/results/step_cost/head8):
# see HEAD8_MAX_ROWS.

# more rows: the packed fp32 head (oneDNN's GEMM), whose blocking wins once the step is compute-bound
HEAD8_MAX_ROWS = 16
# argmax-only rows through Head8's screen (bench/results/step_cost/head, min ms: one row 1.05 against 1.12
# for exact8, 8 rows 1.93 against 3.98, 64 rows 12.6 against 18.2 for the fp32 head)
SCREEN_ROWS = (1, 64)


def encode8(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [N, K] int8, d [N, K / 32] float32) with ``q * d == w`` bit for bit, checked through the
    kernel itself on unit rows over every block, or None: ``w_NK`` is not 8-bit blocks."""
    found = _encode8_packed(w_NK)
    return None if found is None else found[0]


def _encode8_packed(w_NK: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """((q, d), their packed layout ``pack8``) once checked through the kernel, or None."""
    if w_NK.dtype != torch.float32 or w_NK.dim() != 2 or w_NK.device.type != "cpu" or w_NK.shape[1] % BLOCK:
        return None
    ok, q, d = extension().encode8(w_NK.detach())
    if not ok:
        return None
    p = pack8(q, d)
    idx, unit_RK = _unit_rows(w_NK.shape[1])
    return ((q, d), p) if torch.equal(mm8(unit_RK, p, w_NK.shape[0]), w_NK[:, idx].t()) else None


class Head8:
    """The LM head's weight as exact 8-bit blocks (``encode8``), packed (``pack8``): ``logits(x)`` =
    x @ W.T in float32 for up to ``HEAD8_MAX_ROWS`` rows, else None (the caller runs the packed fp32
    head). ``argmax_logits(x)``, for rows that feed only a greedy argmax (``linears.ARGMAX_ONLY``):
    the screen below, where this build has AVX-512 VNNI.

    The screen (``lp_exact4.screen8``, its proof atop the C++ code): an integer pass (int8 weights,
    each row's x as a 16-bit integer in two bytes) bounds every token's float32 logit f_v within
    [lower_v, upper_v]; a token whose upper is below the row's largest lower cannot be (or tie) the
    row's argmax. The kept tokens' groups of 8 run through ``mm8``, the very kernel ``logits`` runs
    (an output's bits do not depend on the tiling), every other entry is -inf: the row's argmax, ties
    by the first index, is ``logits(x)``'s bit for bit, and every finite entry is its logit. On
    SmolLM2 chat rows 1-66 tokens are kept (median 3)."""

    def __init__(self, p: torch.Tensor, vocab: int, q: torch.Tensor | None = None, d: torch.Tensor | None = None,
                 kind: int = 1):
        # kind: p's kernel, 1 (exact8, ``pack8``) or 8 (exactq's Q6_K as bytes; q the codes - 32 and
        # d the exact scale per 16 weights)
        self.p, self.vocab, self.kind = p, vocab, kind
        self.calls = 0  # forwards it answered (tests read it)
        self.screened = 0  # of them, through the screen
        ext = extension()
        self.screen = ext.screen8_pack(q, d) if q is not None and ext.vnni() else None

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        x_MK = x.reshape(-1, x.shape[-1])
        if x_MK.shape[0] > HEAD8_MAX_ROWS or x_MK.dtype != torch.float32:
            return None
        self.calls += 1
        if self.kind == 8:  # lp.kernels.exactq's mmq
            return torch.ops.lp_exact4.mmq(x_MK, self.p, self.vocab, 8).reshape(*x.shape[:-1], self.vocab)
        return mm8(x_MK, self.p, self.vocab).reshape(*x.shape[:-1], self.vocab)

    def argmax_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """``logits(x)`` where only each row's argmax is read: -inf for every token the screen
        proves below the row's maximum, the exact logit elsewhere (``SCREEN_ROWS`` rows)."""
        x_MK = x.reshape(-1, x.shape[-1])
        M = x_MK.shape[0]
        if self.screen is None or not SCREEN_ROWS[0] <= M <= SCREEN_ROWS[1] or x_MK.dtype != torch.float32:
            return self.logits(x)
        ok, y_MV = extension().screen8_logits(x_MK, *self.screen, self.p, self.vocab, self.kind)
        if not ok:  # a row that is not finite: the plain head says what it says
            return self.logits(x)
        self.calls += 1
        self.screened += 1
        return y_MV.reshape(*x.shape[:-1], self.vocab)


def head8(model: nn.Module) -> Head8 | None:
    """The model's packed float32 head (``lp.kernels.linears.pack`` first) as exact 8-bit blocks,
    registered where the packed head's forward finds it (``linears.HEAD8``), or None where its
    weights are not 8-bit blocks. Kept on the model (``_lp_head8``): built once per model."""
    import weakref

    from lp.kernels import linears

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, BlockHead):  # a GGUF file's head, held as its blocks only: its own screen
        return head.h8
    if not isinstance(head, linears.SmallRowsLinear) or head.packed_key < 0 or head.weight.dtype != torch.float32:
        return None
    h8 = getattr(model, "_lp_head8", None)
    if h8 is None:
        found = _encode8_packed(head.weight.detach())
        if found is None:
            log.info("model.quant=exact4: the LM head is not 8-bit blocks; it stays float32")
            return None
        h8 = Head8(found[1], head.weight.shape[0], *found[0])
        model._lp_head8 = h8
        log.info("model.quant=exact4: the LM head runs on its exact 8-bit blocks (up to %d rows)%s", HEAD8_MAX_ROWS,
                 "; greedy rows through its int8 screen (%d-%d rows)" % SCREEN_ROWS if h8.screen is not None else
                 "; no int8 screen (this build lacks AVX-512 VNNI)")
    key = head.packed_key
    linears.HEAD8[key] = weakref.ref(h8, lambda _, key=key: linears.HEAD8.pop(key, None))
    return h8


# -- a GGUF file's embedding and LM head as their blocks only --------------------------------------
# Gemma-3-270M's Q8_0 token_embd (262,144 x 640, tied to the head) is 180 MB in the file and 671 MB as
# float32; the packed fp32 head (oneDNN) held another 671 MB beside the 8-bit head. Held as 8-bit
# blocks once (the kernel's packed layout), the embedding reads its rows from them and the head runs
# on them: the same float32 weights (each formed with the file's one rounding), no float copy.

def packed_rows(p: torch.Tensor, ids: torch.Tensor, k: int, offsets: bool) -> torch.Tensor:
    """The float32 weight rows ``ids`` of 8-bit blocks packed by ``pack8`` (``offsets`` False:
    q * d) or ``pack8x`` (True: fma(q, D, C) per 16 weights, the kernel's arithmetic in torch),
    read from the packed chunks themselves: [*ids.shape, k]."""
    flat = ids.reshape(-1).long()
    n, blocks = flat.shape[0], k // BLOCK
    chunk = p[flat // 8]  # [n, blocks, bytes]: each row's group
    j = (flat % 8)[:, None, None]
    lanes = torch.arange(BLOCK)[None, None, :]
    q = torch.gather(chunk, 2, (j * BLOCK + lanes).expand(n, blocks, BLOCK)).view(torch.int8).float()

    def scale(at: int) -> torch.Tensor:  # the float32 at byte ``at + 4 j`` of each row's chunk
        four = torch.arange(4)[None, None, :]
        return torch.gather(chunk, 2, (at + 4 * j + four).expand(n, blocks, 4)).contiguous().view(torch.float32)

    base = 8 * BLOCK
    if not offsets:
        w = q * scale(base)
    else:
        d = torch.cat([scale(base).expand(n, blocks, 16), scale(base + 32).expand(n, blocks, 16)], dim=2)
        c = torch.cat([scale(base + 64).expand(n, blocks, 16), scale(base + 96).expand(n, blocks, 16)], dim=2)
        w = q * d + c
    return w.reshape(*ids.shape, k)


def eight_bit(parts: tuple) -> tuple:
    """A file tensor's blocks as 8-bit ones: (q, d) and (q, d, c) 8-bit parts as they are; exact4's
    (q nibbles, d, c per 32) as (q int8, d, c per 16), the same fma(q, d, c) per weight."""
    if parts[0].dtype == torch.int8 or len(parts) == 1:  # 8-bit parts, or a 16-bit tensor (w16,)
        return parts
    q, d, c = parts
    n = q.shape[0]
    q8 = torch.cat([(q & 0xF).reshape(n, -1, 16), (q >> 4).reshape(n, -1, 16)], dim=2).reshape(n, -1).to(torch.int8)
    return q8, d.repeat_interleave(2, dim=1).contiguous(), c.repeat_interleave(2, dim=1).contiguous()


class BlockHead(nn.Module):
    """An LM head held only as a GGUF file's blocks (``eight_bit``), packed once: ``y = x @ W.T`` by
    ``mm8`` / ``mm8x`` for any number of float32 rows; with (q, d) blocks and AVX-512 VNNI, rows that
    feed only a greedy argmax (``linears.ARGMAX_ONLY``) go through ``Head8``'s screen. ``embedding()``
    gives the tied input embedding reading the same packed blocks."""

    def __init__(self, parts: tuple, screen: bool = True):
        super().__init__()
        self.qkind = None  # lp.kernels.exactq's QBlockHead: its kind
        q = parts[0]
        self.out_features, self.in_features = q.shape
        self.offsets = len(parts) == 3
        self.bits = 16 if len(parts) == 1 else 8  # (w16,): a file's F16 / BF16 tensor, 2 bytes a weight
        if self.bits == 16:
            self.register_buffer("p", pack16(q))
            self.dtype16 = q.dtype
            self.h8 = None
            return
        kind = Exact8xLinear if self.offsets else Exact8Linear
        self.register_buffer("p", kind.pack(*parts))
        self.h8 = Head8(self.p, self.out_features, *parts) if screen and not self.offsets else None

    def kernel(self, x_MK: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:
        """The head's product (a method, not a stored lambda: a cached load pickles the module)."""
        if self.bits == 16:
            return mm16(x_MK, p, n, self.dtype16 == torch.bfloat16)
        return (Exact8xLinear if self.offsets else Exact8Linear).kernel(x_MK, p, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lp.kernels import linears

        if self.h8 is not None and linears.ARGMAX_ONLY.on and x.dtype == torch.float32:
            y = self.h8.argmax_logits(x)
            if y is not None:
                return y
        dtype = x.dtype
        y_MN = self.kernel(x.reshape(-1, self.in_features).float(), self.p, self.out_features)
        return y_MN.to(dtype).reshape(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.bits == 16:  # [groups, blocks, 8 outputs, 32 weights] of 2 bytes: row n = (n // 8, :, n % 8, :)
            flat = ids.reshape(-1).long()
            p16 = self.p.view(torch.int16).view(self.p.shape[0], self.p.shape[1], 8, BLOCK)
            w = p16[flat // 8, :, flat % 8, :].reshape(-1, self.in_features).view(self.dtype16).float()
            return w.reshape(*ids.shape, self.in_features)
        return packed_rows(self.p, ids, self.in_features, self.offsets)

    def extra_repr(self) -> str:
        if self.bits == 16:
            return f"in_features={self.in_features}, out_features={self.out_features}, {self.dtype16} weights"
        return (f"in_features={self.in_features}, out_features={self.out_features}, exact 8-bit blocks"
                f"{' with offsets' if self.offsets else ''}{', int8 greedy screen' if self.h8 and self.h8.screen else ''}")


class BlockEmbedding(nn.Module):
    """A token embedding whose rows are read from 8-bit blocks (its own ``BlockHead``-packed ones,
    or the tied head's): float32 rows, times ``embed_scale`` where the replaced module had one (Gemma's
    scaled embedding multiplies by it in the weight's dtype, float32)."""

    def __init__(self, source: BlockHead, embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.source = source
        self.num_embeddings, self.embedding_dim = source.out_features, source.in_features
        if embed_scale is not None:
            self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.source.rows(ids)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(torch.float32)

    def extra_repr(self) -> str:
        kind = ("16-bit floats" if self.source.bits == 16 else f"GGUF codes (kind {self.source.qkind})"
                if self.source.qkind is not None else "exact 8-bit blocks")
        return f"{self.num_embeddings}, {self.embedding_dim}, rows from {kind}"
