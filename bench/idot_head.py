"""A GGUF LM head's greedy rows: idot's ``IBlockHead`` (the file's codes, ``screeni`` on them) against
the head lp held before for the same blocks (exactq's ``QBlockHead`` with its int8 screen for Q6_K,
exact4's ``BlockHead`` with its int8 screen for Q8_0): ``python -m bench.idot_head
[--shapes 128256x2048:Q6_K,262144x640:Q8_0] [--rows 1,4,16]``.

Contract: per shape N x K and format, random blocks as a file holds them (tests/gguf_tiny.random_blocks,
read as lp.model.gguf reads them), both heads built in this process; per row count M, rounds of
``argmax_logits`` on rows near a token's weight (30 w_v + noise: a hidden state that picks a token),
the two heads interleaved, min and median ms; the bytes each head holds (its tensors: packed codes,
screen, norms). Rows from a model's own decode keep fewer tokens than these. Writes
``<out>/idot_head.md`` and ``.json`` with the command, the machine and the commit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from bench.envelope import command, commit, cpu_name, write


def heads(fmt: str, n: int, k: int):
    """(the head before, idot's head) over one random tensor of ``fmt`` (Q8_0 or Q6_K)."""
    from lp.kernels.exact4 import BlockHead, eight_bit
    from lp.kernels.exactq import QBlockHead
    from lp.kernels.idot import IBlockHead
    from lp.model.gguf import KINDS, QParts, _read_blocks, blocksq_of
    from tests.gguf_tiny import random_blocks

    raw = random_blocks(fmt, n, k, 0.02, np.random.default_rng(0))
    if fmt == "Q6_K":
        parts = QParts(KINDS[fmt], blocksq_of(raw, fmt, n, k))
        return QBlockHead(parts, True), IBlockHead.of(parts)
    parts = _read_blocks(raw, fmt, n, k, 8)
    return BlockHead(eight_bit(parts), True), IBlockHead.of(parts)


def held_bytes(head) -> int:
    """Bytes of the tensors a head holds: its buffers and its screen's (codes, scales, norms)."""
    seen, total = set(), 0
    tensors = list(head.buffers())
    h8 = getattr(head, "h8", None)
    if h8 is not None:
        tensors += [v for v in vars(h8).values() if isinstance(v, torch.Tensor)]
        for v in vars(h8).values():
            if isinstance(v, (tuple, list)):
                tensors += [t for t in v if isinstance(t, torch.Tensor)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="128256x2048:Q6_K,262144x640:Q8_0")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/gguf_formats")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for spec in a.shapes.split(","):
        shape, fmt = spec.split(":")
        n, k = (int(v) for v in shape.split("x"))
        before, idot = heads(fmt, n, k)
        if idot is None:
            raise ValueError(f"--shapes: idot does not run here or does not take {fmt}")
        g = torch.Generator().manual_seed(1)
        w = idot.rows(torch.arange(0, n, 997))
        for m in (int(v) for v in a.rows.split(",")):
            times = {"before": [], "idot": []}
            for _ in range(a.rounds):
                x = (w[torch.randint(0, w.shape[0], (m,), generator=g)] * 30
                     + torch.randn(m, k, generator=g) * 0.5).contiguous()
                for name, head in (("before", before), ("idot", idot)):
                    t = time.perf_counter()
                    head.h8.argmax_logits(x)
                    times[name].append(time.perf_counter() - t)
            row = {"shape": shape, "format": fmt, "rows": m, "before": type(before).__name__,
                   "before_mib": held_bytes(before) / 2**20, "idot_mib": held_bytes(idot) / 2**20,
                   **{f"{k2}_min_ms": 1e3 * min(v) for k2, v in times.items()},
                   **{f"{k2}_median_ms": 1e3 * statistics.median(v) for k2, v in times.items()}}
            print(row, flush=True)
            rows.append(row)
        del before, idot
    result = {"command": command("bench.idot_head", argv), "commit": commit(), "cpu": cpu_name(),
              "threads": a.threads, "rows": rows}
    md = ["# A GGUF head's greedy rows: idot's screen on the file's codes against the head before", "",
          f"`{result['command']}` at {result['commit']}, {result['cpu']}, {a.threads} threads; random blocks, rows "
          "near a token's weight, the two heads interleaved (module doc)", "",
          "| shape | format | head before | MiB before / idot | M | before min / median ms | idot min / median ms |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['shape']} | {r['format']} | {r['before']} | {r['before_mib']:.0f} / {r['idot_mib']:.0f} | "
                  f"{r['rows']} | {r['before_min_ms']:.2f} / {r['before_median_ms']:.2f} | "
                  f"{r['idot_min_ms']:.2f} / {r['idot_median_ms']:.2f} |")
    write(a.out, "idot_head", result, md)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
