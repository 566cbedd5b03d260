"""A Llama-, Qwen2-, Qwen3-, Gemma-3- or Phi-3-style model's decoder stack on lp's exact kernels in two C++ calls a layer,
instead of transformers' module tree: the same operations on the same kernels, so the same bits,
checked when built.

Contract: ``build(model)`` returns a ``FusedDecoder`` for a model whose every decoder layer is
Llama's, Qwen2's, Qwen3's, Gemma 3's or Phi-3's (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``,
``Qwen3DecoderLayer``, ``Gemma3DecoderLayer``, ``Phi3DecoderLayer``: pre-norm attention and a gated MLP, SiLU or GELU-tanh,
rotary embeddings; biases on q/k/v only; Qwen3's and Gemma 3's RMSNorm of each q and k head before
the rotation; Gemma 3's sandwich norms, its sliding-window layers with their own rotary table, no
soft caps; Phi-3's q/k/v and gate/up each one linear, no sliding window, full rotary) with its norms
``lp.kernels.exact4.FusedRMSNorm`` and every decoder linear on one of lp's exact kernels
(``kernel_kind``: exact4, exact8, exact8x, exact16, exactq; siblings fused into one product or
not, each product of its own kind: a GGUF Q4_K_M file's Q4_K q/k beside its Q6_K v), on an
AVX-512 build, with ""; else (None, the reason). Calling it takes the arguments lp's steps give the
model's public forward (``input_ids``, ``position_ids``, ``attention_mask``, the cache as
``past_key_values`` or ``cache``, ``use_cache``, ``logits_to_keep``, the attention function's
extra keywords) and returns an object whose ``logits`` are what that forward returns.

Per layer: ``lp_exact4::attn_in`` (input norm, q/k/v product, rotary embedding), the cache's own
``update``, the attention function transformers would call (``config._attn_implementation``,
looked up per call: lp's runners switch it), ``lp_exact4::out_mlp`` (o product, residual, norm,
gate/up product, silu * up, down product, residual). On a batched step of lp.engine.batch (the
paged pool read in place, lp's C++ paged attention: what ``lp serve`` runs) the whole loop is one
call, ``lp_exact4::decoder_paged``: the same ops in the same order, the pool's writes and the
attention call being ``PagedCache.update``'s and ``batch_sdpa_forward``'s (tests/test_fused.py
holds its batches equal to ``generate``). Embedding, rotary tables, final norm and head are the
model's own modules. ``agrees(model, fused)`` runs both forwards on the same
prompt and tree step and says whether every logit and cached key and value is bit-equal; the
runner keeps the fused stack only when it is (a transformers version whose layer computes
anything differently falls back to its own forward).

Other layers (``LayerLoop``, ``build``'s second choice): Llama and Qwen2 layers the C++ stack does
not take (a linear off lp's kernels, a head size not a multiple of 32), Gemma 2 (soft caps) and Phi-3 layers with a sliding window or partial rotary run as lp's own Python loop over each
layer's modules, the same ops as transformers' forward without its module plumbing, under the
same ``agrees`` check.

Why: one decode step of SmolLM2 runs ~25 small ops a layer through nn.Module calls, decorators
and keyword plumbing; at one row that costs several ms of a ~13 ms step (bench/results/step_cost).
On a Qwen2.5-0.5B-shaped Q4_K_M file (Q5_0, Q8_0, Q6_K linears) one row's step took 26.4 ms
through the layer loop and 19.5-20.4 ms as decoder_paged; a Llama-3.2-1B shape (Q4_K, Q6_K) 46.5
and 40.0 (bench/results/gguf_formats/fused_mixed.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "Gemma3DecoderLayer", "Phi3DecoderLayer")


@dataclass
class _Layer:
    attn: torch.nn.Module
    ln1: torch.Tensor
    eps1: float
    ln2: torch.Tensor
    eps2: float
    inter: int
    qkv: list  # the q/k/v products, in order: (packed weights, outputs, kernel kind, bias or None) each
    o: tuple
    gate_up: list  # the gate/up products, in order
    down: tuple
    qk_norm: tuple = ()  # Qwen3, Gemma 3: (q norm weight, k norm weight), their eps in qk_eps
    qk_eps: tuple = ()
    post: tuple = ()  # Gemma 3's sandwich: (post-attention norm weight, post-feedforward one), eps in post_eps
    post_eps: tuple = ()
    sliding: bool = False  # a sliding-window layer (its window, its rotary table)
    gelu: bool = False  # gelu(gate, "tanh"), not silu(gate)
    type: str = "full_attention"  # its config.layer_types entry


class _Out:
    __slots__ = ("logits",)

    def __init__(self, logits):
        self.logits = logits


def kernel_kind(lin) -> int | None:
    """The kernel a linear module of lp.kernels runs, as lp_exact4's fused stack names it: 0 exact4,
    1 exact8, 2 exact8x, 3 exact16 float16, 16 exact16 bfloat16, 4..8 exactq, 20..28 idot; None for any
    other."""
    from lp.kernels.exact4 import Exact4Linear, Exact8Linear, Exact8xLinear, Exact16Linear
    from lp.kernels.exactq import ExactQLinear
    from lp.kernels.idot import IDotLinear

    kinds = {Exact4Linear: 0, Exact8Linear: 1, Exact8xLinear: 2}
    if type(lin) in kinds:
        return kinds[type(lin)]
    if type(lin) is Exact16Linear:
        return 16 if lin.bf16 else 3
    if type(lin) is ExactQLinear:
        return lin.qkind
    if type(lin) is IDotLinear:
        return lin.ikind
    return None


def _products(mods) -> tuple[list, list[int]] | None:
    """(the products that compute sibling linears ``mods`` side by side, each module's width): one
    per kernel linear, whole (a linear of its own, or SharedInputParts 0, 1, ... of one fused
    owner, in order); None where any is not one of lp's kernel linears."""
    from lp.kernels.linears import SharedInputPart

    out, widths, i = [], [], 0
    while i < len(mods):
        m = mods[i]
        if type(m) is SharedInputPart:
            owner = m.fused[0]
            group = mods[i:i + len(owner.splits)]
            if len(group) != len(owner.splits) or any(
                    type(g) is not SharedInputPart or g.fused[0] is not owner or g.part != j for j, g in enumerate(group)):
                return None
            widths += list(owner.splits)
            i += len(group)
        else:
            owner = m
            if len(getattr(owner, "splits", ())) != 1:
                return None
            widths.append(owner.out_features)
            i += 1
        kind = kernel_kind(owner)
        if kind is None:
            return None
        out.append((owner.p, owner.out_features, kind, owner.b))
    return out, widths


class _Rotary:
    """The model's rotary tables for a step, per layer type: one per type where its rotary module
    takes a ``layer_type`` (Gemma 3's local and global layers), else one shared by all."""

    def __init__(self, rotary, types):
        import inspect

        self.types = sorted(set(types))
        self.typed = "layer_type" in inspect.signature(rotary.forward).parameters

    def __call__(self, rotary, h, position_ids) -> dict:
        """``rotary``: the model's module, read per step (tests swap it)."""
        if self.typed:
            return {t: rotary(h, position_ids, t) for t in self.types}
        return dict.fromkeys(self.types, rotary(h, position_ids))


def _lists(products) -> tuple[list, list[int], list]:
    """lp_exact4's (p, meta, b) lists of products: meta (outputs, kind, bias index or -1) each."""
    ps, meta, bs = [], [], []
    for p, n, kind, b in products:
        ps.append(p)
        meta += [n, kind, len(bs) if b is not None else -1]
        if b is not None:
            bs.append(b)
    return ps, meta, bs


def _plan(model) -> tuple[list[_Layer], str]:
    from lp.kernels import exact4
    from lp.kernels.exact4 import FusedRMSNorm

    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not len(layers):
        return [], "no decoder layers at model.model.layers"
    config = model.config
    if getattr(config, "final_logit_softcapping", None) is not None:
        return [], "soft-capped logits"
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
    for name in ("embed_tokens", "rotary_emb", "norm"):
        if not hasattr(base, name):
            return [], f"no model.model.{name}"
    if getattr(model, "_lp_tp", 1) > 1:
        return [], "tensor-parallel shards (their all-reduces ride on module hooks)"
    if any(m._forward_hooks or m._forward_pre_hooks for m in layers.modules()):
        return [], "forward hooks on the decoder layers (the fused stack calls no module)"
    fast_floats = exact4.extension().avx512()  # else exact4's float kernels run a scalar loop: idot products only
    plan = []
    for i, layer in enumerate(layers):
        if type(layer).__name__ not in LAYERS:
            return [], f"decoder layer {type(layer).__name__} (fused: {', '.join(LAYERS)})"
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "sinks") or getattr(attn, "attn_logit_softcapping", None) is not None:
            return [], "attention with sinks or a soft cap"
        kind = types[i] if i < len(types) else "full_attention"
        if kind not in ("full_attention", "sliding_attention") or bool(getattr(attn, "sliding_window", None)) != (
                kind == "sliding_attention"):
            return [], f"layer {i}: type {kind!r} and its sliding window {getattr(attn, 'sliding_window', None)}"
        qk = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        if any(n is not None for n in qk) and not all(type(n) is FusedRMSNorm and tuple(n.weight.shape) == (attn.head_dim,)
                                                       for n in qk):
            return [], "q/k norms not one-op RMSNorms over a head"
        # Phi-3: q/k/v one linear (q, k, v outputs in order, as the C++ split reads them) and gate/up one
        # (gate then up: its forward's chunk(2)); up * act(gate) there, act(gate) * up here: the same bits
        fused_qkv, fused_mlp = hasattr(attn, "qkv_proj"), hasattr(mlp, "gate_up_proj")
        if fused_qkv or fused_mlp:
            if getattr(config, "sliding_window", None) is not None:
                return [], f"Phi-3 layers with a sliding window of {config.sliding_window} (config.sliding_window)"
            rotary = (getattr(config, "rope_parameters", None) or {}).get(
                "partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
            if int(attn.head_dim * rotary) != attn.head_dim:
                return [], f"partial rotary embeddings (partial_rotary_factor {rotary})"
        qkv = _products([attn.qkv_proj] if fused_qkv else [attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = _products([mlp.gate_up_proj] if fused_mlp else [mlp.gate_proj, mlp.up_proj])
        o, down = _products([attn.o_proj]), _products([mlp.down_proj])
        sandwich = LAYER_KINDS[type(layer).__name__] == "sandwich"
        norms = ((layer.input_layernorm, layer.pre_feedforward_layernorm, layer.post_attention_layernorm,
                  layer.post_feedforward_layernorm) if sandwich else (layer.input_layernorm, layer.post_attention_layernorm))
        if qkv is None or gate_up is None or o is None or down is None:
            return [], "a decoder linear not on one of lp's exact kernels"
        if not fast_floats and any(kind < 20 for _, _, kind, _ in qkv[0] + o[0] + gate_up[0] + down[0]):
            return [], "a decoder linear on exact4's float kernels, which this build runs as a scalar loop (no AVX-512)"
        if any(b is not None for _, _, _, b in o[0] + down[0] + gate_up[0]):
            return [], "o, gate, up or down with a bias (the fused stack adds q/k/v biases only)"
        if not all(type(n) is FusedRMSNorm for n in norms):
            return [], "norms not one-op RMSNorms"
        act = mlp.activation_fn if fused_mlp else mlp.act_fn
        gelu = type(act).__name__ == "GELUTanh" and getattr(getattr(act, "act", None), "keywords", None) == {"approximate": "tanh"}
        if type(act).__name__ not in ("SiLU", "SiLUActivation") and not gelu:
            return [], f"activation {type(act).__name__} (silu, gelu tanh)"
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        d = attn.head_dim
        if d % 32 or qkv[1] != ([(heads + 2 * kv_heads) * d] if fused_qkv else [heads * d, kv_heads * d, kv_heads * d]):
            return [], "head size not a multiple of 32, or q/k/v widths not the heads'"
        inter = gate_up[1][0] // (2 if fused_mlp else 1)
        if gate_up[1] != ([2 * inter] if fused_mlp else [inter, inter]):
            return [], "gate and up of different widths"
        plan.append(_Layer(attn, norms[0].weight.detach(), float(norms[0].variance_epsilon),
                           norms[1].weight.detach(), float(norms[1].variance_epsilon), inter,
                           qkv[0], o[0][0], gate_up[0], down[0][0],
                           tuple(n.weight.detach() for n in qk) if qk[0] is not None else (),
                           tuple(float(n.variance_epsilon) for n in qk) if qk[0] is not None else (),
                           tuple(n.weight.detach() for n in norms[2:]), tuple(float(n.variance_epsilon) for n in norms[2:]),
                           kind == "sliding_attention", gelu, kind))
    if len({bool(ly.qk_norm) for ly in plan}) > 1 or len({bool(ly.post) for ly in plan}) > 1:
        return [], "q/k norms or sandwich norms on some layers only"
    return plan, ""


class FusedDecoder:
    def __init__(self, model, layers: list[_Layer]):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.model = model
        self.base = model.model
        self.layers = layers
        self.config = model.config
        self.heads = self.config.num_attention_heads
        self.kv_heads = self.config.num_key_value_heads
        self._functions = ALL_ATTENTION_FUNCTIONS
        # each layer's product lists for attn_in and out_mlp, and decoder_paged's lists (one C++ call
        # for the whole stack on the paged pool: every layer's products in order, two counts a layer)
        self._calls = [((*_lists(ly.qkv),), (*_lists([ly.o, *ly.gate_up, ly.down]),), (list(ly.qk_norm), list(ly.qk_eps)),
                        (list(ly.post), list(ly.post_eps), ly.gelu)) for ly in layers]
        every = _lists([prod for ly in layers for prod in (*ly.qkv, ly.o, *ly.gate_up, ly.down)])
        self._lists = ([ly.ln1 for ly in layers], [ly.eps1 for ly in layers], [ly.ln2 for ly in layers],
                       [ly.eps2 for ly in layers], *every,
                       [c for ly in layers for c in (len(ly.qkv), len(ly.gate_up))],
                       [w for ly in layers for w in ly.qk_norm], [e for ly in layers for e in ly.qk_eps],
                       [w for ly in layers for w in ly.post], [e for ly in layers for e in ly.post_eps],
                       [int(ly.sliding) | 2 * int(ly.gelu) for ly in layers])
        self._rotary = _Rotary(self.base.rotary_emb, [ly.type for ly in layers])
        a = layers[0].attn
        inters = {ly.inter for ly in layers}
        same = (len(inters) == 1 and all(ly.attn.head_dim == a.head_dim and ly.attn.scaling == a.scaling
                                         and ly.attn.layer_idx == i for i, ly in enumerate(layers)))
        self._shape = (a.head_dim, inters.pop(), float(a.scaling)) if same else None
        self.whole = True  # False: the per-layer loop on the paged pool too (bench.step_profile compares)
        self.paged_calls = 0  # steps decoder_paged ran (tests read it)

    def _paged(self, cache, kwargs) -> bool:
        """Whether this step can run as one decoder_paged call: a batched step (lp.engine.batch) on
        the paged pool read in place, lp's C++ paged attention, every layer's pool allocated."""
        from lp.kernels import attention

        return (self.whole and self._shape is not None and getattr(cache, "PAGED_POOL", False) and cache._read is None
                and len(cache.keys) == len(self.layers) and "lp_spans" in kwargs
                and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
                and self.config._attn_implementation == attention.BATCH_SDPA
                and attention.native_attends(cache.keys[0].device, cache.keys[0].dtype, self._shape[0]))

    def _attention(self):
        """The function transformers' attention module calls for the model's current implementation
        (its own module's eager one for ``eager``)."""
        import sys

        eager = sys.modules[type(self.layers[0].attn).__module__].eager_attention_forward
        impl = self.config._attn_implementation
        if hasattr(self._functions, "get_interface"):
            return self._functions.get_interface(impl, eager)
        return eager if impl == "eager" else self._functions[impl]

    def __call__(self, input_ids, position_ids, attention_mask=None, past_key_values=None, cache=None,
                 use_cache=True, logits_to_keep=0, **kwargs):
        cache = cache if cache is not None else past_key_values
        assert cache is not None and input_ids.shape[0] == 1, "fused steps take one packed row set and a cache"
        base, ops = self.base, torch.ops.lp_exact4
        h = base.embed_tokens(input_ids)
        rope = self._rotary(base.rotary_emb, h, position_ids)
        full = rope.get("full_attention")
        local = rope.get("sliding_attention", full)
        full = local if full is None else full
        heads, kv_heads = self.heads, self.kv_heads
        if self._paged(cache, kwargs):
            from lp.kernels.attention import NATIVE_ROWS

            d, inter, scale = self._shape
            h = ops.decoder_paged(h, *self._lists, heads, kv_heads, d, inter, *full, *local, cache.keys, cache.values,
                                  cache._write, kwargs["lp_spans"], kwargs["lp_masks"], kwargs["lp_slots"], scale,
                                  NATIVE_ROWS)
            self.paged_calls += 1
            return self._head(h, logits_to_keep)
        attention = self._attention()
        for ly, (qkv, rest, qk, post) in zip(self.layers, self._calls):
            a = ly.attn
            cos, sin = rope[ly.type]
            q, k, v = ops.attn_in(h, ly.ln1, ly.eps1, *qkv, heads, kv_heads, a.head_dim, cos, sin, *qk)
            k, v = cache.update(k, v, a.layer_idx)
            mask = attention_mask[ly.type] if isinstance(attention_mask, dict) else attention_mask
            extra = {"sliding_window": a.sliding_window} if ly.sliding else {}
            out, _ = attention(a, q, k, v, mask, dropout=0.0, scaling=a.scaling, position_ids=position_ids,
                               use_cache=use_cache, **extra, **kwargs)
            h = ops.out_mlp(h, out, *rest, ly.ln2, ly.eps2, ly.inter, *post)
        return self._head(h, logits_to_keep)

    def _head(self, h, logits_to_keep):
        base = self.base
        h = base.norm(h)
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:, :]
        else:
            h = h[:, logits_to_keep, :]
        return _Out(self.model.lm_head(h))


# -- other families: lp's own loop over the layers' modules ----------------------------------------
# A layer of these classes runs as transformers' forward runs it, op for op, but without the module
# tree's per-call plumbing (nn.Module.__call__, decorators, keyword routing, output capture): each
# norm, linear and the attention function called directly. Gemma-3-270M's one-row forward: 10.0 ms
# of layers through the modules, 8.2 through this loop (this session's EPYC). ``agrees`` decides.

# attention classes whose forward the loop repeats: (q/k norms applied "before" or "after" the
# heads' transpose, or None: no q/k norms; the ``sliding_window`` it passes the attention function:
# "layer" (its own attribute), "config" (the config's) or None; Phi-3's q/k/v are one linear, sliced)
ATTENTIONS = {"LlamaAttention": (None, None), "Qwen2Attention": (None, "layer"),
              "Qwen3Attention": ("before", "layer"), "Gemma2Attention": (None, "layer"),
              "Gemma3Attention": ("after", "layer"),
              "Phi3Attention": (None, "config")}
# decoder layers: "pre" (input norm, attention, residual; post_attention_layernorm, MLP, residual) or
# "sandwich" (Gemma 3: a norm before and after the attention and the MLP each)
LAYER_KINDS = {"LlamaDecoderLayer": "pre", "Qwen2DecoderLayer": "pre", "Qwen3DecoderLayer": "pre",
               "Gemma2DecoderLayer": "sandwich", "Gemma3DecoderLayer": "sandwich",
               "Phi3DecoderLayer": "pre"}  # Phi-3's dropouts: eval only
# down(act(gate(x)) * up(x)); Phi-3's: gate, up = gate_up(x).chunk(2), down(up * act(gate))
MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "Gemma2MLP", "Gemma3MLP", "Phi3MLP")


@dataclass
class _LoopLayer:
    kind: str
    attn: torch.nn.Module
    norms: tuple  # the layer's norms' forward functions, in the order they apply
    q: object
    k: object
    v: object
    o: object
    q_norm: object
    k_norm: object
    qk_norm: str | None
    window: int | None
    gate: object
    up: object
    act: object
    down: object
    type: str
    rope: object
    eager: object
    qkv: object = None  # Phi-3: one q/k/v linear, sliced at (q_end, k_end)
    q_end: int = 0
    k_end: int = 0
    gate_up: object = None  # Phi-3: one gate/up linear, chunked
    softcap: float | None = None  # Gemma 2: the attention logits' soft cap (the eager kernel applies it)


def _loop_plan(model) -> tuple[list[_LoopLayer], str]:
    import sys

    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not len(layers):
        return [], "no decoder layers at model.model.layers"
    config = model.config
    if getattr(model, "_lp_tp", 1) > 1:
        return [], "tensor-parallel shards (their all-reduces ride on module hooks)"
    if model.training:
        return [], "training mode (dropouts)"
    if any(m._forward_hooks or m._forward_pre_hooks for m in layers.modules()):
        return [], "forward hooks on the decoder layers"
    for name in ("embed_tokens", "rotary_emb", "norm"):
        if not hasattr(base, name):
            return [], f"no model.model.{name}"
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
    plan = []
    for i, layer in enumerate(layers):
        kind = LAYER_KINDS.get(type(layer).__name__)
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if kind is None or type(attn).__name__ not in ATTENTIONS or type(mlp).__name__ not in MLPS:
            return [], (f"decoder layer {type(layer).__name__} / {type(attn).__name__} / {type(mlp).__name__} "
                        f"(the loop: {', '.join(LAYER_KINDS)})")
        qk_norm, window = ATTENTIONS[type(attn).__name__]
        norm_names = (("input_layernorm", "post_attention_layernorm") if kind == "pre" else
                      ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                       "post_feedforward_layernorm"))
        module = sys.modules[type(attn).__module__]
        rope = getattr(module, "apply_rotary_pos_emb", None)
        eager = getattr(module, "eager_attention_forward", None)
        if rope is None or eager is None:
            return [], f"no apply_rotary_pos_emb / eager_attention_forward beside {type(attn).__name__}"
        fused_qkv, fused_mlp = hasattr(attn, "qkv_proj"), hasattr(mlp, "gate_up_proj")
        window_size = (getattr(attn, "sliding_window", None) if window == "layer" else
                       getattr(config, "sliding_window", None) if window == "config" else None)
        q_end = config.num_attention_heads * attn.head_dim
        plan.append(_LoopLayer(
            kind, attn, tuple(getattr(layer, n).forward for n in norm_names),
            None if fused_qkv else attn.q_proj.forward, None if fused_qkv else attn.k_proj.forward,
            None if fused_qkv else attn.v_proj.forward, attn.o_proj.forward,
            attn.q_norm.forward if qk_norm else None, attn.k_norm.forward if qk_norm else None, qk_norm,
            window_size, None if fused_mlp else mlp.gate_proj.forward, None if fused_mlp else mlp.up_proj.forward,
            mlp.activation_fn if fused_mlp else mlp.act_fn, mlp.down_proj.forward,
            types[i] if i < len(types) else "full_attention", rope, eager,
            attn.qkv_proj.forward if fused_qkv else None, q_end,
            q_end + config.num_key_value_heads * attn.head_dim, mlp.gate_up_proj.forward if fused_mlp else None,
            getattr(attn, "attn_logit_softcapping", None)))
    return plan, ""


