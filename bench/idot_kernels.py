"""One product on lp.kernels.idot against the float kernel each format ran on before it:
``python -m bench.idot_kernels [--shapes 9728x896,896x4864,2048x2048] [--rows 1,2,4,8,16]``.

Contract: for every GGUF block format idot runs (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K),
random blocks as a file holds them (tests/gguf_tiny.random_blocks) read as lp.model.gguf reads
them, each shape N x K and row count M: ms of ``y = x @ W.T`` on idot (``IDotLinear``) and on the
float kernel (``Exact4Linear`` for Q4_0 / Q4_1 / Q4_K, ``Exact8Linear`` for Q8_0, ``ExactQLinear``
for the rest), interleaved, the minimum over ``--rounds`` rounds, and the bytes a weight each holds.
The matrices of one shape together exceed the L3 cache (each timed on its own: a one-row product
streams a matrix the cache may hold, so these are compute costs; bench.gguf_shapes has the model's).
Writes ``<out>/idot_kernels.md`` and ``.json`` with the command, the machine and the commit.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.envelope import command, commit, cpu_name, write

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def linears(fmt: str, n: int, k: int, rng) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(idot's linear, the float kernel's linear) over one random tensor of ``fmt``."""
    from lp.kernels.exact4 import Exact4Linear, Exact8Linear
    from lp.kernels.exactq import ExactQLinear
    from lp.kernels.idot import IDotLinear
    from lp.model.gguf import KEPT, KINDS, _read_blocks, blocksq_of
    from tests.gguf_tiny import random_blocks

    raw = random_blocks(fmt, n, k, 0.05, rng)

    def meta(**attrs):
        lin = torch.nn.Linear(k, n, bias=False, device="meta")
        for name, value in attrs.items():
            setattr(lin, name, value)
        return lin

    q = meta(_lp_blocksq=(KINDS[fmt], blocksq_of(raw, fmt, n, k))) if fmt in KINDS else None
    if fmt in ("Q4_0", "Q4_1", "Q4_K"):
        fl = Exact4Linear.of([meta(_lp_blocks=_read_blocks(raw, fmt, n, k, 4))])
    elif fmt == "Q8_0":
        fl = Exact8Linear.of([meta(_lp_blocks8=_read_blocks(raw, fmt, n, k, KEPT[fmt][2]))])
    else:
        fl = ExactQLinear.of([q])
    src = q if q is not None else (meta(_lp_blocks8=_read_blocks(raw, fmt, n, k, 8)) if fmt == "Q8_0"
                                   else meta(_lp_blocks=_read_blocks(raw, fmt, n, k, 4)))
    idot = IDotLinear.of([src])
    assert idot is not None and fl is not None, fmt
    return idot, fl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="9728x896,896x4864,2048x2048")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="bench/results/gguf_formats")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.rows.split(",")]
    rows = []
    for n, k in shapes:
        for fmt in FORMATS:
            if fmt.endswith("_K") and k % 256:
                continue
            a, b = linears(fmt, n, k, rng)
            for m in ms:
                x = torch.randn(m, k)
                best = {"idot": float("inf"), "float": float("inf")}
                with torch.no_grad():
                    for _ in range(args.rounds):
                        for name, lin in (("idot", a), ("float", b)):
                            t = time.perf_counter()
                            for _ in range(5):
                                lin(x)
                            best[name] = min(best[name], (time.perf_counter() - t) / 5)
                rows.append({"shape": f"{n}x{k}", "format": fmt, "rows": m, "idot_ms": best["idot"] * 1e3,
                             "float_ms": best["float"] * 1e3, "idot_bits": a.p.numel() * 8 / (n * k),
                             "float_bits": b.p.numel() * 8 / (n * k), "float_kernel": type(b).__name__})
                print(rows[-1], flush=True)
    lines = ["# idot against the float kernels, one product", "",
             f"`{command('bench.idot_kernels', None)}` at {commit()}, {cpu_name()}, {torch.get_num_threads()} threads; min of {args.rounds} "
             "interleaved rounds of 5 calls (module doc: matrices alone, the cache may hold them).", "",
             "| shape | format | float kernel | bits a weight idot / float | " +
             " | ".join(f"M={m} idot / float ms (x)" for m in ms) + " |",
             "|---|---|---|---|" + "---|" * len(ms)]
    for (shape, fmt) in dict.fromkeys((r["shape"], r["format"]) for r in rows):
        rs = [r for r in rows if r["shape"] == shape and r["format"] == fmt]
        cells = [f"{r['idot_ms']:.3f} / {r['float_ms']:.3f} ({r['float_ms'] / r['idot_ms']:.2f})" for r in rs]
        lines.append(f"| {shape} | {fmt} | {rs[0]['float_kernel']} | {rs[0]['idot_bits']:.2f} / "
                     f"{rs[0]['float_bits']:.2f} | " + " | ".join(cells) + " |")
    write(args.out, "idot_kernels", {"command": command("bench.idot_kernels", None), "commit": commit(), "machine": cpu_name(), "rows": rows}, lines)


if __name__ == "__main__":
    main()
