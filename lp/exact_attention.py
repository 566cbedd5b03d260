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

Legend: B batch (1), H query heads, H_kv key/value heads, Q rows, K keys, D head size.
"""

from __future__ import annotations

import torch

ROWEXACT = "lp_rowexact"


def rowexact_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    q_BHQD, k_BHKD, v_BHKD = query, key, value
    groups = q_BHQD.shape[1] // k_BHKD.shape[1]
    if groups > 1:
        k_BHKD = k_BHKD.repeat_interleave(groups, dim=1)
        v_BHKD = v_BHKD.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = q_BHQD.shape[-1] ** -0.5
    B, H, Q, D = q_BHQD.shape
    K = k_BHKD.shape[2]
    if attention_mask is None:  # plain causal: row i sees keys [0, K - Q + i]
        pos = torch.arange(K, device=q_BHQD.device)
        visible_11QK = (pos[None, :] <= (K - Q + torch.arange(Q, device=q_BHQD.device))[:, None])[None, None]
    elif attention_mask.dtype == torch.bool:
        visible_11QK = attention_mask[..., :K]
    else:
        visible_11QK = attention_mask[..., :K] > torch.finfo(attention_mask.dtype).min / 2
    s_BHQK = torch.matmul(q_BHQD.double(), k_BHKD.double().transpose(-1, -2)) * scaling
    s_BHQK = s_BHQK.masked_fill(~visible_11QK, float("-inf"))
    out_BHQD = torch.matmul(torch.softmax(s_BHQK, dim=-1), v_BHKD.double()).to(q_BHQD.dtype)
    return out_BHQD.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ROWEXACT, rowexact_attention_forward)
    AttentionMaskInterface.register(ROWEXACT, eager_mask)
