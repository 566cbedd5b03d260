"""The packed step's cost t(Q) per kernel variant and thread count: ``python -m bench.step_cost``.

Contract: loads the model (default SmolLM2-135M-Instruct, fp32), builds one ``ModelRunner`` per
variant over the same weights, and times one packed forward of Q rows after a 128-token prefix
(``lp.model.calibrate.measure``: the step's device->host read included) for every Q, every
variant and every thread count, in ``--rounds`` rounds that interleave the variants and the
thread counts (this machine's noise moves whole runs by 10-15%). Variants:

    plain      torch's F.linear (MKL), eager: lp before issue 26
    packed     oneDNN-prepacked linears (model.linears=packed), eager
    compiled   packed linears under torch.compile (model.compile=on)

Compile time is paid before the first round and reported, never inside a timed region.
Writes ``step_cost.json`` (every round's curve) and ``step_cost.md`` (per Q the median and
[min-max] over rounds, and the one-row step) into ``--out``.

    python -m bench.step_cost --out bench/results/step_cost
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

QS = (1, 2, 4, 8, 16, 32, 64)
VARIANTS = {"plain": dict(linears="plain"), "packed": dict(linears="packed"),
            "compiled": dict(linears="packed", compile="on")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="a local transformers folder (default: SmolLM2)")
    ap.add_argument("--variants", default="plain,packed,compiled")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/step_cost")
    args = ap.parse_args(argv)

    from lp.lookahead.layout import chain_layout
    from lp.model.calibrate import measure
    from lp.model.loader import load_model, resolve_model_path
    from lp.model.runner import ModelRunner

    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: {unknown} unknown; pick from {', '.join(VARIANTS)}")
    threads = [int(t) for t in args.threads.split(",") if t]
    path = resolve_model_path("smollm2", args.model_path)
    model, _ = load_model(path, dtype="float32", tokenizer=False)
    runners, compile_s = {}, {}
    for v in variants:
        runners[v] = ModelRunner(model, attention="sdpa", small_rows="off", **VARIANTS[v])
        t0 = time.perf_counter()
        if runners[v].compiled:  # compile (and the warm-up recompile) outside every timed region
            cache = runners[v].new_cache(256, max(QS))
            for q in (128, 1, 3, 64):
                runners[v].forward(chain_layout(list(range(5, 5 + q))), cache)
            compile_s[v] = round(time.perf_counter() - t0, 1)
            print(f"[step_cost] {v}: compiled in {compile_s[v]} s", flush=True)
    rounds = []
    for r in range(args.rounds):
        for t in threads:
            torch.set_num_threads(t)
            for v in variants:
                curve, _ = measure(runners[v], QS, repeats=2)
                rounds.append({"round": r, "threads": t, "variant": v, "curve": curve})
                print(f"[step_cost] round {r} t={t} {v}: " + " ".join(f"{q}:{s * 1e3:.1f}" for q, s in curve), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": str(path), "dtype": "float32", "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "compile_s": compile_s,
            "loadavg_end": os.getloadavg()[0]}
    (out / "step_cost.json").write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1))
    (out / "step_cost.md").write_text(report(rounds, variants, threads, meta))
    print((out / "step_cost.md").read_text())


def report(rounds: list[dict], variants: list[str], threads: list[int], meta: dict) -> str:
    lines = ["# t(Q): one packed forward of Q rows after a 128-token prefix, ms", "",
             f"Model {meta['model']} fp32, torch {meta['torch']}, {meta['cpus']} CPUs; compile: {meta['compile_s']} s. "
             "Median [min-max] over rounds; variants and thread counts interleaved in every round.", ""]
    for t in threads:
        lines += [f"## {t} thread{'s' if t > 1 else ''}", "", "| Q | " + " | ".join(variants) + " |",
                  "|---|" + "---|" * len(variants)]
        for i, q in enumerate(QS):
            cells = []
            for v in variants:
                ms = [r["curve"][i][1] * 1e3 for r in rounds if r["threads"] == t and r["variant"] == v]
                cells.append(f"{statistics.median(ms):.1f} [{min(ms):.1f}-{max(ms):.1f}]")
            lines.append(f"| {q} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
