"""GGUF files read as stored (issue 50, item 1): ``model.path`` may name a ``.gguf`` file, or a
folder holding exactly one and no ``config.json``.

Contract: ``gguf_file(path)`` returns the file a path names (None: not a GGUF path).
``load_gguf(file, dtype, device, quant, tokenizer)`` returns (model, tokenizer or None) like
lp.model.loader.load_model: the config and tokenizer (with its chat template) come from the file
through transformers' own GGUF readers, the model is built on the meta device, and every tensor is
read from the file with transformers' name map and tensor processors (the same names, the same
permutations, the same dequantization: ``gguf.dequantize``), except that a bias-free decoder
linear stored in a format of ``KEPT`` keeps its blocks, taken from the file's bytes (rows permuted
as the processor permutes them), never formed as float32 weights. ``model.quant=auto`` /
``exact4`` then runs them on lp.kernels.exact4's kernels, whose products are those of the float32
weights transformers' GGUF loader makes, because gguf.dequantize forms each weight with one
float32 rounding of an exact value:

* 4-bit, ``fma(q, d, c)`` (``Exact4Linear``): Q4_1 ``d * q + m``; Q4_0 ``d * (q - 8)`` (c = -8 d);
  Q4_K ``(d * scale) * q - dmin * min`` per 32 weights (d * scale and dmin * min are exact);
* 8-bit, ``q * d`` (``Exact8Linear``): Q8_0 ``d * q``; Q5_0 ``d * (q - 16)``.

Where the blocks do not run (``model.quant=none``, a CPU without exact4's AVX-512 path, a non-CPU
device) they are widened to those same float32 weights. Other formats (Q5_1, Q6_K and the other
K-quants, F16, BF16) and the embedding and head are dequantized to float32 as transformers does
(their own kernels: later), so the loaded model always computes what ``from_pretrained(gguf_file=
...)`` on the same file computes in float32, up to the kernels' summation order.

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
SUPER = 256  # weights of a K-quant super-block
# the formats kept as blocks: bytes per block (of 32, or of 256 for K-quants), the kernel's bits
KEPT = {"Q4_0": (18, 32, 4), "Q4_1": (20, 32, 4), "Q4_K": (144, SUPER, 4), "Q8_0": (34, 32, 8), "Q5_0": (22, 32, 8)}


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


def model_config(path, cache_dir: Path | None = None):
    """The transformers config of ``path``: a GGUF file's (kept in ``metadata_dir`` by an earlier
    load, else read by transformers' GGUF reader) or a folder's config.json."""
    from transformers import AutoConfig

    file = gguf_file(path)
    if file is None:
        return AutoConfig.from_pretrained(path)
    meta = metadata_dir(file, cache_dir) if cache_dir is not None else None
    if meta is not None and (meta / "config.json").is_file():
        return AutoConfig.from_pretrained(meta)
    return AutoConfig.from_pretrained(file.parent, gguf_file=file.name)


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


def blocks_q4k(data: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, c) in exact4's layout of a Q4_K tensor: super-blocks of 256 weights with float16 d
    and dmin and eight 6-bit (scale, min) pairs, one per 32 weights. gguf.dequantize computes
    (d * scale) * q - dmin * min in float32: d * scale (11 x 6 bits) and dmin * min are exact, so
    is their product with a 4-bit q, and the subtraction rounds once, which is the kernel's
    fma(q, D, -M) with D = d * scale and M = dmin * min per 32 weights."""
    nb = k // SUPER
    raw = np.ascontiguousarray(data).reshape(n, nb, 144)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = raw[..., 4:16].reshape(n, nb, 3, 4)
    lo6, hi6, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([lo6 & 0x3F, (mix & 0x0F) | ((lo6 >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([hi6 & 0x3F, (mix >> 4) | ((hi6 >> 2) & 0x30)], axis=-1).astype(np.float32)
    big_d = (d[..., None] * sc).reshape(n, nb * 8)
    big_m = (dmin[..., None] * mn).reshape(n, nb * 8)
    qs = raw[..., 16:144].reshape(n, nb, 4, 32)
    v = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb * 8, 32)  # sub-blocks 2j (low), 2j + 1 (high)
    q = (v[..., :16] | (v[..., 16:] << 4)).reshape(n, k // 2)
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(big_d), torch.from_numpy(-big_m)


def blocks8_of(data: np.ndarray, kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, d [N, K / 32] float32) of a Q8_0 or Q5_0 tensor, w = q * d exactly as
    gguf.dequantize computes it (d * x, x an int8, or Q5_0's 5-bit value minus 16)."""
    size = KEPT[kind][0]
    raw = np.ascontiguousarray(data).reshape(n, k // BLOCK, size)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = raw[..., 2:34].copy().view(np.int8)
    else:  # Q5_0: 4 bytes of high bits (bit i for weight i), then weight j | weight j + 16 << 4
        qh = raw[..., 2:6].copy().view("<u4")[..., 0]
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        low = np.concatenate([raw[..., 6:22] & 0x0F, raw[..., 6:22] >> 4], axis=-1)
        q = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8)
    return torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)), torch.from_numpy(d)


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


def metadata_dir(file: Path, cache_dir: Path) -> Path:
    """Where a GGUF file's metadata is kept once read (never its weights): ``cache_dir/gguf/<stem>-
    <size>-<mtime>``, holding the transformers config, the tokenizer and ``gguf.json`` (the
    architecture, the tensor processor's config and the GGUF -> transformers name map). Reading
    them through transformers parses the whole file (its tokenizer: ~590k fields for SmolLM2) a
    time each; a restart reads these small files instead."""
    st = file.stat()
    return Path(cache_dir) / "gguf" / f"{file.stem}-{st.st_size}-{st.st_mtime_ns}"


def _save_dir(target: Path, write) -> None:
    """``write(tmp)`` into a fresh folder, then renamed to ``target`` (another process's copy wins)."""
    import os
    import shutil

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(file: Path, dtype: torch.dtype | None = None, device: str = "cpu", quant: str = "auto",
              tokenizer: bool = True, cache_dir: Path | None = None):
    """(model, tokenizer or None) from a GGUF file (module doc). ``dtype``: the model's float dtype
    (None, ``model.dtype=auto``: float32, whose products the file's blocks give exactly); ``quant``:
    lp.model.quant's schemes, applied after loading (``auto`` runs the kept blocks on exact4);
    ``cache_dir``: where the file's metadata is kept (``metadata_dir``; None: read from the file)."""
    import json

    from accelerate import init_empty_weights
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint)

    dev = torch.device(device)
    torch_dtype = torch.float32 if dtype is None else dtype
    keep = dev.type == "cpu" and quant in ("auto", "exact4") and torch_dtype == torch.float32
    folder, name = file.parent, file.name
    meta = metadata_dir(file, cache_dir) if cache_dir is not None else None
    known = meta is not None and (meta / "gguf.json").is_file()
    if known:
        config = AutoConfig.from_pretrained(meta)
        info = json.loads((meta / "gguf.json").read_text())
    else:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    reader = GGUFReader(str(file))
    if not known:
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        info = {"arch": arch, "config": load_gguf_checkpoint(str(file), return_tensors=False)["config"]}
    parsed = {"config": info["config"], "tensors": {}}  # what the tensor processors may read
    processor = TENSOR_PROCESSORS.get(info["arch"], TensorProcessor)(config=info["config"])
    if not known:
        info["mapping"] = get_gguf_hf_weights_map(model, processor)
        if meta is not None:
            def write(tmp: Path) -> None:
                config.save_pretrained(tmp)
                (tmp / "gguf.json").write_text(json.dumps(info, default=str))
                if tokenizer:
                    gguf_tokenizer(file).save_pretrained(tmp)

            _save_dir(meta, write)
    mapping = info["mapping"]
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    kept = dequantized = 0
    for t in reader.tensors:
        kind = t.tensor_type.name
        hf = mapping.get(t.name)
        owner = modules.get(hf.rsplit(".", 1)[0]) if hf else None
        if (keep and kind in KEPT and hf.endswith(".weight") and type(owner) is torch.nn.Linear
                and owner.bias is None and owner is not head and owner.in_features % KEPT[kind][1] == 0):
            n, k = owner.out_features, owner.in_features
            size, per, bits = KEPT[kind]
            rows = _row_permutation(processor, t.name, n, mapping, parsed)
            if rows is not None and t.data.size == n * k // per * size:
                if bits == 8:
                    q, d = blocks8_of(t.data, kind, n, k)
                    owner._lp_blocks8 = (q[rows], d[rows])  # read by lp.kernels.exact4.convert
                else:
                    q, d, c = blocks_q4k(t.data, n, k) if kind == "Q4_K" else blocks_of(t.data, kind, n, k)
                    owner._lp_blocks = (q[rows], d[rows], c[rows])
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
    log.info("model.path=%s: %d tensors kept as their blocks (%s), %d dequantized to float32 (as "
             "transformers' GGUF loader does)", file, kept, " / ".join(KEPT), dequantized)
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
    model._lp_gguf_id = f"{file.name}:{file.stat().st_size}"  # lp.model.calibrate keys its t(Q) cache by it
    return model, (gguf_tokenizer(file, cache_dir) if tokenizer else None)


def gguf_tokenizer(file: Path, cache_dir: Path | None = None):
    """The file's tokenizer through transformers' GGUF reader, with the file's own chat template
    (``tokenizer.chat_template``) where that reader leaves it unset; read from ``metadata_dir``
    where an earlier load kept it."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    meta = metadata_dir(file, cache_dir) if cache_dir is not None else None
    if meta is not None and (meta / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(meta)
    tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    if not getattr(tok, "chat_template", None):
        field = GGUFReader(str(file)).fields.get("tokenizer.chat_template")
        if field is not None:
            tok.chat_template = bytes(field.parts[-1]).decode()
    return tok


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
    from lp.kernels.exact4 import widen, widen8

    count = 0
    for m in model.modules():
        blocks = m.__dict__.pop("_lp_blocks", None)
        blocks8 = m.__dict__.pop("_lp_blocks8", None)
        if isinstance(m, torch.nn.Linear) and m.weight.is_meta and (blocks or blocks8):
            w = widen(*blocks) if blocks else widen8(*blocks8)
            m.weight = torch.nn.Parameter(w, requires_grad=False)
            count += 1
    return count
