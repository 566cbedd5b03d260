"""exact4's kernels against the memory's bandwidth: the bytes a one-sequence step streams and the
rate they stream at, beside what a plain read of memory reaches on the same machine.

Contract: ``python -m bench.exact4_bandwidth [--rows 1 2 4 8 16] [--reps 9] [--threads 2]
[--out bench/results/step_cost/exact4_bandwidth]`` loads the default model (SmolLM2-135M's
GGUF), converts it as ``model.quant=exact4`` does (its 210 decoder linears as 120 kernel calls
on exact 4-bit blocks) and packs its head's exact 8-bit blocks, then times, interleaved in every
round: ``read`` (``x.sum()`` over a 400 MB float32 tensor: the bandwidth a plain read gets),
``linears`` (one pass of M rows through every exact4 linear, the step's order), the same with the
kernels' software prefetch off (``linears_nopf``: what the packed layout's prefetch buys),
``head8`` and ``head8_nopf`` (the head's one forward). Writes ``bandwidth.json`` / ``bandwidth.md``
with ms and GB/s (min / median), the command, commit, CPU and the load average at the start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.envelope import command, commit, cpu_name, write


def default_model_kernels():
    """The default model (SmolLM2-135M's GGUF) as exact4's kernels see it: (its name, its
    ``Exact4Linear`` modules after ``model.quant=exact4``'s conversion, its head's packed exact
    8-bit blocks, the vocabulary size); a ValueError if the head is not 8-bit blocks."""
    from lp.config import ModelConfig
    from lp.kernels import exact4
    from lp.model.loader import load_model, resolve_model_path
    from lp.model.quant import quantize

    mc = ModelConfig()
    model, _ = load_model(resolve_model_path(mc.name, mc.path, mc.cache_dir), "float32", "cpu", "none", tokenizer=False)
    code8 = exact4.encode8(model.get_output_embeddings().weight.detach().contiguous())
    if code8 is None:
        raise ValueError(f"{mc.name}: its head is not exact 8-bit blocks")
    quantize(model, "exact4")
    linears = [m for m in model.modules() if isinstance(m, exact4.Exact4Linear)]
    return mc.name, linears, exact4.pack8(*code8), code8[0].shape[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/step_cost/exact4_bandwidth")
    a = ap.parse_args(argv)
    from lp.kernels import exact4

    torch.set_num_threads(a.threads)
    name, linears, head_p, vocab = default_model_kernels()
    ext = exact4.extension()
    nbytes = {"linears": sum(m.p.numel() for m in linears), "head8": head_p.numel()}
    big = torch.ones(100_000_000)
    load = os.getloadavg()[0]
    gen = torch.Generator().manual_seed(0)

    def run_linears(xs):
        for m, x in zip(linears, xs):
            exact4.mm(x, m.p, m.out_features)

    rows = []
    for rows_m in a.rows:
        xs = [torch.randn(rows_m, m.in_features, generator=gen) for m in linears]
        xh = torch.randn(rows_m, head_p.shape[1] * 32, generator=gen) * 3
        fns = {"read": lambda: big.sum(), "linears": lambda: run_linears(xs),
               "linears_nopf": lambda: run_linears(xs), "head8": lambda: exact4.mm8(xh, head_p, vocab),
               "head8_nopf": lambda: exact4.mm8(xh, head_p, vocab)}
        size = {"read": big.numel() * 4, "linears": nbytes["linears"], "linears_nopf": nbytes["linears"],
                "head8": nbytes["head8"], "head8_nopf": nbytes["head8"]}
        times = {k: [] for k in fns}
        for rep in range(a.reps + 1):
            for k, fn in fns.items():
                ext.set_prefetch(not k.endswith("_nopf"))
                t = time.perf_counter()
                fn()
                if rep:  # the first round warms up
                    times[k].append(time.perf_counter() - t)
        ext.set_prefetch(True)
        rows.append({"rows": rows_m, **{k: {"min_ms": 1e3 * min(v), "median_ms": 1e3 * statistics.median(v),
                                            "max_gbps": size[k] / min(v) / 1e9,
                                            "median_gbps": size[k] / statistics.median(v) / 1e9}
                                        for k, v in times.items()}})
        print(rows[-1], flush=True)
    result = {"command": command("bench.exact4_bandwidth", argv),
              "commit": commit(), "cpu": cpu_name(), "threads": a.threads, "load_average_at_start": load,
              "bytes": nbytes, "kernel_calls": len(linears), "results": rows}
    md = [f"# exact4's kernels against the memory's bandwidth, {name}", "",
          f"`{result['command']}` at {result['commit']}, {result['cpu']}, {a.threads} threads, load average "
          f"{load:.1f} at the start; min / median of {a.reps} interleaved rounds. Bytes a step streams: the "
          f"{len(linears)} exact4 kernel calls {nbytes['linears'] / 1e6:.1f} MB, the head's 8-bit blocks "
          f"{nbytes['head8'] / 1e6:.1f} MB; `read` is `x.sum()` over 400 MB (a plain read's bandwidth). "
          "`_nopf`: the same kernels with their software prefetch off.", "",
          "| rows | " + " | ".join(f"{k} ms" for k in fns) + " | " + " | ".join(f"{k} GB/s" for k in fns) + " |",
          "|---|" + "---|" * (2 * len(fns))]
    for r in rows:
        md.append(f"| {r['rows']} | " + " | ".join(f"{r[k]['min_ms']:.2f} / {r[k]['median_ms']:.2f}" for k in fns)
                  + " | " + " | ".join(f"{r[k]['max_gbps']:.1f} / {r[k]['median_gbps']:.1f}" for k in fns) + " |")
    write(a.out, "bandwidth", result, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