class LayerLoop:
    """The model's decoder stack as lp's loop over its layers' modules (the section above); called
    as ``FusedDecoder`` is, returns the same logits as the model's forward (``agrees``)."""

    def __init__(self, model, layers: list[_LoopLayer]):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.model = model
        self.base = model.model
        self.layers = layers
        self.config = model.config
        self._functions = ALL_ATTENTION_FUNCTIONS
        self._rotary = _Rotary(self.base.rotary_emb, [ly.type for ly in layers])

    def _attention(self, eager):
        impl = self.config._attn_implementation
        if hasattr(self._functions, "get_interface"):
            return self._functions.get_interface(impl, eager)
        return eager if impl == "eager" else self._functions[impl]

    def __call__(self, input_ids, position_ids, attention_mask=None, past_key_values=None, cache=None,
                 use_cache=True, logits_to_keep=0, **kwargs):
        cache = cache if cache is not None else past_key_values
        assert cache is not None and input_ids.shape[0] == 1, "loop steps take one packed row set and a cache"
        base = self.base
        h = base.embed_tokens(input_ids)
        rope = self._rotary(base.rotary_emb, h, position_ids)
        shape = h.shape[:-1]
        attention = None
        for ly in self.layers:
            a = ly.attn
            if attention is None:
                attention = self._attention(ly.eager)
            mask = attention_mask[ly.type] if isinstance(attention_mask, dict) else attention_mask
            cos, sin = rope[ly.type]
            hidden = (*shape, -1, a.head_dim)
            residual = h
            x = ly.norms[0](h)
            if ly.qkv is not None:
                qkv = ly.qkv(x)
                q = qkv[..., :ly.q_end].view(hidden).transpose(1, 2)
                k = qkv[..., ly.q_end:ly.k_end].view(hidden).transpose(1, 2)
                v = qkv[..., ly.k_end:].view(hidden).transpose(1, 2)
            elif ly.qk_norm == "before":
                q = ly.q_norm(ly.q(x).view(hidden)).transpose(1, 2)
                k = ly.k_norm(ly.k(x).view(hidden)).transpose(1, 2)
                v = ly.v(x).view(hidden).transpose(1, 2)
            else:
                q = ly.q(x).view(hidden).transpose(1, 2)
                k = ly.k(x).view(hidden).transpose(1, 2)
                v = ly.v(x).view(hidden).transpose(1, 2)
                if ly.qk_norm == "after":
                    q, k = ly.q_norm(q), ly.k_norm(k)
            q, k = ly.rope(q, k, cos, sin)
            k, v = cache.update(k, v, a.layer_idx)
            extra = {"sliding_window": ly.window} if ly.window is not None else {}
            if ly.softcap is not None:
                extra["softcap"] = ly.softcap
            out, _ = attention(a, q, k, v, mask, dropout=0.0, scaling=a.scaling, position_ids=position_ids,
                               use_cache=use_cache, **extra, **kwargs)
            out = ly.o(out.reshape(*shape, -1).contiguous())
            if ly.kind == "pre":
                h = residual + out
                residual = h
                x = ly.norms[1](h)
                if ly.gate_up is not None:
                    gate, up = ly.gate_up(x).chunk(2, dim=-1)
                    h = residual + ly.down(up * ly.act(gate))
                else:
                    h = residual + ly.down(ly.act(ly.gate(x)) * ly.up(x))
            else:
                h = residual + ly.norms[1](out)
                residual = h
                x = ly.norms[2](h)
                h = residual + ly.norms[3](ly.down(ly.act(ly.gate(x)) * ly.up(x)))
        h = base.norm(h)
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:, :]
        else:
            h = h[:, logits_to_keep, :]
        logits = self.model.lm_head(h)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:  # Gemma 2's forward, op for op
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        return _Out(logits)


