"""Row-exact attention (``lp_rowexact``): a row's output does not depend on the other rows.

Contract: ``register()`` adds ``lp_rowexact`` to transformers' public ``AttentionInterface``
(with the ``eager`` additive mask format in ``AttentionMaskInterface``). It runs torch's
sdpa on float64 copies of q, k and v (q.k, the softmax and the weighted sum of values all
in float64) and rounds the result to the model's dtype once. Products of float32 values are exact in float64, so the only
difference between a row computed alone (a ``generate`` step) and inside a packed
lookahead step is the float64 summation order (~1e-16 relative), which changes the
float32 result only when it falls within that distance of a float32 rounding boundary
(about one output in 10^8-10^9). In practice a packed step computes every row bit for bit
as a one-row step does (tests/test_quant.py checks it bitwise on a tiny model, and against
sdpa on a float model to 1e-5 in the logits; on SmolLM2 lookahead == generate).

Why: with quantized activations (lp.model.quant's int8), a float32 rounding difference of 1e-7
in a linear's input flips an int8 rounding now and then, and the flip moves the logits by
up to ~0.3 (measured on SmolLM2: lookahead diverged from generate at top-2 gaps of 0.04
and 0.29 with sdpa). sdpa's kernels round differently for 1 and for Q rows; every other
op of a Llama-style layer is already row-wise (norms, rotary, elementwise MLP, lp.model.quant's
int8 linears with per-row scales). A sequential-sum variant (cumsum over keys, provably
order-exact) cost ~3x more per layer here. sdpa's CPU kernel in float64 blocks over the
keys only (a row's sums never involve another row's values), shares each K/V head among
its query heads (``enable_gqa``) and skips fully masked key blocks: per SmolLM2 layer,
a 741-token prefill costs 23 ms against 94 ms for the float64 matmul + softmax it
replaced, a step of 8-32 rows the same (0.3-1.4 ms); both gave bit-identical outputs.

Legend: B batch (1), H query heads, Hk key/value heads, Q query rows, K keys, D head size.
"""

from __future__ import annotations

import torch

ROWEXACT = "lp_rowexact"


def rowexact_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    q_BHQD, k_BHkKD, v_BHkKD = query, key, value
    Q, K = q_BHQD.shape[2], k_BHkKD.shape[2]
    if attention_mask is None:  # plain causal: row i sees keys [0, K - Q + i]
        pos = torch.arange(K, device=q_BHQD.device)
        visible_11QK = (pos[None, :] <= (K - Q + torch.arange(Q, device=q_BHQD.device))[:, None])[None, None]
    elif attention_mask.dtype == torch.bool:
        visible_11QK = attention_mask[..., :K]
    else:
        visible_11QK = attention_mask[..., :K] > torch.finfo(attention_mask.dtype).min / 2
    # sdpa's CPU kernel in float64: blocked over keys (never over the other query rows'
    # values), GQA without repeating K/V, the causal prefill's masked blocks skipped
    out_BHQD = torch.nn.functional.scaled_dot_product_attention(
        q_BHQD.double(), k_BHkKD.double(), v_BHkKD.double(), attn_mask=visible_11QK, scale=scaling,
        enable_gqa=q_BHQD.shape[1] != k_BHkKD.shape[1])
    return out_BHQD.to(q_BHQD.dtype).transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ROWEXACT, rowexact_attention_forward)
    AttentionMaskInterface.register(ROWEXACT, eager_mask)
