"""Tiny random models of each family written as GGUF files, in any block format, for the tests.

Contract: ``write_tiny_gguf(path, arch, kinds, tokenizer, seed, tie, dims)`` writes a two-layer model of
llama.cpp architecture ``arch`` (``FAMILIES``: llama, qwen2, qwen3, gemma2, gemma3, phi3; ``OTHERS``:
starcoder2, stablelm) whose every tensor
the GGUF name map of transformers covers, and returns the file. ``kinds`` maps a tensor's role to
its GGML type: ``"embd"`` (token_embd), ``"output"`` (the untied head), ``"attn"`` (q, k, v, qkv,
o), ``"ffn"`` (gate, up, down) or a GGUF name part such as ``"attn_v"`` / ``"ffn_down"`` (checked
first, as llama.cpp's Q4_K_M keeps those in Q6_K); norms and biases are F32. ``tokenizer`` is the
``tokenizer.*`` fields of a real file (``tokenizer_fields``: SmolLM2's byte-level BPE, which
transformers builds for any architecture).

How: a first file with the metadata alone gives transformers' config and name map
(``get_gguf_hf_weights_map`` on the model built from it), so the tensors written are exactly the
names and shapes transformers reads. Quantized tensors are random blocks with finite float16
scales chosen so weights have a standard deviation near ``1 / sqrt(in)`` (random quants: the
weights are the blocks' values, not an approximation of anything); F32 / F16 / BF16 tensors are
random floats. The tests then hold lp's load of the file against ``from_pretrained(gguf_file=...)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for v and down and the head, Q8_0 for the embedding
Q4_K_M = {"attn": "Q4_K", "ffn": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "embd": "Q8_0", "output": "Q6_K"}
TINY = {"hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "head_dim": 64, "layers": 2}
FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
OTHERS = ("starcoder2", "stablelm")  # families lp runs on transformers' modules (LayerNorm, partial rotary, ...)

# each float16 field of a block: (byte offset, the weight scale it carries as a multiple of the
# target standard deviation): d ~ std / std(q), an offset m ~ -mean(q) * d
_F16 = {
    "Q4_0": [(0, 1 / 4.6)],
    "Q4_1": [(0, 1 / 4.6), (2, -7.5 / 4.6)],
    "Q5_0": [(0, 1 / 9.2)],
    "Q5_1": [(0, 1 / 9.2), (2, -15.5 / 9.2)],
    "Q8_0": [(0, 1 / 73.0)],
    "Q4_K": [(0, 1 / (4.6 * 31.5)), (2, 7.5 / (4.6 * 31.5))],  # d * scale * q - dmin * min
    "Q5_K": [(0, 1 / (9.2 * 31.5)), (2, 15.5 / (9.2 * 31.5))],
    "Q6_K": [(208, 1 / (18.5 * 74.0))],  # d * int8 scale * (q - 32)
    "Q2_K": [(80, 1 / (1.1 * 7.5)), (82, 1.5 / (1.1 * 7.5))],
    "Q3_K": [(108, 1 / (2.3 * 16.0))],
    "IQ4_NL": [(0, 1 / 65.0)],
    "IQ4_XS": [(0, 1 / (65.0 * 18.5))],  # d * (6-bit scale - 32) * code value
    # codebooks: d (0.5 + scale) / 4 (IQ2; IQ3_XXS / 2) times grid values of ~8-43 (IQ3: 4-62), IQ3_S d (1 + 2 scale),
    # IQ1_S d (2 s + 1) (grid +- 1/8), the ternary kinds d q
    "IQ2_XXS": [(0, 1 / 50.0)], "IQ2_XS": [(0, 1 / 50.0)], "IQ2_S": [(0, 1 / 50.0)], "IQ3_XXS": [(0, 1 / 120.0)],
    "IQ3_S": [(0, 1 / 128.0)], "IQ1_S": [(0, 1 / 8.0)], "TQ1_0": [(52, 1.25)], "TQ2_0": [(64, 1.25)],
}


def tokenizer_fields(file, vocab: int | None = None) -> list[tuple[str, object, object, object]]:
    """(key, value, type, sub type) of every ``tokenizer.*`` field of a GGUF file, for GGUFWriter;
    with ``vocab``, a byte-level BPE cut to its first ``vocab`` tokens (the merges whose parts and
    result all remain): a small model's head and a fast tokenizer build, the same text rules."""
    from gguf import GGUFReader, GGUFValueType

    out = []
    for key, field in GGUFReader(str(file)).fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            out.append((key, val, kind, sub))
        elif kind == GGUFValueType.STRING:
            out.append((key, bytes(field.parts[-1]).decode("utf-8"), kind, None))
        else:
            out.append((key, field.parts[-1].tolist()[0], kind, None))
    if vocab is not None:
        fields = {key: i for i, (key, *_) in enumerate(out)}
        tokens = out[fields["tokenizer.ggml.tokens"]][1][:vocab]
        kept = set(tokens)
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if key in fields:
                i = fields[key]
                out[i] = (key, out[i][1][:vocab], *out[i][2:])
        if "tokenizer.ggml.merges" in fields:
            i = fields["tokenizer.ggml.merges"]
            merges = [m for m in out[i][1] if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept]
            out[i] = (out[i][0], merges, *out[i][2:])
    return out


