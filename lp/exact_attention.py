"""Row-exact attention (``lp_rowexact``): a row's output does not depend on the other rows.

Contract: ``register()`` adds ``lp_rowexact`` to transformers' public ``AttentionInterface``
(with the ``eager`` additive mask format in ``AttentionMaskInterface``); a model loaded or
switched to it computes every query row's attention with reductions whose order depends
only on that row's visible keys in position order: the q.k products reduce over the head
size alone, and the softmax denominator and the weighted sum of values are sequential
sums (``cumsum``) over the key axis, where a hidden key adds an exact 0. So a row at
position p computes the same bits whether it is the single row of a ``generate`` step or
one row of a packed lookahead step (its ancestors' K/V being the same bits, by induction).

Why: with quantized activations (lp.quant's int8) a float rounding difference of 1e-7
in a linear's input flips an int8 rounding now and then, and the flip moves the logits by
up to ~0.3 (measured on SmolLM2); sdpa's kernels round differently for 1 row and for Q
rows. With every other op of a Llama-style layer already row-wise (norms, rotary, the
int8 linears with per-row scales, elementwise MLP), this kernel makes the whole
quantized step row-exact, so lookahead equals ``generate`` on the same quantized model
bit for bit. It costs memory O(H x Q x K x D) per layer (fine for decode steps; the
prefill of a long prompt runs in chunks of rows).

Legend: B batch (1), H query heads, H_kv key/value heads, Q rows, K keys, D head size.
"""

from __future__ import annotations

import torch

ROWEXACT = "lp_rowexact"
_CHUNK = 1 << 22  # elements of one [rows, K, D] block per head group (bounds prefill memory)


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
    rows = max(1, _CHUNK // max(1, K * D * H))
    outs = []
    for a in range(0, Q, rows):
        b = min(Q, a + rows)
        s_BHqK = (q_BHQD[:, :, a:b, None, :] * k_BHKD[:, :, None, :, :]).sum(-1) * scaling
        s_BHqK = s_BHqK.masked_fill(~visible_11QK[:, :, a:b], float("-inf"))
        p_BHqK = torch.exp(s_BHqK - s_BHqK.amax(-1, keepdim=True))
        denom_BHq1 = p_BHqK.cumsum(-1)[..., -1:]
        num_BHqD = (p_BHqK[..., None] * v_BHKD[:, :, None, :, :]).cumsum(-2)[..., -1, :]
        outs.append(num_BHqD / denom_BHq1)
    out_BHQD = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out_BHQD.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ROWEXACT, rowexact_attention_forward)
    AttentionMaskInterface.register(ROWEXACT, eager_mask)
