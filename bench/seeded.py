"""Seeded sampling reproduces (issue 51): lp's seeded lookahead against its plain seeded decoding.

Contract: ``python -m bench.seeded [--prompts 8] [--seeds 0 1 2] [--temperatures 0.7 1.0]
[--top-p 0.9] [--max-new 64] [--out bench/results/seeded]`` loads the default model as every entry
point does (``model.quant=auto``), takes the first prompts of MT-Bench and HumanEval (half each),
and decodes every (prompt, seed, temperature) four ways, interleaved: ``ar`` (``decoding.mode=ar``,
one token a step: plain seeded sampling), ``default`` (the decoding defaults: suffix drafts on this
CPU, cold per request), ``warm`` (the same with one ``DraftStore`` shared over the whole run, as a
server's suffix index learns from every answer) and ``window`` (the paper's always-on 2-D window,
W=5 N=4 G=5). Writes ``seeded.json`` and ``seeded.md``: per method, how many outputs equal ``ar``'s
token for token, tokens a step and decode tok/s (min / median / max over the cases), with the
command, commit and CPU. Exits 1 when any output differs from ``ar``'s.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench.envelope import command, commit, cpu_name, write

METHODS = ("ar", "default", "warm", "window")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", default="bench/results/seeded")
    a = ap.parse_args(argv)

    from bench.config import PromptsConfig
    from bench.prompts import select, to_ids
    from lp.config import DecodingConfig
    from lp.drafts.suffix import DraftStore
    from lp.engine.decoder import LookaheadDecoder
    from lp.model.loader import load_model, resolve_model_path
    from lp.model.runner import ModelRunner

    model, tok = load_model(resolve_model_path("smollm2", None), "auto", quant="auto")
    runner = ModelRunner(model)
    half = (a.prompts + 1) // 2
    data = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
    prompts = select(PromptsConfig(sets=["mt_bench"], num_prompts=half), data) + \
        select(PromptsConfig(sets=["humaneval"], num_prompts=a.prompts - half), data)
    store = DraftStore(65536)
    shapes = {"ar": dict(mode="ar"), "default": {}, "warm": {}, "window": dict(W=5, N=4, G=5)}
    cases = []
    for p in prompts:
        ids = to_ids(tok, p)
        for seed in a.seeds:
            for temp in a.temperatures:
                case = {"prompt": f"{p.set}/{p.id}", "seed": seed, "temperature": temp}
                for m in METHODS:
                    cfg = DecodingConfig(do_sample=True, temperature=temp, top_p=a.top_p, seed=seed,
                                         max_new_tokens=a.max_new, **shapes[m])
                    dec = LookaheadDecoder(runner, cfg, draft_store=store if m == "warm" else None)
                    res = dec.generate(ids, eos_token_ids=[tok.eos_token_id])
                    st = res.stats
                    case[m] = {"ids": res.output_ids, "steps": st.steps,
                               "tok_s": st.new_tokens / st.decode_time_s if st.decode_time_s else None}
                for m in METHODS[1:]:
                    case[m]["equal"] = case[m]["ids"] == case["ar"]["ids"]
                cases.append(case)
                print(case["prompt"], seed, temp, {m: case[m].get("equal") for m in METHODS[1:]}, flush=True)

    summary = {}
    for m in METHODS:
        tps = [len(c[m]["ids"]) / c[m]["steps"] for c in cases]
        speed = [c[m]["tok_s"] for c in cases if c[m]["tok_s"]]
        summary[m] = {"equal_to_ar": sum(c[m].get("equal", True) for c in cases), "cases": len(cases),
                      "tokens_per_step": [min(tps), statistics.median(tps), max(tps)],
                      "tok_s": [min(speed), statistics.median(speed), max(speed)]}
    result = {"command": command("bench.seeded", argv), "commit": commit(), "cpu": cpu_name(),
              "model": "smollm2 (quant=auto)", "top_p": a.top_p, "max_new_tokens": a.max_new,
              "summary": summary, "cases": cases}
    md = ["# Seeded sampling: lookahead against plain seeded decoding (mode=ar)", "",
          f"`{result['command']}` at {result['commit']}, {result['cpu']}; "
          f"{len(prompts)} prompts x seeds {a.seeds} x T {a.temperatures}, top_p {a.top_p}, {a.max_new} tokens.", "",
          "| method | outputs equal to ar | tokens/step min / med / max | tok/s min / med / max |", "|---|---|---|---|"]
    for m, s in summary.items():
        md.append(f"| {m} | {s['equal_to_ar']} / {s['cases']} | "
                  + " / ".join(f"{x:.2f}" for x in s["tokens_per_step"]) + " | "
                  + " / ".join(f"{x:.1f}" for x in s["tok_s"]) + " |")
    write(a.out, "seeded", result, md)
    print("\n".join(md))
    return 0 if all(s["equal_to_ar"] == s["cases"] for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
