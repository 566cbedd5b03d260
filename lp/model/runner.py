"""The one module that adapts transformers models for packed steps: forward, cache edits.

Contract: ``ModelRunner.forward(layout, cache)`` runs one packed step through the
model's *public* forward (or, for an exact4 Llama, lp.kernels.fused's stack, kept only where it
equals that forward bit for bit: ``model.fused``) with explicit ``position_ids``, a mask built from the
layout's parent forest, and a ``lp.model.kv.PackedCache`` (static, in-place); only the
rows in ``layout.keep`` go through the LM head. It returns float32 logits, one row
per kept row, on the model's device. ``crop`` and ``compact`` edit the cache after
publication. No transformers class is patched.

Attention (``model.attention``): ``sdpa`` and ``eager`` take an additive [1, 1, Q, K+Q]
mask (a view of a buffer allocated once); ``flex`` a FlexAttention BlockMask;
``flash`` the cascade kernel of lp.kernels.attention with only the [Q, Q] local block.
Models with sliding-window layers get the window applied in the mask (a dict
{"full_attention", "sliding_attention"} for models mixing both kinds).

Linears (``model.linears``): ``packed`` runs every plain float linear on its oneDNN-prepacked
weight (lp.kernels.linears.pack), ``plain`` on torch's own; small-row matmuls take over the row
counts the calibration found faster still (``model.small_rows``).

Legend: Q packed rows this step, K cached rows, V vocabulary.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import itertools
import logging
import types

import torch

from lp.kernels import linears
from lp.model.calibrate import QS as TIMED_ROWS
from lp.lookahead.layout import Layout

log = logging.getLogger(__name__)
# the compiled step's guards: none on the model's modules and parameters (they do not change
# while a runner serves; what picks a graph, the inputs' shapes, stays guarded). Evaluating
# them cost ~1.8 ms a step here (SmolLM2's 30 layers; torch.profiler, "TorchDynamo Cache Lookup").
# Dynamo keeps its graphs on the traced function's code object and tells models apart by those
# very guards, so each runner compiles its own copy of the forward (``_own_forward``).
_COMPILE_OPTIONS = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


def _own_forward(model):
    """``model.forward`` as a method of a new function object over a copy of its code: dynamo's
    graphs for it are this model's alone (another model of the same class compiles its own)."""
    fn = getattr(model.forward, "__func__", None) or type(model).forward
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    own.__dict__.update(fn.__dict__)
    return types.MethodType(own, model)



# ---------------------------------------------------------------------------
# packed forward

ATTENTION = ("auto", "sdpa", "eager", "flex", "flash", "rowexact")
# model.attention (resolved) -> the attention implementation registered with transformers
ATTN_IMPLS = {"sdpa": "sdpa", "eager": "eager", "flex": "lp_flex", "flash": "lp_cascade", "rowexact": "lp_rowexact"}
COMPILE = ("auto", "on", "off")
FUSED = ("auto", "on", "off")


def resolve_attention(name: str, device: torch.device, loaded: str = "sdpa") -> str:
    """``auto``: flash (cascade over flash-attn) or flex on CUDA; on the CPU the kernel the
    model was loaded with (sdpa or eager); ``rowexact`` wherever the model holds it (lp.model.quant's
    int8 sets it: lp.kernels.exact_attention)."""
    from lp.kernels.attention import flash_attn_available

    if name not in ATTENTION:
        raise ValueError(f"model.attention must be one of {', '.join(ATTENTION)}, got {name!r}")
    if name == "auto":
        if loaded == "lp_rowexact":
            return "rowexact"
        if device.type == "cuda":
            return "flash" if flash_attn_available() else "flex"
        return loaded if loaded in ("sdpa", "eager") else "sdpa"
    return name