def _header(w, arch: str, tokenizer, dims: dict) -> None:
    w.add_block_count(dims["layers"])
    w.add_context_length(max(512, dims.get("context", 512)))
    w.add_embedding_length(dims["hidden"])
    w.add_feed_forward_length(dims["ffn"])
    w.add_head_count(dims["heads"])
    w.add_head_count_kv(dims["kv_heads"])
    if arch in ("starcoder2", "stablelm"):
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch in ("gemma2", "gemma3", "qwen3"):
        w.add_key_length(dims["head_dim"])
        w.add_value_length(dims["head_dim"])
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(8)  # shorter than the tests' prompts: the window matters
    if arch == "phi3":
        w.add_rope_dimension_count(dims["head_dim"])
    for key, val, kind, sub in tokenizer:
        w.add_key_value(key, val, kind, sub)


def _tensor_specs(path: Path, arch: str, tokenizer, tie: bool, dims: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, transformers shape) of every tensor transformers' name map reads for ``arch``."""
    import gguf
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint)

    probe = path.with_name(path.stem + ".header.gguf")
    w = gguf.GGUFWriter(str(probe), arch)
    _header(w, arch, tokenizer, dims)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = AutoConfig.from_pretrained(probe.parent, gguf_file=probe.name)
    config.tie_word_embeddings = tie
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(probe), return_tensors=False)["config"]
    probe.unlink()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed)
    mapping = get_gguf_hf_weights_map(model, processor)
    params = dict(model.named_parameters())
    specs = []
    for name, hf in sorted(mapping.items()):
        if hf in params and not (tie and name == "output.weight"):
            specs.append((name, tuple(params[hf].shape)))
    return specs


def _kind(name: str, kinds: dict) -> str:
    if name.endswith(".bias") or len(name.split(".")) > 1 and "norm" in name:
        return "F32"
    for part, kind in kinds.items():
        if f".{part}." in f".{name}" and part not in ("embd", "output", "attn", "ffn"):
            return kind
    if name.startswith("token_embd"):
        return kinds.get("embd", "Q8_0")
    if name.startswith("output."):
        return kinds.get("output", kinds.get("embd", "Q8_0"))
    role = "attn" if ".attn_" in name else "ffn"
    return kinds.get(role, "Q8_0")


def random_blocks(kind: str, n: int, k: int, std: float, rng) -> np.ndarray:
    """uint8 [n, bytes of a row] of random ``kind`` blocks whose weights have about ``std``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for off, scale in _F16[kind]:
        val = np.abs(rng.normal(1.0, 0.25, (n, k // per))) * scale * std
        raw[..., off:off + 2] = val.astype(np.float16).view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def write_tiny_gguf(path, arch: str, kinds: dict, tokenizer, seed: int = 0, tie: bool = True,
                    dims: dict | None = None) -> Path:
    """The file (module doc); ``dims`` (``TINY``'s keys) writes a model of another size."""
    import gguf

    assert arch in FAMILIES + OTHERS, arch
    path = Path(path)
    rng = np.random.default_rng(seed)
    dims = TINY if dims is None else dims
    specs = _tensor_specs(path, arch, tokenizer, tie, dims)
    w = gguf.GGUFWriter(str(path), arch)
    _header(w, arch, tokenizer, dims)
    for name, shape in specs:
        kind = _kind(name, kinds)
        if len(shape) == 1:
            if name.endswith(".bias"):
                data = rng.normal(0.0, 0.5, shape)
            elif arch == "gemma2" and ".post_" in name:  # the layers outweigh the tied input row
                data = rng.normal(4.0, 0.5, shape)
            else:  # a norm's scale (Gemma's files store 1 + w: ~1 either way)
                data = rng.normal(1.0, 0.1, shape)
            w.add_tensor(name, data.astype(np.float32))
            continue
        n, k = shape
        std = 1.0 / np.sqrt(k)
        if name.startswith("token_embd") and arch != "gemma2":  # Gemma 2 ties its head: logits ~1, not capped
            std = 1.0
        if kind in ("F32", "F16"):
            w.add_tensor(name, rng.normal(0.0, std, shape).astype(np.float32 if kind == "F32" else np.float16))
        elif kind == "BF16":
            w.add_tensor(name, gguf.quants.quantize(rng.normal(0.0, std, shape).astype(np.float32),
                                                    gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, random_blocks(kind, n, k, std, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
