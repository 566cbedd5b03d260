"""GGUF files read as stored (issue 50, item 1): ``model.path`` may name a ``.gguf`` file, or a
folder holding exactly one and no ``config.json``.

Contract: ``gguf_file(path)`` returns the file a path names (None: not a GGUF path).
``load_gguf(file, dtype, device, quant, tokenizer)`` returns (model, tokenizer or None) like
lp.model.loader.load_model: the config and tokenizer (with its chat template) come from the file
through transformers' own GGUF readers, the model is built on the meta device, and every tensor is
read from the file with transformers' name map and tensor processors (the same names, the same
permutations, the same dequantization: ``gguf.dequantize``), except that a bias-free decoder
linear stored as Q4_0 or Q4_1 blocks keeps its blocks: (q, d, c) taken from the file's bytes
(rows permuted as the processor permutes them), never formed as float32 weights.
``model.quant=auto`` / ``exact4`` then runs those blocks on lp.kernels.exact4, whose products are
those of the float32 weights transformers' GGUF loader makes: for Q4_1 ``w = d * q + m`` and for
Q4_0 ``w = d * (q - 8)``, both one float32 rounding of an exact product, which is the kernel's
``fma(q, d, c)`` with c = m or -8 d. Where the blocks do not run (``model.quant=none``, a CPU
without exact4's AVX-512 path, a non-CPU device) they are widened to those same float32 weights.
Other block formats (Q8_0, K-quants, F16, BF16) are dequantized to float32 as transformers does
(their own kernels: later), so the loaded model always equals ``from_pretrained(gguf_file=...)``
on the same file, in float32.

Why: llama.cpp and Ollama users hold GGUF files; before this lp converted its default model once to
a float32 folder and could not open any other GGUF. Legend: N output rows, K inputs, B blocks of
32 along K.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

BLOCK = 32
# bytes of one 32-weight block: (offset of d, offset of m or None, offset of the 16 nibble bytes, size)
LAYOUTS = {"Q4_0": (0, None, 2, 18), "Q4_1": (0, 2, 4, 20)}


def gguf_file(path) -> Path | None:
    """The GGUF file ``path`` names: itself when it ends in .gguf, the one .gguf of a folder
    without config.json; None otherwise. A folder with several .gguf files is a ValueError."""
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"model.path names a GGUF file that does not exist: {p}")
        return p
    if p.is_dir() and not (p / "config.json").exists():
        found = sorted(p.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"model.path {p} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}): "
                             "name one of them")
        return found[0] if found else None
    return None


def blocks_of(data: np.ndarray, kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K / 2] uint8, d [N, B] float32, c [N, B] float32) of a Q4_0 / Q4_1 tensor's bytes, in
    lp.kernels.exact4's layout (byte j of a block: weight j in its low nibble, weight j + 16 in its
    high one, as GGUF stores them), with w = fma(q, d, c) the weight gguf.dequantize computes."""
    d_off, m_off, q_off, size = LAYOUTS[kind]
    raw = np.ascontiguousarray(data).reshape(n, k // BLOCK, size)
    d = raw[..., d_off:d_off + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    if m_off is None:
        c = -8.0 * d  # exact: a power of two times a float16 value
    else:
        c = raw[..., m_off:m_off + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = raw[..., q_off:q_off + 16].reshape(n, k // 2)
    return torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(c)


def _row_permutation(processor, name: str, n: int, mapping: dict, parsed: dict) -> np.ndarray | None:
    """The rows the tensor processor puts where (a llama q/k un-permutation), or None when it does
    more than move whole rows (then the tensor is dequantized like any other)."""
    probe = np.arange(n, dtype=np.float64)[:, None]
    out = processor.process(weights=probe, name=name, tensor_key_mapping=mapping, parsed_parameters=parsed)
    if out.name != name or out.weights.shape != probe.shape:
        return None
    rows = np.asarray(out.weights)[:, 0]
    if not np.array_equal(np.sort(rows), probe[:, 0]):
        return None
    return rows.astype(np.int64)


def load_gguf(file: Path, dtype: str = "auto", device: str = "cpu", quant: str = "auto", tokenizer: bool = True):
    """(model, tokenizer or None) from a GGUF file (module doc). ``dtype``: the model's float dtype
    (``auto``: float32, whose products the file's blocks give exactly); ``quant``: lp.model.quant's
    schemes, applied after loading (``auto`` runs the file's Q4_0 / Q4_1 blocks on exact4)."""
    from accelerate import init_empty_weights
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint)

    from lp.model.loader import DTYPES

    dev = torch.device(device)
    if dtype not in ("auto", *DTYPES):
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES) + ['auto']}, got {dtype!r}")
    torch_dtype = torch.float32 if dtype == "auto" else DTYPES[dtype]
    keep = dev.type == "cpu" and quant in ("auto", "exact4") and torch_dtype == torch.float32
    folder, name = file.parent, file.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    parsed = load_gguf_checkpoint(str(file), return_tensors=False)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    reader = GGUFReader(str(file))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    mapping = get_gguf_hf_weights_map(model, processor)
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    kept = dequantized = 0
    for t in reader.tensors:
        kind = t.tensor_type.name
        hf = mapping.get(t.name)
        owner = modules.get(hf.rsplit(".", 1)[0]) if hf else None
        if (keep and kind in LAYOUTS and hf.endswith(".weight") and type(owner) is torch.nn.Linear
                and owner.bias is None and owner is not head and owner.in_features % BLOCK == 0):
            n, k = owner.out_features, owner.in_features
            rows = _row_permutation(processor, t.name, n, mapping, parsed)
            if rows is not None and t.data.size == n * k // BLOCK * LAYOUTS[kind][3]:
                q, d, c = blocks_of(t.data, kind, n, k)
                owner._lp_blocks = (q[rows], d[rows], c[rows])  # read by lp.kernels.exact4.convert
                kept += 1
                continue
        weights = dequantize(t.data, t.tensor_type)
        out = processor.process(weights=weights, name=t.name, tensor_key_mapping=mapping, parsed_parameters=parsed)
        hf = mapping.get(out.name)
        if hf is None:
            continue
        _assign(model, hf, torch.from_numpy(np.copy(out.weights)))
        dequantized += 1
    model.tie_weights()
    log.info("model.path=%s: %d tensors kept as their Q4_0 / Q4_1 blocks, %d dequantized to float32 (as "
             "transformers' GGUF loader does)", file, kept, dequantized)
    scheme = "none"
    if quant != "none":
        from lp.model.quant import quantize

        scheme = quantize(model, quant, dev)
    widened = _widen_left(model)
    if widened:
        log.info("model.quant=%s: %d linears' blocks widened to float32 (the weights transformers' GGUF loader "
                 "makes)", scheme, widened)
    meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if meta:
        raise ValueError(f"{file}: the GGUF file holds no tensor for {meta[:4]}{' ...' if len(meta) > 4 else ''}: "
                         "transformers' GGUF name map does not cover this model")
    if torch_dtype != torch.float32:
        model.to(torch_dtype)
    model.to(dev).eval()
    model._lp_gguf = str(file)
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tok


def _assign(model, hf: str, value: torch.Tensor) -> None:
    """Parameter or buffer ``hf`` of ``model`` set to ``value`` (float32), replacing a meta one."""
    owner_name, _, attr = hf.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    old = getattr(owner, attr)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"GGUF tensor for {hf} has shape {tuple(value.shape)}, the model expects {tuple(old.shape)}")
    if attr in owner._parameters:
        owner._parameters[attr] = torch.nn.Parameter(value.to(torch.float32), requires_grad=False)
    else:
        owner._buffers[attr] = value.to(old.dtype)


def _widen_left(model) -> int:
    """Every linear still holding file blocks (not run on exact4) gets their float32 weights."""
    from lp.kernels.exact4 import widen

    count = 0
    for m in model.modules():
        blocks = m.__dict__.pop("_lp_blocks", None)
        if blocks is not None and isinstance(m, torch.nn.Linear) and m.weight.is_meta:
            m.weight = torch.nn.Parameter(widen(*blocks), requires_grad=False)
            count += 1
    return count
