"""Attention kernels for packed lookahead steps, registered through transformers' public
``AttentionInterface`` (no model class is patched).

Contract: a packed step's Q rows attend the whole cached prefix [0, K) and, inside the
step's own block [K, K + Q), only their ancestors (the tree mask). Two functions
exploit that shape; ``lp.model.runner.ModelRunner`` builds their masks and selects them:

* ``lp_flex``: torch FlexAttention; ``attention_mask`` is a ``BlockMask`` whose
  ``mask_mod`` is "kv in the prefix, or kv an ancestor" (plus the sliding window). On CUDA it
  runs compiled (``compiled_flex``): one graph for every step after a prefill and a step over a
  cache, whatever the rows, keys and block counts (tests/test_flex_recompiles.py).
* ``lp_cascade``: cascade attention. The prefix part has no mask at all, so it runs
  on a dense kernel (flash-attn's ``flash_attn_func`` on CUDA when importable; torch's
  CPU flash kernel otherwise) that also returns the log-sum-exp; the small local block
  runs with its tree mask in plain torch; the two are merged exactly:

      out = (exp(lse_p - m) * out_p + exp(lse_l - m) * out_l) / (exp(lse_p - m) + exp(lse_l - m))

  ``attention_mask`` is the additive [1, 1, Q, Q] local block. Sliding-window models
  are refused (the prefix would need a mask).
* ``lp_batch_sdpa``: a batched step of several sequences (lp.engine.batch): one custom op
  per layer, opaque to torch.compile, every sequence over its own keys, read in place from
  the paged pool (lp.model.paged), with its own mask (none for a one-row sequence); where
  everything is lies in three tensors (a span table, a flat mask and a flat slot list), so a
  compiled step's graph does not change with the batch. float32 on the CPU: lp's C++ op
  (``torch.ops.lp_attention.paged``, ``csrc/lp_attention.cpp``): the sequences of at most
  ``NATIVE_ROWS`` rows (decoding rows, small trees) in one parallel loop, longer ones (prefill
  chunks) one ATen sdpa each. Measured on the 2-vCPU Sapphire Rapids VM, 8 one-row sequences
  of 150-400 keys, SmolLM2's heads: 92 us a layer against 400 for one sdpa call a sequence from
  Python. Built and loaded only for a model on the CPU (``register(device)``). Elsewhere (bf16,
  CUDA, a build without AVX-512, no compiler, ``LP_NATIVE_ATTENTION=0``):
  ``lp::paged_attention``, one sdpa call per sequence from Python.

All return ``(out [B, Q, H, D], None)`` like transformers' own attention functions.

Legend: B batch (1), H query heads, H_kv key/value heads, Q rows, K cached rows, D head size.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import contextlib
import os
import threading
import warnings

import torch

from lp.kernels.build import build_extension, opaque_op

log = logging.getLogger(__name__)

FLEX = "lp_flex"
CASCADE = "lp_cascade"


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def batch_attention(attention: str, device: torch.device) -> str:
    """The kernel a batched step (lp.engine.batch) runs for a runner resolved to ``attention``:
    the cascade (``flash``: one sequence's unmasked prefix + its tree) has no batched form, so it
    becomes what ``model.attention=auto`` picks without flash-attn: ``flex`` on CUDA (one call per
    layer for the whole batch), ``sdpa`` elsewhere (``lp_batch_sdpa``); any other kernel as is."""
    if attention != "flash":
        return attention
    return "flex" if device.type == "cuda" else "sdpa"


def _repeat_kv(x_BHkvKD: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x_BHkvKD
    b, h, k, d = x_BHkvKD.shape
    return x_BHkvKD[:, :, None].expand(b, h, groups, k, d).reshape(b, h * groups, k, d)


# the device types whose flex calls run compiled, and torch.compile's backend there: on the CPU
# flex runs torch's unfused reference kernel (exact, for tests); a test adds "cpu" with the
# aot_eager backend to count dynamo's recompiles (tests/test_flex_recompiles.py: inductor's CPU
# flex template does not build with dynamic shapes on torch 2.13)
FLEX_COMPILE = {"cuda": "inductor"}


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from torch.nn.attention.flex_attention import flex_attention

    if kwargs.get("softcap") is not None:
        raise ValueError("model.attention=flex does not support attention logit soft-capping; use sdpa or eager")
    groups = query.shape[1] // key.shape[1]
    backend = FLEX_COMPILE.get(query.device.type)
    if backend is not None:
        out_BHQD = compiled_flex(backend)(query, key, value, block_mask=padded_block_mask(attention_mask),
                                          scale=scaling, enable_gqa=groups > 1)
    else:  # unfused reference kernel on the CPU: exact, for tests; torch warns about it once
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out_BHQD = flex_attention(query, key, value, block_mask=attention_mask, scale=scaling,
                                      enable_gqa=groups > 1)
    return out_BHQD.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=None)
def compiled_flex(backend: str = "inductor"):
    """flex_attention under torch.compile with dynamic shapes, one graph for every step after the
    first two (a prefill, whose rows equal its keys, and a step over a cache). Its inputs change
    in sizes only (rows, keys, the BlockMask's block counts: ``padded_block_mask`` keeps those
    >= 2, so dynamo never specializes them on 1), and the sizes are compiled without duck
    shaping: two sizes that happen to be equal on the first call (a prefill's rows and keys,
    2 query blocks and 2 key blocks) stay two symbols, not one guarded equality."""
    from torch.fx.experimental import _config as fx_config
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=True, backend=backend)

    def call(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return call


def padded_block_mask(mask):
    """``mask`` (a BlockMask) with its block tables at least 2 blocks wide and tall (zero rows
    and columns past its own: blocks no row reads), so a compiled flex sees the block counts as
    symbols from the first call instead of specializing on 1 (a graph for a cache of one block,
    another once it spans two). The same for every layer of a step: built once, kept on the mask."""
    padded = getattr(mask, "_lp_padded", None)
    if padded is not None:
        return padded
    from torch.nn.attention.flex_attention import BlockMask

    def pad(num_blocks, indices):
        if num_blocks is None:
            return None, None
        *batch, rows, cols = indices.shape
        num = num_blocks.new_zeros(*batch, max(rows, 2))
        num[..., :rows] = num_blocks
        idx = indices.new_zeros(*batch, max(rows, 2), max(cols, 2))
        idx[..., :rows, :cols] = indices
        return num, idx

    kv_num, kv_idx = pad(mask.kv_num_blocks, mask.kv_indices)
    full_num, full_idx = pad(mask.full_kv_num_blocks, mask.full_kv_indices)
    padded = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=mask.BLOCK_SIZE,
                                      mask_mod=mask.mask_mod, seq_lengths=mask.seq_lengths)
    mask._lp_padded = padded
    return padded


def prefix_attention(q_BHQD, k_BHkvKD, v_BHkvKD, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of every row over the prefix: (out [B,H,Q,D], lse [B,H,Q] float32)."""
    groups = q_BHQD.shape[1] // k_BHkvKD.shape[1]
    if q_BHQD.device.type == "cuda" and flash_attn_available():
        from flash_attn import flash_attn_func

        out_BQHD, lse_BHQ, _ = flash_attn_func(
            q_BHQD.transpose(1, 2), k_BHkvKD.transpose(1, 2), v_BHkvKD.transpose(1, 2),
            softmax_scale=scale, causal=False, return_attn_probs=True,
        )
        return out_BQHD.transpose(1, 2), lse_BHQ.float()
    k = _repeat_kv(k_BHkvKD, groups)
    v = _repeat_kv(v_BHkvKD, groups)
    if q_BHQD.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_BHQD, k, v, scale=scale)[:2]
        return out, lse.float()
    return _math_attention(q_BHQD, k, v, scale, None)


