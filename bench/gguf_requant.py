"""Another GGUF format of a model from a GGUF file: ``python -m bench.gguf_requant SRC.gguf DST.gguf
--type Q8_0`` (or Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16).

Contract: every metadata field of SRC is copied; every 2-D tensor whose rows divide into the
format's blocks is dequantized (``gguf.dequantize``) and quantized to ``--type`` with the gguf
package's own quantizer (what ``llama-quantize --allow-requantize`` does in C); the other tensors
(norms, 1-D) are copied as they are. ``general.file_type`` is left as SRC had it. The benchmarks
and tests use it to hold the same model in the formats users download (Q8_0, Q4_0) when only one
file of it is at hand.
"""

from __future__ import annotations

import argparse

import numpy as np

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16")


def requantize(src: str, dst: str, kind: str) -> dict:
    """Write DST; returns {tensor type name: count} of what DST holds."""
    from collections import Counter

    import gguf
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, dequantize, quantize

    if kind not in TYPES:
        raise ValueError(f"--type must be one of {', '.join(TYPES)}, got {kind!r}")
    qtype = GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    reader = GGUFReader(src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)
    kinds = Counter()
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape)]  # numpy order [rows, K]
        if len(shape) == 2 and shape[1] % block == 0:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if kind == "F16":  # gguf's quantize has no F16 path: the values as float16
                writer.add_tensor(t.name, w.astype(np.float16))
            else:
                writer.add_tensor(t.name, quantize(w, qtype), raw_dtype=qtype)  # bytes [rows, row bytes]
            kinds[kind] += 1
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            kinds[t.tensor_type.name] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dict(kinds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", default="Q8_0", choices=TYPES)
    a = ap.parse_args(argv)
    print(requantize(a.src, a.dst, a.type))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
