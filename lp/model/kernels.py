"""Small-row matmuls for the packed step on the CPU: ``W @ x.T`` instead of ``x @ W.T``.

Contract: ``install(model)`` swaps every bias-free ``nn.Linear`` with a plain float weight
(quantized linears of lp.model.quant / torchao keep their own kernels) for a
``SmallRowsLinear`` that shares its Parameters (tied weights stay tied) and returns the
model's one ``SmallRows`` switch (a second call returns the same switch); the output
embedding (LM head) is marked to compute one row as two. While the
switch is off, a swapped layer runs ``nn.Linear.forward`` unchanged, so the user's
``model.generate`` computes exactly what it did. ``ModelRunner`` turns the switch on for
its own forwards whose row count the calibration (lp.model.calibrate) found faster this way, or
for every count with ``model.small_rows=on``.

Why: for x of 2-16 rows and a weight W stored [out, in], MKL's sgemm is several times
slower in the ``x @ W.T`` layout than as ``(W @ x.T).T`` on some CPUs. Measured on the
2-core AMD EPYC VM of this project (torch 2.13 CPU, MKL, 2 threads, fp32), one
576 x 49,152 head: 21 ms at 2 rows and 16 ms at 4 (``F.linear``) against 2.8 and 3.7 ms;
a whole SmolLM2 step of 2 / 4 / 8 rows: 87 / 78 / 73 ms against 44 / 49 / 66 ms, while one
row costs 55 ms either way. The result is the same product in another summation order
(differences at float rounding level, like any change of kernel).

One row: MKL's matrix-vector path on the LM head (49,152 x 576) takes 11 ms here, the
two-row GEMM 3.7 ms, so with the switch on the head computes a one-row input as two rows
(the second zero) and keeps the first; every other layer runs one row unchanged (its
GEMV is as fast). The calibration times Q = 1 both ways like any other Q.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SmallRows:
    """The switch shared by all swapped layers of one model."""

    def __init__(self):
        self.on = False


class SmallRowsLinear(nn.Linear):
    """An ``nn.Linear`` (no bias) that computes ``(W @ x.T).T`` when its switch is on and x has
    2 or more rows."""

    switch: SmallRows
    pad_one_row = False  # the LM head: one row runs as two (a GEMM), see the module doc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.switch.on:
            return F.linear(x, self.weight)
        x_MI = x.reshape(-1, x.shape[-1])
        if x_MI.shape[0] < 2:
            if not self.pad_one_row:
                return F.linear(x, self.weight)
            x_2I = torch.cat([x_MI, x_MI.new_zeros(1, x_MI.shape[1])])
            y_1O = (self.weight @ x_2I.t())[:, :1].t().contiguous()
            return y_1O.reshape(*x.shape[:-1], self.weight.shape[0])
        # contiguous: a transposed [M, O] view would reach attention as a query whose last
        # dimension is strided, and sdpa's CPU flash kernel would fall back to its ~3x slower
        # math path (measured: 8 sequences x 30 layers, 65 ms against 20)
        return (self.weight @ x_MI.t()).t().contiguous().reshape(*x.shape[:-1], self.weight.shape[0])


def install(model: nn.Module) -> SmallRows:
    switch = getattr(model, "_lp_small_rows", None)
    if switch is not None:
        return switch
    switch = SmallRows()
    for module in model.modules():
        # plain float weights only: a quantized linear (torchao tensor subclass, lp.model.quant)
        # runs its own kernel
        if type(module) is nn.Linear and module.bias is None and type(module.weight) is nn.Parameter:
            module.__class__ = SmallRowsLinear  # same object: same Parameters, hooks, tying
            module.switch = switch
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, SmallRowsLinear):
        head.pad_one_row = True
    model._lp_small_rows = switch
    return switch