def _math_attention(q_BHQD, k_BHKD, v_BHKD, scale: float, mask_11QK) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q_BHQD.float(), k_BHKD.float().transpose(-1, -2)) * scale
    if mask_11QK is not None:
        scores = scores + mask_11QK.float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.matmul(probs, v_BHKD.float()).to(q_BHQD.dtype), lse


def merge_attention(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Exact combination of two attention results over disjoint key sets."""
    m = torch.maximum(lse_a, lse_b)
    wa = torch.exp(lse_a - m)[..., None]
    wb = torch.exp(lse_b - m)[..., None]
    out = (wa * out_a.float() + wb * out_b.float()) / (wa + wb)
    return out.to(out_a.dtype)


# rows of the cascade's query block computed at once: its local block is fp32 math attention,
# scores [B, H, rows, Q] (and their exponentials), so a 16k-token prompt's prefill in one piece
# needs H x 16k x 16k x 4 bytes twice (tens of GiB); in pieces of 1024 rows, 1/16 of that.
# ``LP_CASCADE_CHUNK_ROWS`` sets it (an integer >= 1); each row's result is the same either way
CASCADE_CHUNK_ROWS = 1024


def cascade_chunk_rows() -> int:
    value = os.environ.get("LP_CASCADE_CHUNK_ROWS")
    if value is None:
        return CASCADE_CHUNK_ROWS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LP_CASCADE_CHUNK_ROWS must be an integer >= 1 (rows of the cascade's prefill "
                         f"computed at once), got {value!r}")
    return int(value)


def cascade_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The cascade over query rows in pieces of ``cascade_chunk_rows()`` (a prompt's prefill is one
    long block: its [Q, Q] local scores would be materialized whole): every piece attends the
    whole prefix and the whole local block with its own rows of the mask."""
    if kwargs.get("softcap") is not None:
        raise ValueError("model.attention=flash does not support attention logit soft-capping; use sdpa or eager")
    q = query.shape[2]
    k = key.shape[2] - q
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    local_k = _repeat_kv(key[:, :, k:], groups)
    local_v = _repeat_kv(value[:, :, k:], groups)
    rows = cascade_chunk_rows()
    outs = []
    for r in range(0, q, rows):
        q_BHRD = query[:, :, r : r + rows]
        out_l, lse_l = _math_attention(q_BHRD, local_k, local_v, scale, attention_mask[:, :, r : r + rows])
        if k > 0:
            out_p, lse_p = prefix_attention(q_BHRD, key[:, :, :k], value[:, :, :k], scale)
            out_l = merge_attention(out_p, lse_p, out_l, lse_l)
        outs.append(out_l)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


# columns of a batched step's span table (``lp_spans`` [S, 7] int64, one row per sequence)
QO, ROWS, FIRST, KEYS, MASK, SLIDING, SLOTS = range(7)


def _paged_attention_shape(query, key, value, spans, masks, slots, scale, sliding):
    b, h, q, d = query.shape
    return query.new_empty(b, q, h, d)


@opaque_op("paged_attention(Tensor query, Tensor key, Tensor value, Tensor spans, Tensor masks, Tensor slots, "
           "float scale, bool sliding) -> Tensor", _paged_attention_shape)
def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: torch.Tensor,
                    masks: torch.Tensor, slots: torch.Tensor, scale: float, sliding: bool) -> torch.Tensor:
    """Every sequence of a batched step against its own keys in the paged pool, one call per
    layer (an op opaque to torch.compile: the graph is the same whatever the batch's shape).

    query [1, H, Q, D] (sequence after sequence); key / value the whole pool [1, H_kv, slots, D];
    ``spans`` [S, 7] int64 per sequence (columns QO .. SLOTS): its first row, its rows, its first
    pool slot (-1: fragmented, its slot indices are ``slots[SLOTS : SLOTS + keys]``), its keys, the
    offset of its [rows, keys] additive mask in the flat ``masks`` (-1: none, every key visible)
    and of its sliding-window mask (-1: none; read when ``sliding``). A row with 0 rows is
    padding. Returns [1, Q, H, D], contiguous."""
    groups = query.shape[1] // key.shape[1]
    table = spans.tolist()
    if any(first < 0 for _, q, first, *_ in table if q):
        gk_BHSD, gv_BHSD = _gather_slots(key, slots), _gather_slots(value, slots)
    outs = []
    for qo, q, first, k, mask_at, sliding_at, slots_at in table:
        if q == 0:
            continue
        if first >= 0:
            k_BHKD, v_BHKD = key[:, :, first : first + k], value[:, :, first : first + k]
        else:  # a view of the step's one gather of every fragmented sequence's slots
            k_BHKD = gk_BHSD[:, :, slots_at : slots_at + k]
            v_BHKD = gv_BHSD[:, :, slots_at : slots_at + k]
        at = sliding_at if sliding and sliding_at >= 0 else mask_at
        mask = masks[at : at + q * k].view(1, 1, q, k) if at >= 0 else None
        outs.append(_sdpa(query[:, :, qo : qo + q], k_BHKD, v_BHKD, mask, scale, groups))
    out_BHQD = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out_BHQD.transpose(1, 2).contiguous()


