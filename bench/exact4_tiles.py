"""How many outputs each row tile of lp's exact4 / exact8 kernels should form at once, measured.

Contract: ``python -m bench.exact4_tiles [--rows 1 2 3 4 5 6 7 8] [--reps 7] [--threads 2]
[--out bench/results/step_cost/exact4_tiles]`` loads the default model (SmolLM2-135M's GGUF),
converts it as ``model.quant=exact4`` does (its decoder linears as 120 kernel calls on exact
4-bit blocks) and packs its head's exact 8-bit blocks, then for each row count M (one tile of
M rows) times one pass of M rows through every exact4 linear (``exact4``) and through the head
(``exact8``) with each tile width the kernels can run (1, 2, 4 or 8 outputs formed at once,
``lp_exact4.set_tile``), interleaved in every round, minimum over the rounds. Every width must
give the same bits (each output's sum runs in the same order whatever the tile): checked first,
an AssertionError otherwise. Writes ``tiles.json`` / ``tiles.md``: ms per width, the fastest,
and the kernel's built-in choice (``lp_exact4.tiles()``) with how far it is from the fastest.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.envelope import command, commit, cpu_name, write

WIDTHS = (1, 2, 4, 8)
KINDS = ("exact4", "exact8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/step_cost/exact4_tiles")
    a = ap.parse_args(argv)
    if any(not 1 <= m <= 8 for m in a.rows):
        raise ValueError(f"--rows: each row count must be in 1..8 (one tile), got {a.rows}")
    from bench.exact4_bandwidth import default_model_kernels
    from lp.kernels import exact4

    torch.set_num_threads(a.threads)
    name, linears, head_p, vocab = default_model_kernels()
    ext = exact4.extension()
    builtin = ext.tiles()
    load = os.getloadavg()[0]
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for m in a.rows:
            xs = [torch.randn(m, lin.in_features, generator=gen) for lin in linears]
            xh = torch.randn(m, head_p.shape[1] * 32, generator=gen) * 3
            fns = {"exact4": lambda: [exact4.mm(x, lin.p, lin.out_features) for lin, x in zip(linears, xs)],
                   "exact8": lambda: [exact4.mm8(xh, head_p, vocab)]}
            for k, fn in fns.items():  # the same bits at every width
                outs = []
                for w in WIDTHS:
                    ext.set_tile(KINDS.index(k), m, w)
                    outs.append(fn())
                assert all(torch.equal(o, r) for other in outs[1:] for o, r in zip(other, outs[0])), (k, m)
            best = {(k, w): float("inf") for k in fns for w in WIDTHS}
            for rep in range(a.reps + 1):
                for k, fn in fns.items():
                    for w in WIDTHS:
                        ext.set_tile(KINDS.index(k), m, w)
                        t = time.perf_counter()
                        fn()
                        if rep:  # the first round warms up
                            best[(k, w)] = min(best[(k, w)], time.perf_counter() - t)
            for k in fns:
                ext.set_tile(KINDS.index(k), m, builtin[KINDS.index(k)][m - 1])
            row = {"rows": m}
            for k in fns:
                ms = {w: 1e3 * best[(k, w)] for w in WIDTHS}
                fastest = min(ms, key=ms.get)
                chosen = builtin[KINDS.index(k)][m - 1]
                row[k] = {"ms": ms, "fastest": fastest, "builtin": chosen,
                          "builtin_over_fastest": ms[chosen] / ms[fastest] - 1}
            rows.append(row)
            print(row, flush=True)
    finally:
        for i, kind_tiles in enumerate(builtin):
            for m, w in enumerate(kind_tiles, start=1):
                ext.set_tile(i, m, w)
    result = {"command": command("bench.exact4_tiles", argv), "commit": commit(), "cpu": cpu_name(),
              "threads": a.threads, "load_average_at_start": load, "kernel_calls": len(linears),
              "builtin": {k: builtin[i] for i, k in enumerate(KINDS)}, "results": rows}
    md = [f"# exact4 / exact8 kernel tiles: outputs formed at once per row count, {name}", "",
          f"`{result['command']}` at {result['commit']}, {result['cpu']}, {a.threads} threads, load average "
          f"{load:.1f} at the start; min of {a.reps} interleaved rounds, ms for one pass of M rows through the "
          f"{len(linears)} exact4 calls (`exact4`) and through the 8-bit head (`exact8`) at each tile width. "
          "Every width gives the same bits (checked). **bold**: the kernel's built-in width.", ""]
    for k in KINDS:
        md += [f"## {k}", "", "| rows | " + " | ".join(f"{w} outputs" for w in WIDTHS)
               + " | fastest | built-in vs fastest |", "|---|" + "---|" * (len(WIDTHS) + 2)]
        for r in rows:
            e = r[k]
            cells = [(f"**{e['ms'][w]:.2f}**" if w == e["builtin"] else f"{e['ms'][w]:.2f}") for w in WIDTHS]
            md.append(f"| {r['rows']} | " + " | ".join(cells) + f" | {e['fastest']} | "
                      f"{100 * e['builtin_over_fastest']:+.0f}% |")
        md.append("")
    write(a.out, "tiles", result, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