def candidates(model) -> tuple[list, str]:
    """(the stacks that fit the model, best first: the fused C++ stack where every layer fits, lp's
    loop over the layers' modules where that does; why the C++ stack does not fit, or "")."""
    stacks = []
    layers, why = _plan(model)
    if layers:
        stacks.append(FusedDecoder(model, layers))
    loop, why_not = _loop_plan(model)
    if loop:
        stacks.append(LayerLoop(model, loop))
    return stacks, why if layers or loop else f"{why}; and not lp's layer loop: {why_not}"


def build(model) -> tuple[FusedDecoder | LayerLoop | None, str]:
    """(the fused stack, "") where every layer fits, else lp's loop over the layers' modules where
    that fits, else (None, why neither does)."""
    stacks, why = candidates(model)
    return (stacks[0], "") if stacks else (None, why)


@torch.inference_mode()
def agrees(model, fused: FusedDecoder, run, new_cache) -> bool:
    """Whether ``fused`` and the model's own forward give bit-equal logits and cache contents on
    a 7-token prompt, then a 3-row tree step (rows 1 and 2 both children of row 0). ``run(fn,
    ids, pos, mask, cache)`` calls a forward in the runner's kernel context; ``new_cache()`` makes an
    empty cache of 16 rows (lp.model.kv.PackedCache) for each forward."""

    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, 7), generator=gen)
    step = torch.randint(0, vocab, (1, 3), generator=gen)
    dtype = next(model.parameters()).dtype
    neg = torch.finfo(dtype).min
    causal = torch.full((7, 7), neg, dtype=dtype).triu(1)[None, None]
    tree = torch.zeros((1, 1, 3, 10), dtype=dtype)
    tree[0, 0, 0, 8:] = neg
    tree[0, 0, 1, 9] = neg
    tree[0, 0, 2, 8] = neg
    outs = []
    for fn in (model, fused):
        cache = new_cache()
        a = run(fn, prompt, torch.arange(7)[None], causal, cache)
        b = run(fn, step, torch.tensor([[7, 8, 8]]), tree, cache)
        kv = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None]
        outs.append((a, b, kv))
    (a0, b0, kv0), (a1, b1, kv1) = outs
    return (torch.equal(a0, a1) and torch.equal(b0, b1) and len(kv0) == len(kv1)
            and all(torch.equal(x, y) for x, y in zip(kv0, kv1)))
