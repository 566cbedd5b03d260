"""The packed step's linear kernels on the CPU: oneDNN prepacked weights, small-row matmuls.

Contract: ``install(model)`` swaps every bias-free ``nn.Linear`` with a plain float weight
(quantized linears of lp.model.quant / torchao keep their own kernels) for a
``SmallRowsLinear`` that shares its Parameters (tied weights stay tied) and returns the
model's one ``SmallRows`` switch (a second call returns the same switch); the output
embedding (LM head) is marked to compute one row as two. While the
switch is off, a swapped layer runs ``nn.Linear.forward`` unchanged, so the user's
``model.generate`` computes exactly what it did. ``ModelRunner`` turns the switch on for
its own forwards whose row count the calibration (lp.model.calibrate) found faster this way, or
for every count with ``model.small_rows=on``; ``pack(model)`` gives the swapped layers their
oneDNN-packed weights, which the switch's ``packed`` selects (``model.linears=packed``).

Why: for x of 2-16 rows and a weight W stored [out, in], MKL's sgemm is several times
slower in the ``x @ W.T`` layout than as ``(W @ x.T).T`` on some CPUs. Measured on the
2-core AMD EPYC VM of this project (torch 2.13 CPU, MKL, 2 threads, fp32), one
576 x 49,152 head: 21 ms at 2 rows and 16 ms at 4 (``F.linear``) against 2.8 and 3.7 ms;
a whole SmolLM2 step of 2 / 4 / 8 rows: 87 / 78 / 73 ms against 44 / 49 / 66 ms, while one
row costs 55 ms either way. The result is the same product in another summation order
(differences at float rounding level, like any change of kernel).

Packed linears (``pack(model)``, ``model.linears=packed``): every swapped layer also holds
its weight reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
what inductor's ``freezing`` does) and, while the switch's ``packed`` is set, runs
``torch.ops.mkldnn._linear_pointwise`` on it. Measured on this project's 2-core EPYC (one
thread, SmolLM2's 211 linears with weights streamed from DRAM, fp32): 22.6 ms at 1 row against
MKL's 32.4, 48 against 82 at 16 rows, 99 against 206 at 64 (``/proc/cpuinfo``: AVX-512). The
packed copy costs the linears' bytes once more (the plain weight stays: the user's
``generate`` and the tied input embedding read it); a later change of the plain weight is
not seen by the packed copy (inference only). Siblings that read one input (q/k/v, gate/up:
``FUSED``) are packed as one stacked weight and computed by one call (``FusedGroup``). While
``ARGMAX_ONLY.on``, a packed head with a screen in ``SCREENS`` (lp.kernels.head) answers
instead of its fp32 weight: its rows' argmaxes exact, its other values not logits.

One row: MKL's matrix-vector path on the LM head (49,152 x 576) takes 11 ms here, the
two-row GEMM 3.7 ms, so with the switch on the head computes a one-row input as two rows
(the second zero) and keeps the first; every other layer runs one row unchanged (its
GEMV is as fast). The calibration times Q = 1 both ways like any other Q.
"""

from __future__ import annotations

import functools
import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from lp.kernels.build import opaque_op


LINEARS = ("auto", "packed", "plain")


class SmallRows:
    """The switch shared by all swapped layers of one model: ``on`` small-row matmuls (2+
    rows, and the head's one row), else ``packed`` oneDNN's prepacked kernel where a layer
    holds a packed weight, else ``nn.Linear``'s own. Registered in ``SWITCHES`` under its
    ``key``; a copy (``copy.deepcopy`` of a model) is a new switch, off."""

    def __init__(self):
        self.on = False
        self.packed = False
        self.key = next(_KEYS)
        SWITCHES[self.key] = self

    def __deepcopy__(self, memo):
        return SmallRows()


# The layers read their switch and their fused group out of these module-level dicts by an
# int key, not as attributes of their own: a compiled step guards every object it reaches,
# and one object reached from two modules is an aliasing guard evaluated in Python on every
# call (209 for the one switch of SmolLM2's linears, 90 for the fused groups, 118 more for
# packed weights' sizes); one dict entry read from 211 modules is one source, checked once, in
# C++. Measured (SmolLM2's compiled one-row step, its guard tree checked alone, 2-core EPYC):
# 716 -> 292 Python guards, 335-400 -> 167-186 us a call. Dicts (not lists): a list's length
# is guarded, and a model packed later would recompile every earlier graph.
_KEYS = itertools.count()
SWITCHES: dict[int, SmallRows] = {}
OFF = SmallRows()  # the switch of a layer that has none (a copy before ``install``): always off
GROUPS: dict = {}  # fused_key -> weak reference to its FusedGroup (its members hold it)


