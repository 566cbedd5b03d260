"""The server's batch engine offline: decoding variants A/B on one workload at a concurrency.

Contract: ``python -m bench.engine_ab [--workload chat|code] [--concurrency 1,8] [--requests 16]
[--tokens 64] [--rounds 3] [--variants budget,nocal,ar] [--compile on|off] [--quant none|exact4]
[--threads 2] [--out DIR]`` builds the engine ``lp.serve`` builds (SmolLM2 fp32, ``model.compile``,
``model.quant``, the
t(Q) curve and the batched step's costs from their caches, the prefix cache on), and for each
concurrency C queues ``--requests`` prompts of the workload with at most C decoding at once
(a finished sequence's slot refilled at the next step: what C closed-loop clients get from
``lp.serve``, without HTTP). Variants are decoding settings of every request:

* ``budget``: lp's default (the draft budget with its calibration, lp.drafts.budget);
* ``nocal``: the budget without the calibration (``decoding.draft_calibration=false``);
* ``ar``: lp's own one-token steps (``decoding.mode=ar``), the greedy reference here;
* ``window3`` / ``window5``: the budget's drafts with a Jacobi window of W = 3 / 5 columns,
  N = 4, riding every step (its n-grams drafts too).

One engine serves every variant and round (as one server would; the calibration state carries
over between rounds and variants, as it does across a server's requests); variants run
interleaved, ``--rounds`` times, and every round is reported (tok/s = all new tokens / time
to drain the queue; steps, rows a step, tokens a sequence-step). Every output is checked
against the ``ar`` variant's (or, without it, the first variant's): a mismatch is reported,
not hidden. Chat prompts: bench.prompts' MT-Bench set chat-templated (the server's
system prompt included); code: raw HumanEval prompts. Writes results.json and summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"budget": {}, "nocal": {"draft_calibration": False}, "ar": {"mode": "ar"},
            # the Jacobi window riding every step beside the suffix drafts (its n-grams drafts too)
            "window3": {"W": 3, "N": 4, "G": 4, "window_policy": "always", "drafts": "suffix"},
            "window5": {"W": 5, "N": 4, "G": 4, "window_policy": "always", "drafts": "suffix"}}


def workload_ids(tokenizer, workload: str, k: int) -> list[list[int]]:
    from bench.batch import chat_prompts, code_prompts

    if workload == "code":
        return code_prompts(tokenizer, k)
    out = chat_prompts(tokenizer)
    return [out[i % len(out)] for i in range(k)]


def build(compile_mode: str, threads: int, quant: str = "none"):
    """Runner, tokenizer, eos and batched-step costs as lp.serve builds them."""
    import torch

    from lp.engine.batch import compile_batched_step
    from lp.engine.batch_cost import batch_step_cost
    from lp.generate import eos_ids
    from lp.model.calibrate import row_cost_curve
    from lp.model.loader import load_model, resolve_model_path
    from lp.model.runner import ModelRunner

    torch.set_num_threads(threads)
    model, tok = load_model(resolve_model_path("smollm2", None), "float32", quant=quant)
    runner = ModelRunner(model, compile=compile_mode)
    curve = row_cost_curve(runner)
    if runner.compiled:
        compile_batched_step(runner, 512)
    return runner, tok, eos_ids(model, tok), curve, batch_step_cost(runner)


def run(engine, prompts, cfg, eos) -> dict:
    ids = [engine.add(p, cfg, eos) for p in prompts]
    steps = rows = 0
    t = time.perf_counter()
    while engine.has_work:
        engine.step()
        steps, rows = steps + 1, rows + engine.last_rows
    wall = time.perf_counter() - t
    outs = [engine.result(i).output_ids for i in ids]
    return {"wall_s": wall, "outs": outs, "steps": steps, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="chat", choices=["chat", "code"])
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="budget,nocal,ar")
    ap.add_argument("--compile", default="on", choices=["on", "off"])
    ap.add_argument("--quant", default="none", choices=["none", "exact4"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/engine_ab/run")
    args = ap.parse_args()
    from lp.config import DecodingConfig
    from lp.engine.batch import BatchEngine

    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"--variants: each must be one of {', '.join(VARIANTS)}, got {v!r}")
    runner, tok, eos, curve, cost = build(args.compile, args.threads, args.quant)
    prompts = workload_ids(tok, args.workload, args.requests)
    load0 = os.getloadavg()
    rows, ref = [], {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        engine = BatchEngine(runner, kv_tokens=32768, max_batch=c, max_prefill_tokens=512, tq_curve=curve,
                             prefix_cache=True, batch_cost=cost)
        for r in range(args.rounds):
            for v in variants:
                cfg = DecodingConfig(max_new_tokens=args.tokens, **VARIANTS[v])
                res = run(engine, prompts, cfg, eos)
                key = (c, "ar" if "ar" in variants else variants[0])
                if v == key[1] and key not in ref:
                    ref[key] = res["outs"]
                tokens = sum(len(o) for o in res["outs"])
                row = {"concurrency": c, "variant": v, "round": r, "tokens": tokens,
                       "wall_s": round(res["wall_s"], 3), "tok_s": round(tokens / res["wall_s"], 2),
                       "steps": res["steps"], "rows_per_step": round(res["rows"] / res["steps"], 2),
                       "calibration": round(engine.calibration.factor(), 3),
                       "outs": res["outs"]}
                rows.append(row)
                print(json.dumps({k: x for k, x in row.items() if k != "outs"}), flush=True)
    for row in rows:
        want = ref.get((row["concurrency"], "ar" if "ar" in variants else variants[0]))
        row["equal_reference"] = sum(a == b for a, b in zip(row.pop("outs"), want)) if want else None
    load1 = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python -m bench.engine_ab " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out")
    (out / "results.json").write_text(json.dumps({"command": cmd, "load_start": load0, "load_end": load1,
                                                  "rows": rows}, indent=1))
    lines = [f"# The server's engine offline: {', '.join(variants)} on {args.workload}", "",
             f"Command: `{cmd}`  ",
             f"SmolLM2-135M-Instruct fp32, model.compile={args.compile}, model.quant={args.quant}, {args.threads} threads, {args.requests} "
             f"requests of {args.tokens} new tokens, at most C decoding at once; every round listed "
             f"(median [min-max]); load average {[round(x, 2) for x in load0]} -> {[round(x, 2) for x in load1]}.", "",
             "| C | variant | tok/s median [range] | steps | rows / step | calibration after | outputs == reference |",
             "|---|---|---|---|---|---|---|"]
    for c in sorted({r["concurrency"] for r in rows}):
        for v in variants:
            rs = [r for r in rows if r["concurrency"] == c and r["variant"] == v]
            tps = [r["tok_s"] for r in rs]
            lines.append(f"| {c} | {v} | {statistics.median(tps):.1f} [{min(tps):.1f}-{max(tps):.1f}] | "
                         f"{'/'.join(str(r['steps']) for r in rs)} | "
                         f"{'/'.join(str(r['rows_per_step']) for r in rs)} | {rs[-1]['calibration']} | "
                         f"{min(r['equal_reference'] for r in rs)} of {args.requests} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
