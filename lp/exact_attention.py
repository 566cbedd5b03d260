"""Row-exact attention (``lp_rowexact``): a row's output does not depend on the other rows.

Contract: ``register()`` adds ``lp_rowexact`` to transformers' public ``AttentionInterface``
(with the ``eager`` additive mask format in ``AttentionMaskInterface``). It computes
q.k, the softmax and the weighted sum of values in float64 and rounds the result to the
model's dtype once. Products of float32 values are exact in float64, so the only
difference between a row computed alone (a ``generate`` step) and inside a packed
lookahead step is the float64 summation order (~1e-16 relative), which changes the
float32 result only when it falls within that distance of a float32 rounding boundary
(about one output in 10^8-10^9). In practice a packed step computes every row bit for bit
as a one-row step does (tests/test_quant.py checks it bitwise on a tiny model; on SmolLM2
lookahead == generate).

Why: with quantized activations (lp.quant's int8), a float32 rounding difference of 1e-7
in a linear's input flips an int8 rounding now and then, and the flip moves the logits by
up to ~0.3 (measured on SmolLM2: lookahead diverged from generate at top-2 gaps of 0.04
and 0.29 with sdpa). sdpa's kernels round differently for 1 and for Q rows; every other
op of a Llama-style layer is already row-wise (norms, rotary, elementwise MLP, lp.quant's
int8 linears with per-row scales). A sequential-sum variant (cumsum over keys, provably
order-exact) cost ~3x more per layer here; float64 matmuls cost about as much as sdpa on
these sizes.

Legend: B batch (1), H query heads, Hk key/value heads, g = H / Hk, R = g x Q rows, Q query rows,
K keys, D head size.
"""

from __future__ import annotations

import torch

ROWEXACT = "lp_rowexact"


def rowexact_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    q_BHQD, k_BHkKD, v_BHkKD = query, key, value
    B, H, Q, D = q_BHQD.shape
    Hk, K = k_BHkKD.shape[1], k_BHkKD.shape[2]
    g = H // Hk  # query heads per key/value head: folded into the rows, the keys are not repeated
    if scaling is None:
        scaling = D**-0.5
    if attention_mask is None:  # plain causal: row i sees keys [0, K - Q + i]
        pos = torch.arange(K, device=q_BHQD.device)
        visible_11QK = (pos[None, :] <= (K - Q + torch.arange(Q, device=q_BHQD.device))[:, None])[None, None]
    elif attention_mask.dtype == torch.bool:
        visible_11QK = attention_mask[..., :K]
    else:
        visible_11QK = attention_mask[..., :K] > torch.finfo(attention_mask.dtype).min / 2
    q_BHkRD = q_BHQD.reshape(B, Hk, g * Q, D).double()  # rows: (group member, query row)
    s_BHkRK = torch.matmul(q_BHkRD, k_BHkKD.double().transpose(-1, -2)) * scaling
    s_BHkgQK = s_BHkRK.view(B, Hk, g, Q, K).masked_fill(~visible_11QK[:, :, None], float("-inf"))
    p_BHkRK = torch.softmax(s_BHkgQK, dim=-1).view(B, Hk, g * Q, K)
    out_BHQD = torch.matmul(p_BHkRK, v_BHkKD.double()).to(q_BHQD.dtype).view(B, H, Q, D)
    return out_BHQD.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ROWEXACT, rowexact_attention_forward)
    AttentionMaskInterface.register(ROWEXACT, eager_mask)
