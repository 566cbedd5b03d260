"""Small-row matmuls for the packed step on the CPU: ``W @ x.T`` instead of ``x @ W.T``.

Contract: ``install(model)`` swaps every bias-free ``nn.Linear`` with a plain float weight
(quantized linears of lp.quant / torchao keep their own kernels) for a
``SmallRowsLinear`` that shares its Parameters (tied weights stay tied) and returns the
model's one ``SmallRows`` switch (a second call returns the same switch). While the
switch is off, a swapped layer runs ``nn.Linear.forward`` unchanged, so the user's
``model.generate`` computes exactly what it did. ``ModelRunner`` turns the switch on for
its own forwards of 2 or more rows whose row count the calibration (lp.calibrate) found
faster this way, or for every such count with ``model.small_rows=on``.

Why: for x of 2-16 rows and a weight W stored [out, in], MKL's sgemm is several times
slower in the ``x @ W.T`` layout than as ``(W @ x.T).T`` on some CPUs. Measured on the
2-core AMD EPYC VM of this project (torch 2.13 CPU, MKL, 2 threads, fp32), one
576 x 49,152 head: 21 ms at 2 rows and 16 ms at 4 (``F.linear``) against 2.8 and 3.7 ms;
a whole SmolLM2 step of 2 / 4 / 8 rows: 87 / 78 / 73 ms against 44 / 49 / 66 ms, while one
row costs 55 ms either way. The result is the same product in another summation order
(differences at float rounding level, like any change of kernel).
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.switch.on:
            return F.linear(x, self.weight)
        x_MI = x.reshape(-1, x.shape[-1])
        if x_MI.shape[0] < 2:
            return F.linear(x, self.weight)
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
        # plain float weights only: a quantized linear (torchao tensor subclass, lp.quant)
        # runs its own kernel
        if type(module) is nn.Linear and module.bias is None and type(module.weight) is nn.Parameter:
            module.__class__ = SmallRowsLinear  # same object: same Parameters, hooks, tying
            module.switch = switch
    model._lp_small_rows = switch
    return switch