class ArgmaxOnly:
    """Set (by lp.model.runner) around a forward whose logits only feed an argmax: a packed LM
    head with a screen (lp.kernels.head, in ``SCREENS`` by its packed key) then returns logits
    whose argmax is the exact one and whose other values are not logits. Read only at run time
    (``_packed``), never in a traced forward."""

    on = False


ARGMAX_ONLY = ArgmaxOnly()
HEAD8_ON = ArgmaxOnly()  # set (by lp.model.runner) around the forwards of a runner whose head runs on HEAD8
SCREENS: dict = {}  # packed_key -> weak reference to the head's lp.kernels.head.HeadScreen
HEAD8: dict = {}  # packed_key -> weak reference to the head's lp.kernels.exact4.Head8 (exact 8-bit blocks)


class SmallRowsLinear(nn.Linear):
    """An ``nn.Linear`` (no bias) that computes ``(W @ x.T).T`` when its switch is on and x has
    2 or more rows."""

    switch_key = OFF.key  # its SmallRows in SWITCHES (install)
    pad_one_row = False  # the LM head: one row runs as two (a GEMM), see the module doc
    packed_weight: torch.Tensor | None = None  # oneDNN layout (pack): holds it; read through PACKED
    packed_key = -1  # its index in PACKED: how the forward (and a compiled graph) names it
    fused_key = -1  # its FusedGroup in GROUPS, packed together with its siblings of one input
    fused_index = -1  # its part of the group
    fused_columns = (0, 0)  # its columns of the group's product

    @property
    def switch(self) -> SmallRows:
        return SWITCHES[self.switch_key]

    @property
    def fused(self) -> "FusedGroup | None":
        return GROUPS[self.fused_key]() if self.fused_key >= 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        switch = SWITCHES[self.switch_key]
        if switch.on:
            y = self._small_rows(x)
            if y is not None:
                return y
        if switch.packed and self.fused_key >= 0:
            return GROUPS[self.fused_key]().output(self, x)
        if switch.packed and self.packed_key >= 0:
            return packed_matmul(x, self.packed_key, self.out_features)
        return F.linear(x, self.weight)

    def __getstate__(self):
        # an opaque oneDNN tensor has no storage to copy or pickle: a copy packs again (pack),
        # and runs on its own model's switch once installed
        state = super().__getstate__()
        for name in ("packed_weight", "packed_key", "_group", "fused_key", "fused_index", "fused_columns",
                     "switch_key"):
            state.pop(name, None)
        return state

    def _small_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """``(W @ x.T).T``; None for one row outside the head (its GEMV is as fast)."""
        x_MI = x.reshape(-1, x.shape[-1])
        if x_MI.shape[0] < 2:
            if not self.pad_one_row:
                return None
            x_2I = torch.cat([x_MI, x_MI.new_zeros(1, x_MI.shape[1])])
            y_1O = (self.weight @ x_2I.t())[:, :1].t().contiguous()
            return y_1O.reshape(*x.shape[:-1], self.weight.shape[0])
        # contiguous: a transposed [M, O] view would reach attention as a query whose last
        # dimension is strided, and sdpa's CPU flash kernel would fall back to its ~3x slower
        # math path (measured: 8 sequences x 30 layers, 65 ms against 20)
        return (self.weight @ x_MI.t()).t().contiguous().reshape(*x.shape[:-1], self.weight.shape[0])


def install(model: nn.Module) -> SmallRows:
    switch = getattr(model, "_lp_small_rows", None)
    if switch is None or SWITCHES.get(switch.key) is not switch:  # not yet, or an unpickled copy
        switch = SmallRows()
    for module in model.modules():
        # plain float weights only: a quantized linear (torchao tensor subclass, lp.model.quant)
        # runs its own kernel
        if type(module) is nn.Linear and module.bias is None and type(module.weight) is nn.Parameter:
            module.__class__ = SmallRowsLinear  # same object: same Parameters, hooks, tying
        if isinstance(module, SmallRowsLinear):  # a copied model's layers lost their switch
            module.switch_key = switch.key
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, SmallRowsLinear):
        head.pad_one_row = True
    model._lp_small_rows = switch
    return switch


