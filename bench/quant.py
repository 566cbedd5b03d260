"""Quantized weights on this machine: t(Q), quality and decoding speed per quant, one run.

Contract: ``python -m bench.quant [--sets humaneval] [--prompts 10] [--max-new 128]
[--threads 2] [--quants fp32,bf16,int8,int4] [--methods ar,prompt_lookup,lp] [--out DIR]``
loads SmolLM2-135M-Instruct once per variant (fp32 and bf16 weights, ``model.quant=int8``,
``model.quant=int4``; all held in memory at once) and writes to ``--out``
(default bench/results/quant):

* ``tq.json``: t(Q) for Q = 1..16 per variant (lp.model.calibrate.measure, rounds interleaved
  over the variants, the minimum kept);
* ``quality.json``: against fp32, the mean per-token KL(fp32 || variant) over a fixed
  text (the prompts' text joined, teacher-forced) and greedy agreement on the prompts
  (identical outputs, and tokens up to the first difference);
* ``results.jsonl``: one row per (prompt, variant, method): tokens/s, S, whether the
  output equals ``generate`` on the same variant. Every method and variant runs on a prompt
  before the next prompt (a loaded, shared machine slows all alike);
* ``summary.md``: the tables, the command, the load average at start and end.

Methods: ``ar`` transformers generate, ``prompt_lookup`` generate(prompt_lookup_num_tokens=10),
``lp`` lp's defaults (bench.methods.run_lookahead with the hardware defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "int8": ("float32", "int8"),
            "int4": ("float32", "int4")}


def load_variants(names: list[str]):
    from lp.model.loader import load_model, resolve_model_path

    path = resolve_model_path("smollm2", None)
    models, tok = {}, None
    for name in names:
        dtype, quant = VARIANTS[name]
        models[name], tok = load_model(path, dtype, "cpu", quant)
    return models, tok


def measure_tq(models: dict, qs: list[int], rounds: int) -> dict:
    from lp.model.calibrate import measure
    from lp.model.runner import ModelRunner

    runners = {n: ModelRunner(m) for n, m in models.items()}
    best: dict[str, dict[int, float]] = {n: {} for n in runners}
    for _ in range(rounds):
        for n, r in runners.items():
            curve, _ = measure(r, qs, repeats=2)
            for q, t in curve:
                best[n][q] = min(best[n].get(q, float("inf")), t)
    return {n: [[q, round(t, 6)] for q, t in sorted(c.items())] for n, c in best.items()}


@torch.inference_mode()
def kl_per_token(ref_model, model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    lp_ref = torch.log_softmax(ref_model(input_ids=x).logits[0].float(), -1)
    lp_q = torch.log_softmax(model(input_ids=x).logits[0].float(), -1)
    return float((lp_ref.exp() * (lp_ref - lp_q)).sum(-1).mean())


def agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> None:
    from bench.config import PromptsConfig
    from bench.prompts import select, to_ids
    from lp.generate import eos_ids

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", default="humaneval")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quants", default="fp32,bf16,int8,int4")
    ap.add_argument("--methods", default="ar,prompt_lookup,lp")
    ap.add_argument("--tq-rounds", type=int, default=2)
    ap.add_argument("--kl-tokens", type=int, default=1024)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant"))
    ap.add_argument("--summarize", action="store_true",
                    help="no new timings: read tq.json and results.jsonl (of a run cut short), add quality, summarize")
    args = ap.parse_args(argv)
    names = args.quants.split(",")
    for n in names:
        if n not in VARIANTS:
            raise ValueError(f"--quants must list names from {sorted(VARIANTS)}, got {n!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    t_start = time.time()
    models, tok = load_variants(names)
    prompts = select(PromptsConfig(sets=args.sets.split(","), num_prompts=args.prompts),
                     ROOT.parent / "shared" / "data")
    ids = [to_ids(tok, p) for p in prompts]
    eos = eos_ids(models[names[0]], tok)

    if args.summarize:
        tq = json.loads((out / "tq.json").read_text())
        rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
        done = {(r["set"], r["prompt_index"]) for r in rows if r["variant"] == names[-1]}
        prompts = [p for p in prompts if (p.set, p.index) in done]  # prompts every variant finished
        rows = [r for r in rows if (r["set"], r["prompt_index"]) in done]
    else:
        print("[quant] t(Q)", file=sys.stderr, flush=True)
        tq = measure_tq(models, list(range(1, 17)), args.tq_rounds)
        (out / "tq.json").write_text(json.dumps(tq, indent=1))
        rows = run_methods(models, names, prompts, ids, eos, args, out)
    # the KL text: every selected prompt's tokens (also those a cut-short run did not decode)
    text_ids = [t for pid in ids for t in pid][: args.kl_tokens]
    quality = measure_quality(models, names, prompts, rows, text_ids)
    if quality:
        (out / "quality.json").write_text(json.dumps(quality, indent=1))
    write_summary(out, args, argv, rows, tq, quality, names, load_start, time.time() - t_start)


def run_methods(models, names, prompts, ids, eos, args, out) -> list[dict]:
    """Every variant and method on a prompt before the next prompt; rows appended to results.jsonl."""
    from bench import methods

    rows = []
    with open(out / "results.jsonl", "w") as f:
        for p, pid in zip(prompts, ids):
            for n in names:
                ref = None
                for meth in args.methods.split(","):
                    m = models[n]
                    if meth == "ar":
                        run = methods.run_ar(m, pid, args.max_new, eos)
                    elif meth == "prompt_lookup":
                        run = methods.run_prompt_lookup(m, pid, args.max_new, eos, 10)
                    else:
                        run = methods.run_lookahead(m, pid, args.max_new, eos, 0, 0, 0, True, decoding={})
                    if meth == "ar":
                        ref = run.output_ids
                    k = len(run.output_ids)
                    row = {"set": p.set, "prompt_index": p.index, "variant": n, "method": meth, "new_tokens": k,
                           "steps": run.steps, "S": round(k / run.steps, 3),
                           "tokens_per_second": round(k / run.decode_time_s, 3),
                           "decode_time_s": round(run.decode_time_s, 4),
                           "matches_generate": None if ref is None else run.output_ids == ref,
                           "output_ids": run.output_ids}
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(f"[quant] {p.set}/{p.index} {n:5s} {meth:14s} {row['tokens_per_second']:6.1f} tok/s "
                          f"S {row['S']:.2f} eq_gen {row['matches_generate']}", file=sys.stderr, flush=True)
    return rows


def measure_quality(models, names, prompts, rows, text_ids) -> dict:
    """Against fp32: KL per token on ``text_ids`` (teacher-forced) and greedy agreement (ar rows)."""
    if "fp32" not in models:
        return {}
    ar = {(r["variant"], r["set"], r["prompt_index"]): r["output_ids"] for r in rows if r["method"] == "ar"}
    quality = {}
    for n in names:
        pairs = [(ar[(n, p.set, p.index)], ar[("fp32", p.set, p.index)]) for p in prompts
                 if (n, p.set, p.index) in ar and ("fp32", p.set, p.index) in ar]
        quality[n] = {"kl_per_token": kl_per_token(models["fp32"], models[n], text_ids), "kl_tokens": len(text_ids),
                      "identical_outputs": f"{sum(a == b for a, b in pairs)}/{len(pairs)}",
                      "mean_tokens_before_first_difference":
                          round(sum(agreement(a, b) for a, b in pairs) / max(1, len(pairs)), 1)}
    return quality


def write_summary(out: Path, args, argv, rows, tq, quality, names, load_start, wall_s) -> None:
    import platform

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    cmd = "python -m bench.quant " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Quantized weights: SmolLM2-135M-Instruct, {args.threads} threads, {platform.processor() or 'cpu'}",
             "", f"Command: `{cmd}` ({wall_s / 60:.1f} min). Load average (1, 5, 15 min) at start "
             f"{tuple(round(x, 2) for x in load_start)}, at end {tuple(round(x, 2) for x in os.getloadavg())} "
             f"on {os.cpu_count()} cores: a shared machine, timings are noisy; methods and variants ran "
             "interleaved per prompt, so ratios within this run are fairer than absolute numbers.", "",
             "## t(Q), ms per packed forward (128-token prefix, min of rounds)", "",
             "| variant | " + " | ".join(f"Q={q}" for q, _ in next(iter(tq.values()))) + " |",
             "|---|" + "---|" * len(next(iter(tq.values())))]
    for n, c in tq.items():
        lines.append(f"| {n} | " + " | ".join(f"{t * 1e3:.1f}" for _, t in c) + " |")
    base = [r["tokens_per_second"] for r in rows if r["variant"] == "fp32" and r["method"] == "ar"]
    lines += ["", "## Decoding (mean tok/s over prompts; x = vs fp32 generate; eq = outputs equal to generate "
              "on the same variant)", "", "| variant | method | tok/s | x fp32 generate | x generate same variant | S | eq |",
              "|---|---|---|---|---|---|---|"]
    for n in names:
        same = [r["tokens_per_second"] for r in rows if r["variant"] == n and r["method"] == "ar"]
        for meth in args.methods.split(","):
            rs = [r for r in rows if r["variant"] == n and r["method"] == meth]
            if not rs:
                continue
            tps = mean([r["tokens_per_second"] for r in rs])
            eq = [r["matches_generate"] for r in rs if r["matches_generate"] is not None]
            lines.append(f"| {n} | {meth} | {tps:.1f} | {tps / mean(base):.2f}x | {tps / mean(same):.2f}x | "
                         f"{mean([r['S'] for r in rs]):.2f} | {sum(eq)}/{len(eq)} |")
    if quality:
        lines += ["", "## Quality vs fp32", "", "| variant | mean KL(fp32 || variant) per token | identical greedy "
                  "outputs | mean tokens before the first difference |", "|---|---|---|---|"]
        for n, q in quality.items():
            lines.append(f"| {n} | {q['kl_per_token']:.4f} ({q['kl_tokens']} tokens) | {q['identical_outputs']} | "
                         f"{q['mean_tokens_before_first_difference']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(out, rows, tq, names, args.methods.split(","))


def plot(out: Path, rows, tq, names, methods) -> None:
    """quant.png: t(Q) per variant (left), mean tok/s per variant and method (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n, c in tq.items():
        a.plot([q for q, _ in c], [t * 1e3 for _, t in c], marker="o", label=n)
    a.set(xlabel="rows in the packed forward (Q)", ylabel="ms per forward", title="t(Q), SmolLM2, 128-token prefix")
    a.set_ylim(bottom=0)
    a.legend()
    width = 0.8 / max(len(methods), 1)
    for i, meth in enumerate(methods):
        vals = []
        for n in names:
            rs = [r["tokens_per_second"] for r in rows if r["variant"] == n and r["method"] == meth]
            vals.append(sum(rs) / len(rs) if rs else 0.0)
        b.bar([k + i * width for k in range(len(names))], vals, width, label=meth)
    b.set_xticks([k + width * (len(methods) - 1) / 2 for k in range(len(names))], names)
    b.set(ylabel="tokens/s (mean over prompts)", title="decoding speed per weight format")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "quant.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
