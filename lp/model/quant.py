"""Quantized weights (``model.quant``): int8 and int4 linears, applied once after loading.

Contract: ``quantize(model, quant, device)`` rewrites a loaded causal LM in place and returns
the resolved scheme (``"none"``, ``"int8"``, ``"int4"``, ``"exact4"``); ``auto`` (the default of
every entry point) resolves on the loaded model (``resolve_auto``): ``exact4`` where it changes no
weight and its measured kernel runs (a float32 model on a CPU whose linears are exact 4-bit
blocks, the kernel built with its AVX-512 path), ``none`` otherwise, with one log line saying
which and why. Every LP worker calls it with the same
arguments on the same weights, so all ranks hold bit-identical quantized models.
Exactness is relative to the model *as quantized*: lookahead on it equals transformers
``generate`` on it (the same modules run in both).

Schemes (chosen by measurement on this project's 2-core AVX-512 EPYC VM, torch 2.13 CPU,
torchao 0.18; numbers in bench/results/quant/):

* ``int8`` on the CPU: ``RowInt8Linear`` — int8 weights (per output channel, symmetric)
  prepacked for fbgemm's dynamic quantized linear (``torch.ops.quantized.linear_dynamic``,
  the kernel behind torch's ``quantize_dynamic``), with **per-row** activation scales.
  fbgemm picks one (scale, zero point) for the whole input tensor, so in a packed step a
  row's rounding would depend on the other rows. Here every row is first scaled to
  absolute maximum ``C`` and two extra input columns ``+C, -C`` (with zero weights) pin
  the tensor's range to exactly ``[-C, C]``: every row of every step is quantized with the
  same parameters, the integer GEMM is exact, and the output is scaled back per row; a
  bias (Qwen2's q/k/v) is added after that, in float32 (inside fbgemm it would be added to
  the scaled rows' product and then scaled by each row's maximum). A row's output therefore
  depends only on that row: a Q-row linear equals Q one-row linears bit for bit
  (tests/test_quant.py, which also bounds a biased tiny Qwen2's KL to its float32 self). torchao's own int8 tensors ran 1.8-10x slower
  than float32 on this CPU (no fast int8 CPU GEMM behind them), hence fbgemm.
* ``int8`` on CUDA: torchao's ``Int8WeightOnlyConfig`` (weight-only; activations stay
  bf16/fp16, so packed rows round like one row up to the GEMM's summation order).
* ``exact4`` (CPU, float32): not a quantization. The linears whose float32 weights already are
  4-bit blocks (a GGUF Q4_0 / Q4_1 model dequantized: lp's default SmolLM2) run on those blocks
  with float32 math, every weight reproduced bit for bit (lp.kernels.exact4); the rest stay.
* ``int4``: torchao's int4 weight-only with group size 32 — on the CPU the prototype
  ``Int4OpaqueTensor`` (``aten._weight_int4pack_mm_for_cpu``, bf16 activations), on CUDA the
  tinygemm layout (``tile_packed_to_4d``). The model is cast to bf16 first.

torchao is imported only by a scheme that uses it (``int4``; ``int8`` on CUDA). transformers
imports it (when installed) with its quantizers, that is with every model class, and torchao
prints warnings at import; ``defer_torchao()`` (lp.model.loader calls it when lp is imported)
hides torchao from that one transformers module while it loads, and ``quantize`` completes
that module once torchao is imported (tests/test_imports_light.py).

The LM head is quantized with the other linears (measured: it is the largest single
matmul, 49152 x 576 for SmolLM2); embeddings stay in the float dtype (a lookup reads one
row per token; nothing to gain). A tied head gets its own quantized copy.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import warnings

import torch
from torch import nn

from lp.kernels.linears import SharedInputPart, SharedProduct, fuse_siblings  # noqa: F401  (SharedInputPart re-exported)
from lp.kernels.linears import is_linear as _is_linear

log = logging.getLogger(__name__)

QUANTS = ("none", "int8", "int4", "exact4", "auto")
_C = 1.0  # every activation row is scaled to this absolute maximum before quantization (1: a reciprocal)


def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


# fbgemm multiplies u8 x s8 pairs into int16 (saturating) without VNNI, so activations get 7 bits
# there (reduce_range); with VNNI the products accumulate in int32 and all 8 bits are used.
# Measured on SmolLM2: mean KL vs fp32 per token 0.124 with 7 bits, 0.028 with 8.
_REDUCE_RANGE = not _cpu_has_vnni()

# The pinning columns fix fbgemm's activation range to [-_C, _C]: 2^b - 1 steps over 2 _C, zero
# point 2^(b-1) (b = 7 or 8), so -_C itself lies halfway between two codes (a tie whose side
# the last ulp of the row's scale decides: one process and a TP mesh, whose inputs differ by an
# all-reduce's rounding, then part by a whole step). Each row is scaled so its absolute maximum
# lands on the code one step inside (_FILL _C): a grid point, half a step from any tie.
_FILL = 126 / 127 if _REDUCE_RANGE else 254 / 255


def resolve_quant(name: str, device: torch.device) -> str:
    """``name`` checked; ``auto`` stays ``auto`` (it resolves on the loaded model: ``resolve_auto``)."""
    if name not in QUANTS:
        raise ValueError(f"model.quant must be one of {', '.join(QUANTS)}, got {name!r}")
    return name


def resolve_auto(model, device: torch.device) -> tuple[str, str]:
    """(scheme, why) for ``model.quant=auto``: ``exact4`` when the model is float32 on the CPU, one
    of its linears' weights are exact 4-bit blocks (a cheap check, before any kernel is built)
    and lp's exact4 kernel builds with its AVX-512 path (the one measured faster than float32);
    ``none`` otherwise. Nothing lossy is ever chosen by ``auto``."""
    dtype = next(model.parameters()).dtype
    if device.type != "cpu" or dtype != torch.float32:
        return "none", f"exact4 runs float32 models on the CPU (this one: {dtype} on {device.type})"
    from lp.kernels import exact4

    blocks = exact4.has_blocks(model)
    if not blocks and not exact4.has_16bit(model):
        return "none", "no linear of this model holds exact 4-bit blocks or 16-bit floats"
    try:
        mod = exact4.extension()
    except ValueError as e:
        return "none", str(e)
    if not mod.avx512():
        from lp.kernels import idot

        if idot.available() and idot.has_codes(model):
            return "exact4", ("its linears hold a GGUF file's blocks or 16-bit floats: they run on lp.kernels.idot's AVX2 "
                              "kernels (the file's codes or 2-byte floats widened to the float32 weights in the kernel); linears "
                              "idot cannot take stay float32 (exact4's float kernels need AVX-512)")
        return "none", "this CPU builds exact4's scalar loop only (no AVX-512): float32 linears are faster"
    if blocks:
        return "exact4", "its linears are exact 4-bit blocks: the same weights in 0.75 bytes each"
    return "exact4", "its linears' weights are bf16 / fp16 values: the same weights in 2 bytes each"


# ---------------------------------------------------------------------------
# int8 on the CPU: fbgemm's dynamic linear with per-row activation scales


class RowInt8Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with W in int8 (per output channel) and x quantized per row; the
    bias ``b`` stays float32 and is added after the per-row rescale.

    Built from one ``nn.Linear`` or from several that read the same input (q/k/v, gate/up:
    their weights stacked, one kernel call; see ``SharedInputPart``). Integer products are
    exact and the scales are per row and per output column, so a fused column equals the
    unfused one and a row's output depends on that row only.

    Legend: M rows, I in features, O out features.
    """

    def __init__(self, *linears: nn.Linear, row_amax_O: torch.Tensor | None = None, amax_max=None):
        """``row_amax_O`` and ``amax_max``: a row-parallel shard (lp.parallel.tp) holding a slice
        of K: its weights scaled by their full rows' absolute maximum (all tp ranks'), and every
        activation row by its full row's maximum (``amax_max``, an in-place all-reduce MAX given by
        lp.parallel.tp, once per call; lp/model/ never imports torch.distributed), so its integers are the one-process model's, restricted to the slice."""
        super().__init__()
        assert linears and len({lin.in_features for lin in linears}) == 1
        w_OI = torch.cat([lin.weight.detach().float() for lin in linears])
        self.in_features, self.out_features = linears[0].in_features, w_OI.shape[0]
        self.splits = [lin.out_features for lin in linears]
        self._amax_max = amax_max
        # the two pinning columns get zero weights: they shift nothing in the product
        w_OI2 = torch.cat([w_OI, w_OI.new_zeros(w_OI.shape[0], 2)], dim=1)
        amax_O = w_OI2.abs().amax(dim=1) if row_amax_O is None else row_amax_O.float()
        scale_O = (amax_O / 127).clamp(min=1e-12).double()
        with warnings.catch_warnings():  # quantized dtypes are deprecated, fbgemm's prepack still takes them
            warnings.simplefilter("ignore")
            w_q = torch.quantize_per_channel(w_OI2, scale_O, torch.zeros_like(scale_O, dtype=torch.long), 0,
                                             torch.qint8)
        # the bias stays out of the prepacked weight: fbgemm would add it to the product of
        # the *scaled* rows, and the per-row rescale would multiply it by the row's maximum.
        # It is added in float32 after the rescale (one elementwise op per row: rows stay
        # independent).
        biases = [lin.bias for lin in linears]
        self._bias_O = None if all(b is None for b in biases) else torch.cat(
            [b.detach().float() if b is not None else w_OI.new_zeros(lin.out_features)
             for b, lin in zip(biases, linears)]).contiguous()
        self._packed = torch.ops.quantized.linear_prepack(w_q, None)
        # the input buffer: [rows, I] scaled activations, then the two pinning columns +C, -C
        self._buf = torch.cat([torch.zeros(1, self.in_features), torch.tensor([[_C, -_C]])], dim=1)
        self._share = SharedProduct(len(self.splits))  # for SharedInputPart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # five small ops around the kernel: each costs a few microseconds on the CPU, as
        # much as the int8 GEMM itself at one row, so none is spent that is not needed
        dtype = x.dtype
        x_MI = x.reshape(-1, self.in_features)
        if x_MI.dtype != torch.float32:
            x_MI = x_MI.float()
        m = x_MI.shape[0]
        if self._buf.shape[0] < m:
            self._buf = torch.cat([self._buf, self._buf[:1].expand(m - self._buf.shape[0], -1)]).contiguous()
        buf_MI2 = self._buf[:m]
        amax_M1 = x_MI.abs().amax(dim=1, keepdim=True)  # 2-7x cheaper than an inf-norm
        if self._amax_max is not None:  # a K slice: the full row's maximum, as one process scales it
            self._amax_max(amax_M1)
        amax_M1.clamp_(min=1e-30).mul_(1 / _FILL)
        torch.mul(x_MI, torch.reciprocal(amax_M1), out=buf_MI2[:, : self.in_features])  # rows scaled to _FILL _C
        y_MO = torch.ops.quantized.linear_dynamic(buf_MI2, self._packed, _REDUCE_RANGE)
        y_MO.mul_(amax_M1)
        if self._bias_O is not None:
            y_MO.add_(self._bias_O)
        if dtype != torch.float32:
            y_MO = y_MO.to(dtype)
        return y_MO.reshape(*x.shape[:-1], self.out_features)

    def shared(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """The fused product for ``x``, computed once for the parts that read the same
        input tensor one after the other (lp.kernels.linears.SharedProduct)."""
        return self._share.get(x, part, self)

    def extra_repr(self) -> str:
        fused = f", fused {self.splits}" if len(self.splits) > 1 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}{fused}, int8 weights, "
                "per-row int8 activations")


