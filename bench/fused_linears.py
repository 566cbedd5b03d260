"""Fused q/k/v and gate/up packed linears against separate ones: ``python -m bench.fused_linears``.

Contract: loads the model twice (default SmolLM2-135M-Instruct, fp32), packs one copy with
lp.kernels.linears' FUSED groups (what lp runs) and one with none (every linear its own packed
weight), and times one eager packed forward of Q rows after a 128-token prefix for both
(``lp.model.calibrate.measure``) in ``--rounds`` rounds that alternate the two; checks that
both copies give the same greedy tokens on the same rows. Writes ``fused_linears.json`` and
``fused_linears.md`` (per Q the median and [min-max] over rounds) into ``--out``.

    python -m bench.fused_linears --out bench/results/step_cost/fused_linears
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

QS = (1, 2, 4, 8, 16, 32, 64, 96)


def _runner(path, fused: bool):
    from lp.kernels import linears
    from lp.model.loader import load_model, resolve_model_path
    from lp.model.runner import ModelRunner

    model, _ = load_model(resolve_model_path("smollm2", path), dtype="float32", tokenizer=False)
    groups, linears.FUSED = linears.FUSED, linears.FUSED if fused else ()
    try:
        return ModelRunner(model, small_rows="off", linears="packed")
    finally:
        linears.FUSED = groups


def _greedy(runner, rows: list[int]) -> list[int]:
    from lp.lookahead.layout import chain_layout

    return runner.forward(chain_layout(rows), runner.new_cache(len(rows), len(rows))).argmax(-1).flatten().tolist()


def main(argv=None) -> None:
    from lp.model.calibrate import measure

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="a local transformers folder (default: SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results/step_cost/fused_linears")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runners = {"fused": _runner(args.model_path, True), "separate": _runner(args.model_path, False)}
    rows = list(range(100, 164))
    same = _greedy(runners["fused"], rows) == _greedy(runners["separate"], rows)
    curves = {name: [] for name in runners}
    for r in range(args.rounds):
        for name, runner in (runners.items() if r % 2 == 0 else reversed(runners.items())):
            curves[name].append({q: s * 1e3 for q, s in measure(runner, QS, repeats=3)[0]})
            print(f"[fused_linears] round {r} {name}: " + ", ".join(f"{q}: {ms:.1f}" for q, ms in curves[name][-1].items()),
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "rounds": args.rounds, "torch": torch.__version__, "machine": platform.processor(),
            "same_greedy_tokens_64_rows": same}
    (out / "fused_linears.json").write_text(json.dumps({"meta": meta, "curves_ms": curves}, indent=1))
    lines = [f"# fused vs separate packed linears, t(Q) ms ({args.threads} threads, {args.rounds} rounds, eager)", "",
             f"same greedy tokens over 64 rows: {same}", "", "| Q | fused | separate | separate / fused |",
             "|---|---|---|---|"]
    for q in QS:
        f, s = ([c[q] for c in curves[n]] for n in ("fused", "separate"))
        lines.append(f"| {q} | {statistics.median(f):.1f} [{min(f):.1f}-{max(f):.1f}] | "
                     f"{statistics.median(s):.1f} [{min(s):.1f}-{max(s):.1f}] | "
                     f"{statistics.median(s) / statistics.median(f):.3f} |")
    (out / "fused_linears.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