# every packed weight of the process, by packed_key: a compiled graph calls packed_linear with
# the key, since a fake (traced) tensor cannot stand for an opaque oneDNN one
PACKED: list = []  # weak references: a dropped model frees its packed copy


def _packed_linear_shape(x, key, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@opaque_op("packed_linear(Tensor x, int key, int out_features) -> Tensor", _packed_linear_shape)
def packed_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """``x @ W.T`` on the packed weight ``PACKED[key]`` (an op opaque to torch.compile)."""
    return _packed(x, key)


def packed_matmul(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """``x @ W.T`` on the packed weight ``PACKED[key]``: eager, oneDNN's kernel on it; while
    compiling, the opaque ``packed_linear`` (dynamo cannot trace an opaque tensor, and a graph
    that never reaches the tensor guards nothing of it)."""
    if torch.compiler.is_compiling():
        return packed_linear(x, key, out_features)
    return _packed(x, key)


def _packed(x: torch.Tensor, key: int) -> torch.Tensor:
    if HEAD8_ON.on and key in HEAD8:  # the head's exact 8-bit blocks (lp.kernels.exact4.head8): read at run time, never traced
        h8 = HEAD8[key]()
        y = h8.argmax_logits(x) if ARGMAX_ONLY.on else h8.logits(x)
        if y is not None:
            return y
    if ARGMAX_ONLY.on and key in SCREENS:  # read at run time, never traced: no guard, no graph
        y = SCREENS[key]().logits(x)
        if y is not None:
            return y
    weight = PACKED[key]()
    assert weight is not None, f"packed weight {key} was freed with its model"
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@functools.cache
def bf16_packs() -> bool:
    """Whether oneDNN packs bf16 linear weights on this CPU (it asks for AVX-512 BW / VL / DQ or
    AVX-NE-CONVERT: a plain AVX2 CPU raises inside ``_reorder_linear_weight``)."""
    if not torch.backends.mkldnn.is_available():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is not None and not check():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def packable(module: nn.Module) -> bool:
    """A swapped layer whose plain float weight oneDNN can prepack (on the CPU; not a DTensor
    shard of lp.parallel.tp, not a quantized tensor of lp.model.quant; bf16 only where
    ``bf16_packs``: elsewhere a bf16 layer keeps torch's own linear)."""
    w = getattr(module, "weight", None)
    return (isinstance(module, SmallRowsLinear) and type(w) is nn.Parameter and w.device.type == "cpu"
            and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and bf16_packs()))
            and torch.backends.mkldnn.is_available())


def packed_bytes(model: nn.Module) -> int:
    """What ``pack`` adds: the bytes of every packable weight (a tied one counted once)."""
    seen = {id(m.weight): m.weight.numel() * m.weight.element_size() for m in model.modules() if packable(m)}
    return sum(seen.values())


# children of one module that read the same input, packed as one weight (their rows stacked):
# attention's q/k/v and a gated MLP's gate/up (lp.model.quant fuses the same for int8)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedProduct:
    """One product for the parts of a fused linear that read the same input tensor one after
    the other (the HF forwards call q, k, v, and gate, up, on one tensor in a row): the first
    part computes it, the others reuse it; a part asking again, or another input, starts a new
    round. Once every part has had it, no activation is held. A plain object, not a module
    (an nn.Module attribute write costs microseconds)."""

    def __init__(self, parts: int):
        self.parts = parts
        self._x = self._y = None
        self._served: set[int] = set()

    def get(self, x: torch.Tensor, part: int, compute) -> torch.Tensor:
        if x is not self._x or part in self._served:
            self._x, self._y, self._served = x, compute(x), set()
        self._served.add(part)
        y = self._y
        if len(self._served) == self.parts:
            self._x = self._y = None
        return y


