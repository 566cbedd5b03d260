"""Quantized weights (``model.quant``): int8 and int4 linears, applied once after loading.

Contract: ``quantize(model, quant, device)`` rewrites a loaded causal LM in place and returns
the resolved scheme (``"none"``, ``"int8"``, ``"int4"``); ``resolve_quant(name, device)``
maps ``auto`` to a scheme for the hardware. Every LP worker calls it with the same
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
  same parameters, the integer GEMM is exact, and the output is scaled back per row. A
  row's output therefore depends only on that row: a Q-row linear equals Q one-row
  linears bit for bit (tests/test_quant.py). torchao's own int8 tensors ran 1.8-10x slower
  than float32 on this CPU (no fast int8 CPU GEMM behind them), hence fbgemm.
* ``int8`` on CUDA: torchao's ``Int8WeightOnlyConfig`` (weight-only; activations stay
  bf16/fp16, so packed rows round like one row up to the GEMM's summation order).
* ``int4``: torchao's int4 weight-only with group size 32 — on the CPU the prototype
  ``Int4OpaqueTensor`` (``aten._weight_int4pack_mm_for_cpu``, bf16 activations), on CUDA the
  tinygemm layout (``tile_packed_to_4d``). The model is cast to bf16 first.

The LM head is quantized with the other linears (measured: it is the largest single
matmul, 49152 x 576 for SmolLM2); embeddings stay in the float dtype (a lookup reads one
row per token; nothing to gain). A tied head gets its own quantized copy.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

log = logging.getLogger(__name__)

QUANTS = ("none", "int8", "int4", "auto")
_C = 1.0  # every activation row is scaled to this absolute maximum before quantization


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


def resolve_quant(name: str, device: torch.device) -> str:
    """``auto``: ``none`` everywhere for now (measured: see the module docstring and README)."""
    if name not in QUANTS:
        raise ValueError(f"model.quant must be one of {', '.join(QUANTS)}, got {name!r}")
    if name == "auto":
        return "none"
    return name


# ---------------------------------------------------------------------------
# int8 on the CPU: fbgemm's dynamic linear with per-row activation scales


class RowInt8Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with W in int8 (per output channel) and x quantized per row.

    Legend: M rows, I in features, O out features.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w_OI = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # the two pinning columns get zero weights: they shift nothing in the product
        w_OI2 = torch.cat([w_OI, w_OI.new_zeros(w_OI.shape[0], 2)], dim=1)
        scale_O = (w_OI2.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        with warnings.catch_warnings():  # quantized dtypes are deprecated, fbgemm's prepack still takes them
            warnings.simplefilter("ignore")
            w_q = torch.quantize_per_channel(w_OI2, scale_O, torch.zeros_like(scale_O, dtype=torch.long), 0,
                                             torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(w_q, bias)
        self.register_buffer("_pin", torch.tensor([_C, -_C]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x_MI = x.reshape(-1, self.in_features).float()
        amax_M1 = x_MI.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        x_MI2 = torch.cat([x_MI * (_C / amax_M1), self._pin.expand(x_MI.shape[0], 2)], dim=1)
        y_MO = torch.ops.quantized.linear_dynamic(x_MI2, self._packed, _REDUCE_RANGE)
        y_MO = y_MO * (amax_M1 / _C)
        return y_MO.to(dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, per-row int8 activations"


def _swap_linears(model: nn.Module, make) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear or (isinstance(child, nn.Linear) and type(child).__name__ == "SmallRowsLinear"):
                setattr(parent, name, make(child))
                count += 1
    return count


# ---------------------------------------------------------------------------
# torchao (int4 everywhere, int8 on CUDA)


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
    return quantization


def _untie_head(model) -> None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None and emb is not None and head.weight is emb.weight:
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
    _untie_head(model)
    if scheme == "int8" and device.type == "cpu":
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ValueError("model.quant=int8 on the CPU needs torch's fbgemm engine (x86); use model.quant=none")
        torch.backends.quantized.engine = "fbgemm"
        model.float()
        n = _swap_linears(model, RowInt8Linear)
        # sdpa rounds differently for 1 and Q rows, and int8 activations amplify that into
        # different logits: attention whose rows are independent keeps lookahead == generate
        from lp import exact_attention

        exact_attention.register()
        model.set_attn_implementation(exact_attention.ROWEXACT)
    else:
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
    model._lp_quant = scheme
    log.info("model.quant=%s: %d linear layers quantized", scheme, n)
    return scheme