def resolve_linears(name: str, model, device: torch.device, quant: str) -> str:
    """``auto``: oneDNN-packed linears (lp.kernels.linears.pack) on the CPU for an unquantized model
    (or the float linears an exact4 model keeps, its head) whose packed copy fits in half the
    memory available now; ``plain`` otherwise."""
    if name not in linears.LINEARS:
        raise ValueError(f"model.linears must be one of {', '.join(linears.LINEARS)}, got {name!r}")
    if name == "plain":
        return name
    onednn = device.type == "cpu" and torch.backends.mkldnn.is_available()
    if name == "packed":
        if not onednn:
            raise ValueError(f"model.linears=packed needs the CPU with oneDNN (torch.backends.mkldnn); "
                             f"this model is on {device}: use model.linears=auto or plain")
        return name
    if not onednn or quant not in ("none", "exact4"):  # exact4 leaves float linears (the head) to pack
        return "plain"
    linears.install(model)  # the swap alone changes nothing: its switch is off outside lp's forwards
    size = linears.packed_bytes(model)  # 0 under TP (DTensor shards) or with nothing packable
    return "packed" if 0 < size < 0.5 * _available_bytes() else "plain"


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _available_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return float("inf")


class ModelRunner:
    """Drives one causal LM through packed lookahead steps.

    Per-step state lives in buffers allocated once: the ``PackedCache`` (lp.model.kv), an
    additive mask buffer on the model's device where a step writes only its Q x Q local
    block (the cached prefix is visible to every row by construction), and per-shape
    device tensors (position offsets, kept rows, local block) cached on the layout's
    ``Skeleton``. A step sends its token ids to the device and nothing else.
    """

    def __init__(self, model, attention: str = "auto", cuda_graphs: bool = False, static_shapes: bool = False,
                 small_rows: str = "auto", quant: str | None = None, linears: str = "auto",
                 compile: str = "auto", head: str = "auto", fused: str = "auto"):
        config = model.config
        if quant not in (None, "none") and getattr(model, "_lp_quant", None) is None:
            from lp.model.quant import quantize

            quantize(model, quant)  # in place: model.generate then runs the same quantized model
        # the scheme the model holds (lp.model.quant), part of the t(Q) cache key
        self.quant = getattr(model, "_lp_quant", None) or "none"
        if not getattr(config, "is_decoder", True) or getattr(config, "is_encoder_decoder", False):
            raise ValueError("lookahead decoding needs a decoder-only causal LM")
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager", "lp_flex", "lp_cascade", "lp_rowexact"):
            raise ValueError(
                f"model attention implementation {impl!r} cannot take a custom 4-D mask; load the model with "
                "attn_implementation='sdpa' (or 'eager') and pick a kernel with model.attention=sdpa|eager|flex|flash"
            )
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # a GGUF model on lp's kernels may hold buffers alone (its blocks, packed)
        param = next(itertools.chain(model.parameters(), model.buffers()))
        self.device = param.device
        self.dtype = param.dtype
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = text_config.vocab_size
        self.softcapped = getattr(text_config, "final_logit_softcapping", None) is not None
        self.max_positions = getattr(text_config, "max_position_embeddings", None)
        window = getattr(text_config, "sliding_window", None)
        layer_types = getattr(text_config, "layer_types", None) or []
        self.sliding_window = window if window else None
        self.mixed_layers = "sliding_attention" in layer_types and "full_attention" in layer_types
        if self.sliding_window and layer_types and "sliding_attention" not in layer_types:
            self.sliding_window = None  # e.g. Qwen2 with use_sliding_window=False
        self.attention = resolve_attention(attention, self.device, impl)
        if getattr(text_config, "attn_logit_softcapping", None) is not None and self.attention != "eager":
            if attention != "auto":  # lp's kernels and torch's sdpa do not soft-cap
                raise ValueError(f"model.attention={attention}: this model soft-caps its attention logits (Gemma 2), "
                                 "which only the eager kernel computes; use model.attention=auto or eager")
            self.attention = "eager"
        if self.attention == "flash" and self.sliding_window is not None:
            raise ValueError(
                "model.attention=flash (cascade) needs full attention over the prefix; this model has "
                "sliding-window layers: use sdpa, eager or flex"
            )
        self.attn_impl = ATTN_IMPLS[self.attention]
        from transformers import PreTrainedModel

        configs = {id(m.config): m.config for m in model.modules() if isinstance(m, PreTrainedModel)}
        self._configs = list(configs.values())
        if self.attention in ("flex", "flash"):
            from lp.kernels import attention as attention_kernels

            attention_kernels.register()
        if self.attention == "rowexact":
            from lp.kernels import exact_attention

            exact_attention.register()
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"model.cuda_graphs=true needs a CUDA device; this model is on {self.device}")
        self.cuda_graphs = cuda_graphs
        if cuda_graphs and attention == "auto":
            self.attention, self.attn_impl = "sdpa", "sdpa"  # graphs run the dense-mask kernel
        self._device_tensors: dict = {}
        # static shapes (row buckets, whole-buffer attention): what CUDA graphs need; on the
        # CPU ``static_shapes=True`` runs the same path uncaptured (tests)
        self._static = None
        if cuda_graphs or static_shapes:
            from lp.model.graphs import StaticStepper

            self._static = StaticStepper(self, capture=cuda_graphs)
        self._mask = None  # [1, 1, Q_cap, K_cap] additive, 0 = visible
        self._dirty = (0, 0)  # columns holding the last step's local block
        self._setup_linears(model, small_rows, linears, compile == "on")
        self._setup_head(model, head)
        self._setup_compile(model, compile, cuda_graphs or static_shapes)
        self._setup_fused(model, fused)

    def _setup_linears(self, model, small_rows: str, linears_mode: str, compiled: bool = False) -> None:
        """The linear kernels of lp's forwards (lp.kernels.linears): small-row matmuls, packed weights."""
        # small-row matmuls (lp.kernels.linears): "on" for every step; "auto" for the row
        # counts in small_rows, those lp.model.calibrate measured faster (CPU only, none until
        # calibrated); see uses_small_rows
        if small_rows not in ("auto", "on", "off"):
            raise ValueError(f"model.small_rows must be auto, on or off, got {small_rows!r}")
        # quantized linears (lp.model.quant) run their own kernels: auto steps aside for them; so it
        # does for a compiled step (timing each Q both ways would compile a graph per variant)
        off = self.device.type != "cpu" or self.quant != "none" or compiled
        self.small_rows_mode = "off" if (small_rows == "auto" and off) else small_rows
        self.small_rows: frozenset[int] = frozenset()
        self._switch = None
        self.linears = resolve_linears(linears_mode, model, self.device, self.quant)
        if self.small_rows_mode != "off" or self.linears == "packed":
            self._switch = linears.install(model)
            if self.linears == "packed" and not linears.pack(model):
                raise ValueError("model.linears=packed found no plain float linear to pack (a quantized model, or "
                                 "tensor-parallel shards): use model.linears=auto or plain")

    def _setup_head(self, model, head: str) -> None:
        """``model.head`` (lp.kernels.head): the bf16 screen of a packed fp32 head for greedy steps."""
        from lp.kernels.head import HEADS, screen_head

        if head not in HEADS:
            raise ValueError(f"model.head must be one of {', '.join(HEADS)}, got {head!r}")
        self.head8 = None
        if self.quant == "exact4" and head == "auto":
            from lp.kernels import exact4

            self.head8 = exact4.head8(model)  # the head's exact 8-bit blocks, where it holds them
        self.head_screen = screen_head(model, head) if self.linears == "packed" and self.head8 is None else None
        if head == "screen" and self.head_screen is None:
            raise ValueError("model.head=screen needs a packed fp32 LM head (model.linears=packed, model.dtype=float32 "
                             "on the CPU): use model.head=auto or exact")

    def _setup_compile(self, model, compile: str, static: bool) -> None:
        """``model.compile``: this runner's forward, eager or under torch.compile."""
        if compile not in COMPILE:
            raise ValueError(f"model.compile must be one of {', '.join(COMPILE)}, got {compile!r}")
        # auto stays eager: a compile costs every new process 35 s to minutes, for a 7-15% faster
        # server on this project's CPU (run vs_vllm_compiled2, in bench/results' git history; one sequence's step:
        # bench/results/step_cost)
        self.compiled = compile == "on"
        if self.compiled and static:
            raise ValueError("model.compile=on and model.cuda_graphs=true are two ways to the same static step: pick one")
        self._forward = self._compiled_forward if self.compiled else model
        self._compiled = self._traced = None

    def _compiled_forward(self, **kwargs):
        """The model's forward under torch.compile (inductor), dynamic in the row count and the
        cache length: one graph for every step after a warm-up recompile, the linears opaque
        packed ops (lp.kernels.linears.packed_linear), K/V written in place into the PackedCache."""
        if self._compiled is None:
            log.info("model.compile=on: compiling the packed step with torch.compile (once per process; "
                     "inductor caches its kernels on disk for the next start)")
            self._traced = _own_forward(self.model)  # the code object dynamo keeps this runner's graphs on
            self._compiled = torch.compile(self._traced, dynamic=True, options=_COMPILE_OPTIONS)
        return self._compiled(**kwargs)

    def _setup_fused(self, model, fused: str) -> None:
        """``model.fused``: an exact4 Llama's decoder stack in two C++ calls a layer (lp.kernels.fused),
        kept only where its logits and cache equal the model's own forward bit for bit."""
        if fused not in FUSED:
            raise ValueError(f"model.fused must be one of {', '.join(FUSED)}, got {fused!r}")
        self.fused = None
        self.fused_why = "model.fused=off"
        if fused == "off":
            return
        if self.device.type != "cpu" or self.quant != "exact4" or self.compiled or self._static is not None \
                or self.attention not in ("sdpa", "eager"):
            self.fused_why = "fused steps need an exact4 model on the CPU, eager, with sdpa or eager attention"
        else:
            from lp.kernels import fused as fused_stack
            from lp.model.kv import PackedCache

            stacks, self.fused_why = fused_stack.candidates(model)
            refused = []
            for stack in stacks:  # the first that is bit-equal to the model's forward (C++ layers, else the loop)
                # the check's verdict, kept on the model per stack, attention and head (a second runner
                # over the same model, as tests and benches build, skips its two forwards)
                seen = model.__dict__.setdefault("_lp_fused_agrees", {})
                key = (type(stack).__name__, self.attention, type(model.get_output_embeddings()).__name__)
                if key not in seen:
                    seen[key] = fused_stack.agrees(model, stack, self._check_run, lambda: PackedCache(16))
                if seen[key]:
                    self.fused, self.fused_why = stack, ""
                    break
                refused.append(type(stack).__name__)
            if refused:
                log.info("decoder stack: %s refused: its logits differ from the model's own forward in this "
                         "transformers version", ", ".join(refused))
                if self.fused is None:
                    self.fused_why = "its logits differ from the model's own forward in this transformers version"
        if fused == "on" and self.fused is None:
            raise ValueError(f"model.fused=on: this model cannot run fused steps ({self.fused_why}); use auto or off")
        from lp.kernels.fused import LayerLoop

        log.info("decoder stack: %s", ("lp's loop over the layers' modules" if isinstance(self.fused, LayerLoop) else
                                       "fused (two C++ calls a layer)") if self.fused else
                 f"transformers' modules ({self.fused_why})")

    def _check_run(self, fn, ids_1Q, pos_1Q, mask, cache):
        with self._kernel(ids_1Q.shape[1]):
            return fn(input_ids=ids_1Q, position_ids=pos_1Q, attention_mask=mask, **{self._cache_kw: cache},
                      use_cache=True, logits_to_keep=0).logits[0].float()

    # -- per-generation state ---------------------------------------------------

    @torch.inference_mode()  # the mask buffer an inference tensor like the steps' own (one compiled graph)
    def new_cache(self, capacity: int | None = None, max_step_rows: int = 0):
        """A cache for ``capacity`` positions; the mask buffer is sized for steps of up to
        ``max_step_rows`` rows (longer steps, such as the prefill, get a one-off mask)."""
        from lp.model.kv import PackedCache

        if capacity is None:
            capacity = self.max_positions or 4096
        if self._static is not None:
            return self._static.new_cache(capacity, max_step_rows)
        if self.compiled:
            # buffer shapes are part of a compiled graph's guards (their strides): powers of two
            # bound the graphs to a few per process instead of one per generation's length
            capacity = _pow2(capacity)
            max_step_rows = _pow2(max_step_rows) if max_step_rows else 0
        if self.attention in ("sdpa", "eager", "rowexact"):
            shape = (1, 1, max(max_step_rows, 1), capacity)
            if self._mask is None or self._mask.shape != shape:
                self._mask = torch.zeros(shape, dtype=self.dtype, device=self.device)
            else:
                self._clear_dirty()
        self._dirty = (0, 0)
        # row-exact attention computes in float64: keep K/V in it, converted once on write
        return PackedCache(capacity, dtype=torch.float64 if self.attention == "rowexact" else None)

    def _clear_dirty(self) -> None:
        a, b = self._dirty
        if b > a:
            self._mask[:, :, :, a:b].zero_()

    def _tensors(self, sk):
        """Device tensors of one skeleton: position offsets, kept rows, local block."""
        t = self._device_tensors.get(sk)
        if t is None:
            if len(self._device_tensors) > 4096:
                self._device_tensors.clear()
            neg = torch.finfo(self.dtype).min
            local = torch.from_numpy(sk.local_mask().copy())
            local_add = torch.zeros(local.shape, dtype=self.dtype).masked_fill_(~local, neg)
            t = (
                torch.tensor(sk.depths, dtype=torch.long, device=self.device),
                torch.tensor(sk.keep, dtype=torch.long, device=self.device),
                local_add.to(self.device),
                local.to(self.device),
            )
            self._device_tensors[sk] = t
        return t

    # -- masks --------------------------------------------------------------------

    def _dense_mask(self, sk, local_add_QQ, cache_len: int, pos_Q: torch.Tensor):
        """Additive [1, 1, Q, K + Q] mask for sdpa/eager: a view of the buffer when the
        step fits, a one-off tensor otherwise (the prefill)."""
        q = sk.num_rows
        buf = self._mask
        if buf is not None and q <= buf.shape[2] and cache_len + q <= buf.shape[3]:
            self._clear_dirty()
            buf[0, 0, :q, cache_len : cache_len + q].copy_(local_add_QQ)
            self._dirty = (cache_len, cache_len + q)
            mask = buf[:, :, :q, : cache_len + q]
        else:
            mask = torch.zeros((1, 1, q, cache_len + q), dtype=self.dtype, device=self.device)
            mask[0, 0, :, cache_len:] = local_add_QQ
        if self.sliding_window is None:
            return mask
        key_pos = torch.cat([torch.arange(cache_len, device=self.device), pos_Q])
        far = (pos_Q[:, None] - key_pos[None, :]) >= self.sliding_window
        sliding = mask.masked_fill(far[None, None], torch.finfo(self.dtype).min)
        if self.mixed_layers:
            return {"full_attention": mask, "sliding_attention": sliding}
        return sliding

    def _flex_mask(self, sk, local_QQ, cache_len: int, pos_Q: torch.Tensor):
        from torch.nn.attention.flex_attention import create_block_mask

        q = sk.num_rows
        window = self.sliding_window

        def full(b, h, qi, kv):
            return (kv < cache_len) | local_QQ[qi, (kv - cache_len).clamp(min=0)]

        def sliding(b, h, qi, kv):
            kv_pos = torch.where(kv < cache_len, kv, pos_Q[(kv - cache_len).clamp(min=0)])
            return full(b, h, qi, kv) & (pos_Q[qi] - kv_pos < window)

        def block(fn):
            return create_block_mask(fn, None, None, q, cache_len + q, device=self.device)

        if window is None:
            return block(full)
        if self.mixed_layers:
            return {"full_attention": block(full), "sliding_attention": block(sliding)}
        return block(sliding)

    # -- the step -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, layout: Layout, cache, argmax_only: bool = False) -> torch.Tensor:
        """Run the packed rows; return logits [len(layout.keep), V] (float32) on the model's device.
        ``argmax_only``: the caller reads only each row's argmax (greedy, no processor, no logprobs):
        the head's screen (lp.kernels.head) may answer, its argmax exact, its other values not logits."""
        if self._static is not None:
            return self._static.forward(layout, cache)
        sk = layout.skeleton
        depths_Q, keep, local_add_QQ, local_QQ = self._tensors(sk)
        cache_len = cache.get_seq_length()
        pos_Q = depths_Q + cache_len
        if self.attention == "flex":
            mask = self._flex_mask(sk, local_QQ, cache_len, pos_Q)
        elif self.attention == "flash":
            mask = local_add_QQ[None, None]
        else:
            mask = self._dense_mask(sk, local_add_QQ, cache_len, pos_Q)
        ids_1Q = torch.tensor([layout.tokens], dtype=torch.long).to(self.device, non_blocking=True)
        with self._kernel(sk.num_rows, argmax_only=argmax_only):
            out = (self.fused or self._forward)(
                input_ids=ids_1Q,
                position_ids=pos_Q[None],
                attention_mask=mask,
                **{self._cache_kw: cache},
                use_cache=True,
                logits_to_keep=keep,
            )
        return out.logits[0].float()

    def uses_small_rows(self, rows: int) -> bool:
        """Whether a forward of ``rows`` rows runs small-row matmuls (lp.kernels.linears)."""
        if self._switch is None or rows < 1:
            return False
        if self.small_rows_mode == "on":
            return True
        # a row count the calibration did not time (17-19, 21-23, ..., > 64: batched steps)
        # takes the choice of the nearest timed count at or above it
        at = bisect.bisect_left(TIMED_ROWS, rows)
        return TIMED_ROWS[min(at, len(TIMED_ROWS) - 1)] in self.small_rows

    @contextlib.contextmanager
    def _kernel(self, rows: int = 1, attn_impl: str | None = None, argmax_only: bool = False):
        """Select this runner's kernels for one forward of ``rows`` rows (its attention
        function; small-row matmuls where chosen) and restore the model's own afterwards
        (the user's model keeps working with ``generate``; runners with different kernels
        may share one model). One attention attribute per model config."""
        impl = attn_impl or self.attn_impl
        saved = [c._attn_implementation_internal for c in self._configs]
        swap = any(v != impl for v in saved)
        small = self.uses_small_rows(rows)
        packed = self.linears == "packed"
        head8 = self.head8 is not None
        # a soft-capped head (Gemma 2) squashes the screen's values, whose order alone is exact
        screen = argmax_only and not self.softcapped and (self.head_screen is not None or head8)
        if swap:
            for c in self._configs:
                c._attn_implementation_internal = impl
        if small:
            self._switch.on = True
        if packed:
            self._switch.packed = True
        if screen:
            linears.ARGMAX_ONLY.on = True
        if head8:
            linears.HEAD8_ON.on = True
        try:
            yield
        finally:
            if screen:
                linears.ARGMAX_ONLY.on = False
            if head8:
                linears.HEAD8_ON.on = False
            if small:
                self._switch.on = False
            if packed:
                self._switch.packed = False
            if swap:
                for c, v in zip(self._configs, saved):
                    c._attn_implementation_internal = v

    @staticmethod
    def crop(cache, length: int) -> None:
        """Keep the first ``length`` cached rows."""
        cache.crop(length)

    @staticmethod
    def compact(cache, keep_len: int, src_rows: list[int]) -> None:
        """Move cached rows ``src_rows`` (absolute indices) to ``keep_len..`` and drop the rest."""
        cache.compact(keep_len, src_rows)