class FusedGroup:
    """Sibling linears of one input (FUSED) computed as one packed matmul over their stacked
    weights (``SharedProduct``), each member returning its columns. The stacked product is the
    same dot products as the separate ones (measured bit-equal here, oneDNN, 1-16 rows, fp32);
    one call instead of three (two) saves ~1 ms of a SmolLM2 step's ~14 ms of linears at one
    row (2-core EPYC, measured), and 90 custom-op hops of a compiled step."""

    def __init__(self, members: list[SmallRowsLinear]):
        sizes = [m.out_features for m in members]
        self.out_features = sum(sizes)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(torch.cat([m.weight.detach() for m in members]), None)
        self.key = len(PACKED)
        PACKED.append(weakref.ref(self.weight))
        self.share = SharedProduct(len(members))
        self.group_key = next(_KEYS)
        GROUPS[self.group_key] = weakref.ref(self, lambda _, key=self.group_key: GROUPS.pop(key, None))
        for i, m in enumerate(members):
            m._group = self  # what keeps the group alive (the forward reads it from GROUPS)
            m.fused_key, m.fused_index = self.group_key, i
            m.fused_columns = (sum(sizes[:i]), sum(sizes[: i + 1]))

    def output(self, member: SmallRowsLinear, x: torch.Tensor) -> torch.Tensor:
        start, stop = member.fused_columns
        return self.share.get(x, member.fused_index, self._product)[..., start:stop]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.key, self.out_features)


def _fuse(model: nn.Module) -> None:
    """Give every group of FUSED siblings (all packable, one input width) one FusedGroup."""
    for module in model.modules():
        for names in FUSED:
            members = [getattr(module, n, None) for n in names]
            if (all(packable(m) and m.fused is None for m in members)
                    and len({(m.in_features, m.weight.dtype) for m in members}) == 1):
                FusedGroup(members)


@torch.inference_mode()
def pack(model: nn.Module) -> int:
    """Give every packable layer (``install`` first) its oneDNN-packed weight, once per
    model, siblings of one input (FUSED) one stacked weight; returns how many layers hold one."""
    _fuse(model)
    count = 0
    for module in model.modules():
        if packable(module):
            if module.packed_weight is None and module.fused is None:
                module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
                module.packed_key = len(PACKED)
                PACKED.append(weakref.ref(module.packed_weight))
            count += 1
    return count


class SharedInputPart(nn.Module):
    """One of several linears that read the same input, fused into one module with ``splits``
    and ``shared(x, part)`` (lp.model.quant's ``RowInt8Linear``, lp.kernels.exact4's ``Exact4Linear``):
    the model calls each part as before (``self.q_proj(x)``, ``self.k_proj(x)``, ...); the
    first computes the fused product, each returns its own columns."""

    def __init__(self, fused: nn.Module, part: int):
        super().__init__()
        self.fused = [fused]  # a list: the fused module is registered once, on the parent
        self.part = part
        self.start = sum(fused.splits[:part])
        self.stop = self.start + fused.splits[part]
        self.in_features, self.out_features = fused.in_features, fused.splits[part]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused[0].shared(x, self.part)[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.stop} of a fused {type(self.fused[0]).__name__}"


def is_linear(m) -> bool:
    """A plain nn.Linear, or this module's swap of one (``SmallRowsLinear``)."""
    return type(m) is nn.Linear or type(m) is SmallRowsLinear


def fuse_siblings(model: nn.Module, make, accept=is_linear) -> int:
    """Every group of sibling linears that read one input (``FUSED``: q/k/v, gate/up) whose
    members all pass ``accept`` and share ``in_features``, replaced by ``make(parts)`` (a module
    with ``splits`` and ``shared``; None: the group stays as it is) registered on the parent as
    ``_lp_q_k_v`` / ``_lp_gate_up``, each member by its ``SharedInputPart``. Returns the linears
    replaced (lp.model.quant's int8 and lp.kernels.exact4's exact 4-bit modules)."""
    count = 0
    for parent in list(model.modules()):
        for names in FUSED:
            parts = [getattr(parent, n, None) for n in names]
            if not all(accept(p) for p in parts) or len({p.in_features for p in parts}) != 1:
                continue
            fused = make(parts)
            if fused is None:
                continue
            parent.add_module("_lp_" + "_".join(n.split("_")[0] for n in names), fused)
            for i, n in enumerate(names):
                setattr(parent, n, SharedInputPart(fused, i))
            count += len(names)
    return count