# rows of a sequence whose GQA query heads are folded into rows of their KV head (one sdpa call
# of groups x q rows per KV head): measured on SmolLM2's 9 / 3 heads here, K = 150 and 400, us,
# sdpa with enable_gqa / folded: q=2 36 / 26 and 48 / 42, q=3 46 / 30 and 68 / 50, q=8 50 / 48
# and 88 / 84, q=12 62 / 64 (one row: 15 / 23, its decode path stays)
FOLD_ROWS = range(2, 9)
# device types where only FOLD_ROWS fold (measured faster there); on any other (CUDA) every masked
# call of a GQA model folds: sdpa with a float mask and ``enable_gqa`` takes neither flash (no
# mask) nor mem-efficient (no GQA) there but the math kernel; folded, the head counts match and
# mem-efficient takes the mask (tests/test_gqa_masks.py records the calls on that path)
FOLD_MEASURED = {"cpu"}


def _sdpa(q_BHQD, k_BHKD, v_BHKD, mask, scale: float, groups: int) -> torch.Tensor:
    """One sequence's attention; a masked call of a GQA model as the folded call (2-8 rows,
    ``FOLD_ROWS``, on the CPU; every masked call elsewhere, ``FOLD_MEASURED``): the same
    products per (head, row), another blocking of the rows (equal to rounding)."""
    _, h, q, d = q_BHQD.shape
    measured = q_BHQD.device.type in FOLD_MEASURED
    if groups == 1 or mask is None or (measured and q not in FOLD_ROWS):
        return torch.nn.functional.scaled_dot_product_attention(q_BHQD, k_BHKD, v_BHKD, attn_mask=mask, scale=scale,
                                                                enable_gqa=groups > 1)
    kv = h // groups
    q_BGRD = q_BHQD.reshape(1, kv, groups * q, d)  # head h = g * groups + i: rows (i, row) of KV head g
    mask_GR = mask.expand(1, groups, q, mask.shape[-1]).reshape(1, 1, groups * q, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(q_BGRD, k_BHKD, v_BHKD, attn_mask=mask_GR, scale=scale)
    return out.view(1, h, q, d)


def _gather_slots(pool_BHPD: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool[:, :, slots] as one row gather of the pool seen as [H_kv x slots, D] (index_select
    over rows of a 2-D tensor copies whole rows; over dim 2 of the 4-D pool it is ~5x slower
    here): [1, H_kv, len(slots), D]."""
    _, h, p, d = pool_BHPD.shape
    rows = (slots[None, :] + torch.arange(h, device=slots.device)[:, None] * p).view(-1)
    return pool_BHPD.view(h * p, d).index_select(0, rows).view(1, h, slots.numel(), d)


# sequences of at most this many rows run lp's C++ loop (one task a sequence and query head);
# longer ones one ATen sdpa each. Measured here (9 / 3 heads, 400 keys, us): rows 2 34 vs 51
# (sdpa from Python), 4 71 vs 68, 8 141 vs 98, 16 267 vs 106
NATIVE_ROWS = 3
_NATIVE = None  # torch.ops.lp_attention.paged once register(a CPU device) loaded it


def _native_shape(query, key, value, spans, masks, slots, scale, sliding, max_rows):
    b, h, q, d = query.shape
    return query.new_empty(b, q, h, d)


def native_attention():
    """lp's C++ paged attention op where it was measured faster: built with AVX-512 or AVX2 + FMA
    (its scalar loop elsewhere is correct but not measured, so there the Python op stays); None
    also where it cannot be built (a warning, once) or ``LP_NATIVE_ATTENTION=0`` asks for the
    Python op."""
    if os.environ.get("LP_NATIVE_ATTENTION", "1") == "0":
        return None
    built = native_op()
    if built is None or not built[0].simd():
        return None
    return built[1]


@functools.lru_cache(maxsize=1)
def native_op():
    """(module, ``torch.ops.lp_attention.paged``) once built, or None where it cannot be."""
    try:
        mod = build_extension("lp_attention", "the batched step's attention")
    except ValueError as e:
        log.warning("%s; batched steps run one sdpa call per sequence instead", e)
        return None
    torch.library.register_fake("lp_attention::paged")(_native_shape)
    return mod, torch.ops.lp_attention.paged.default


def native_attends(device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``batch_sdpa_forward`` runs lp's C++ op on float32 queries, keys and values of this
    device, dtype and head size (lp.kernels.fused's one-call stack asks the same before it calls
    the op itself)."""
    return (_NATIVE is not None and torch.device(device).type == "cpu" and dtype == torch.float32
            and head_dim % 16 == 0)


def batch_sdpa_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, lp_spans=None,
                       lp_masks=None, lp_slots=None, sliding_window=None, **kwargs):
    """A batched step (lp.engine.batch): the step's rows are sequence after sequence; ``key`` and
    ``value`` are the whole paged pool (lp.model.paged, ``gather=False``); ``lp_spans``,
    ``lp_masks``, ``lp_slots`` say where each sequence's rows, keys and masks are
    (``paged_attention``). Each sequence attends its own keys only (a slice of the pool when
    its blocks are contiguous), so attention costs sum_s rows_s x keys_s, not
    (all rows) x (all keys). ``attention_mask`` is a placeholder; a layer that passes
    ``sliding_window`` (Gemma 3's local layers, Mistral) takes the sliding mask."""
    if kwargs.get("softcap") is not None:
        raise ValueError("batched steps do not support attention logit soft-capping; use model.attention=eager")
    if lp_spans is None:  # a layer that does not pass its keyword arguments on (StableLM's): the step's
        lp_spans, lp_masks, lp_slots = getattr(_STEP, "spans", None) or (None, None, None)
        assert lp_spans is not None, "lp_batch_sdpa called outside a batched step (no span table)"
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sliding = sliding_window is not None
    if native_attends(query.device, query.dtype, query.shape[-1]) and key.dtype == value.dtype == torch.float32:
        return _NATIVE(query, key, value, lp_spans, lp_masks, lp_slots, float(scale), sliding, NATIVE_ROWS), None
    return torch.ops.lp.paged_attention(query, key, value, lp_spans, lp_masks, lp_slots, float(scale), sliding), None


BATCH_SDPA = "lp_batch_sdpa"
_STEP = threading.local()  # the running batched step's span table, for layers that drop the keywords


@contextlib.contextmanager
def step_spans(extra: dict):
    """Within: ``batch_sdpa_forward`` reads this step's ``lp_spans`` / ``lp_masks`` / ``lp_slots``
    when the model's layers do not hand the forward's keyword arguments to their attention."""
    _STEP.spans = (extra["lp_spans"], extra["lp_masks"], extra["lp_slots"]) if extra else None
    try:
        yield
    finally:
        _STEP.spans = None


@functools.lru_cache(maxsize=1)
def _register_functions() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX, flex_attention_forward)
    AttentionInterface.register(CASCADE, cascade_attention_forward)
    AttentionInterface.register(BATCH_SDPA, batch_sdpa_forward)


def register(device: torch.device | str | None = None) -> None:
    """Register the functions with transformers (once per process). ``device``: the model's; on a
    CPU device also load lp's C++ paged attention for the batched steps (``native_attention``:
    built on its first load on a machine, 30-60 s), the one place it runs: a model on CUDA (or
    ``device`` None: a runner's flex / cascade kernels, which never read it) builds nothing."""
    _register_functions()
    global _NATIVE
    if _NATIVE is None and device is not None and torch.device(device).type == "cpu":
        _NATIVE = native_attention()