def _swap_linears(model: nn.Module, make) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_linear(child):
                setattr(parent, name, make(child))
                count += 1
    return count


# ---------------------------------------------------------------------------
# torchao (int4 everywhere, int8 on CUDA)


_HF_TORCHAO = "transformers.quantizers.quantizer_torchao"  # imports torchao at its top when it can


class _TorchaoHiddenLoader(importlib.abc.Loader):
    """Executes a module with ``sys.modules["torchao"] = None``: ``importlib.util.find_spec``
    then reports torchao missing (transformers' ``is_torchao_available()`` says no) and the
    module skips its torchao imports. Everything else is the wrapped loader's."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # get_source, get_filename, ...: tracebacks, inspect
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        hide = "torchao" not in sys.modules
        if hide:
            sys.modules["torchao"] = None
        try:
            self.loader.exec_module(module)
        finally:
            if hide and "torchao" in sys.modules and sys.modules["torchao"] is None:
                del sys.modules["torchao"]
            _clear_torchao_check()
        module._lp_torchao_hidden = hide


class _DeferTorchaoFinder(importlib.abc.MetaPathFinder):
    """Finds ``_HF_TORCHAO`` as the path finder does, to be loaded with torchao hidden
    (once: inert afterwards)."""

    done = False

    def find_spec(self, fullname, path, target=None):
        if fullname != _HF_TORCHAO or self.done or "torchao" in sys.modules:
            return None
        self.done = True
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _TorchaoHiddenLoader(spec.loader)
        return spec


def _clear_torchao_check() -> None:
    """transformers caches ``is_torchao_available()``: drop what was cached while hidden."""
    utils = sys.modules.get("transformers.utils.import_utils")
    check = getattr(utils, "is_torchao_available", None)
    if check is not None and hasattr(check, "cache_clear"):
        check.cache_clear()


def defer_torchao() -> None:
    """Keep torchao out of processes that do not quantize with it: transformers' torchao
    quantizer module (imported with every model class) loads as if torchao were missing.
    Does nothing if that module or torchao is imported already. ``_torchao()`` reloads the
    module once torchao is in, so transformers' own torchao support is whole again."""
    if _HF_TORCHAO in sys.modules or "torchao" in sys.modules:
        return
    if not any(isinstance(f, _DeferTorchaoFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferTorchaoFinder())


def _torchao():
    import os

    # torchao probes its CUDA extensions at import and logs each one that fails on a CPU build
    logging.getLogger("torchao").setLevel(logging.ERROR)
    os.environ.setdefault("TORCHAO_SKIP_LOADING_SO_FILES", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import torchao  # noqa: F401
            from torchao import quantization
        except ImportError as e:
            raise ValueError("model.quant=int4 (and int8 on CUDA) needs torchao: pip install --no-deps torchao") from e
        hf = sys.modules.get(_HF_TORCHAO)
        if getattr(hf, "_lp_torchao_hidden", False):  # loaded without torchao (defer_torchao): now with it
            _clear_torchao_check()
            try:
                importlib.reload(hf)
                hf._lp_torchao_hidden = False
            except Exception as e:  # transformers' own torchao path only; lp's quantize_ does not use it
                log.warning("could not reload %s with torchao: %s", _HF_TORCHAO, e)
    return quantization


def _untie_head(model) -> None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None and emb is not None and getattr(head, "weight", None) is emb.weight:
        head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
        if hasattr(model.config, "tie_word_embeddings"):
            model.config.tie_word_embeddings = False


def quantize(model, quant: str, device: torch.device | str | None = None) -> str:
    """Quantize ``model``'s linears in place (see the module docstring); returns the scheme."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    scheme = resolve_quant(quant, device)
    if scheme == "none":
        return scheme
    if getattr(model, "_lp_quant", None):
        raise ValueError(f"this model is already quantized ({model._lp_quant}); load it again to change model.quant")
    if scheme == "auto":
        scheme, why = resolve_auto(model, device)
        log.info("model.quant=auto -> %s: %s", scheme, why)
        if scheme == "none":
            return scheme
    if scheme == "exact4":  # lossless: the linears whose float32 weights are 4-bit blocks (lp.kernels.exact4)
        dtype = next(model.parameters()).dtype
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"model.quant=exact4 runs float32 models on the CPU, got {dtype} on {device.type}")
        from lp.kernels import exact4, exactq, idot

        # a file's blocks on integer dots where the CPU has VNNI, else on the float kernels
        n, _ = exact4.convert(model, first=(idot.IDotLinear.of, exactq.ExactQLinear.of),
                              float_kernels=exact4.extension().avx512())
        if n == 0:
            raise ValueError("model.quant=exact4: no linear of this model holds exact 4-bit blocks (a GGUF Q4_0 / "
                             "Q4_1 model dequantized to float32 does) or 16-bit floats; use model.quant=none")
        model._lp_quant = scheme
        return scheme
    _untie_head(model)
    if scheme == "int8" and device.type == "cpu":
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ValueError("model.quant=int8 on the CPU needs torch's fbgemm engine (x86); use model.quant=none")
        torch.backends.quantized.engine = "fbgemm"
        model.float()
        n = fuse_siblings(model, lambda parts: RowInt8Linear(*parts)) + _swap_linears(model, RowInt8Linear)
        # sdpa rounds differently for 1 and Q rows, and int8 activations amplify that into
        # different logits: attention whose rows are independent keeps lookahead == generate
        from lp.kernels import exact_attention

        exact_attention.register()
        model.set_attn_implementation(exact_attention.ROWEXACT)
    else:
        # torchao's modules register Enums with torch's pytree as they import, and torch logs a
        # deprecation for each (KernelPreference, ScaleCalculationMode, ...): not the user's concern
        pytree_log = logging.getLogger("torch.utils._pytree")
        pytree_level = pytree_log.level
        pytree_log.setLevel(logging.ERROR)
        try:
            n = _quantize_torchao(model, scheme, device)
        finally:
            pytree_log.setLevel(pytree_level)
    model._lp_quant = scheme
    log.info("model.quant=%s: %d linear layers quantized", scheme, n)
    return scheme


def _quantize_torchao(model, scheme: str, device: torch.device) -> int:
    """int4 (and int8 on CUDA) through torchao; returns the number of linears quantized."""
    q = _torchao()
    if scheme == "int8":
        config = q.Int8WeightOnlyConfig()
    elif device.type == "cuda":
        model.to(torch.bfloat16)
        config = q.Int4WeightOnlyConfig(group_size=32, int4_packing_format="tile_packed_to_4d")
    else:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        model.to(torch.bfloat16)
        config = PrototypeInt4WeightOnlyConfig(group_size=32)
    n = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
    q.quantize_(model, config)
    return n
