"""lp.kernels.exactq's ``mmq`` against the 8-bit kernels it replaces (and exact4 for Q4_K), per row
count, on one [4864, 2048] matrix of random blocks per format: ``python -m bench.exactq_kernels``.

Contract: the same file blocks are packed both ways; each call streams from memory (24 copies of
the packed matrix, more than the last-level cache, cycled per timing), the two kernels interleaved
over ``--rounds`` rounds, the fastest round kept (noise only adds time). Asserts both give the same
bits. Writes ``exactq_kernels.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="Q4_K,Q5_0,Q5_1,Q5_K,Q6_K")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results/gguf_formats")
    args = ap.parse_args()
    from lp.kernels import exact4 as e
    from lp.kernels.exactq import KINDS, mmq, packq
    from lp.model.gguf import KEPT, _read_blocks, blocksq_of
    from tests.gguf_tiny import random_blocks

    rng = np.random.default_rng(0)
    n, k, copies = 4864, 2048, 24
    lines = ["| format | rows | 8-bit / exact4 ms (MiB) | mmq ms (MiB) | mmq / old |", "|---|---|---|---|---|"]
    for kind in args.kinds.split(","):
        raw = random_blocks(kind, n, k, 0.05, rng)
        pq = packq(KINDS[kind], blocksq_of(raw, kind, n, k))
        old = _read_blocks(raw, kind, n, k, KEPT[kind][2])
        if KEPT[kind][2] == 4:
            po, fo = e.pack(*old), (lambda x, p: e.mm(x, p, n))
        elif len(old) == 2:
            po, fo = e.pack8(*old), (lambda x, p: e.mm8(x, p, n))
        else:
            po, fo = e.pack8x(*old), (lambda x, p: e.mm8x(x, p, n))
        fq = (lambda x, p, kid=KINDS[kind]: mmq(x, p, n, kid))
        sets = {"old": (fo, [po.clone() for _ in range(copies)]), "new": (fq, [pq.clone() for _ in range(copies)])}
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            assert torch.equal(fo(x, po), fq(x, pq)), (kind, m)
            best = {"old": float("inf"), "new": float("inf")}
            for _ in range(args.rounds):
                for name, (f, ps) in sets.items():
                    t = time.perf_counter()
                    for p in ps:
                        f(x, p)
                    best[name] = min(best[name], (time.perf_counter() - t) / copies)
            lines.append(f"| {kind} | {m} | {best['old'] * 1e3:.3f} ({po.numel() / 2**20:.1f}) | "
                         f"{best['new'] * 1e3:.3f} ({pq.numel() / 2**20:.1f}) | {best['new'] / best['old']:.2f} |")
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = (f"# mmq against the kernels it replaces\n\n`python -m bench.exactq_kernels` on {platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads, [{n}, {k}] random blocks, fastest of {args.rounds} rounds, each call streaming "
            f"from memory.\n\n")
    (out / "exactq_kernels.md").write_text(head + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
