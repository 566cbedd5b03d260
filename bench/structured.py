"""Schema-constrained requests: lp's drafts (suffix + grammar-forced) vs lp without drafts vs
transformers ``generate`` with llguidance's mask.

Contract: ``python -m bench.structured [--tokens 128] [--rounds 2] [--threads 2] [--batch 8]
[--per-schema 2] [--out bench/results/structured]`` loads SmolLM2-135M-Instruct (fp32, this CPU) once and
decodes chat prompts under several JSON schema shapes (lp.grammar.matcher.compile_grammar,
what ``response_format: json_schema`` compiles to in lp.serve), greedily, three ways:

* ``drafts``: lp's default decoding (suffix drafts, the window's n-grams and the grammar's
  forced continuation as a draft with acceptance 1, one draft budget on the measured t(Q));
* ``G=0``: the same grammar mask, every draft source off (what ``lookahead: {"G": 0}`` asks);
* ``generate``: transformers ``generate`` with llguidance's mask as a LogitsProcessor
  (lp.grammar.matcher.GenerateGrammarProcessor).

Per request: tokens/s (new tokens / decode time), S (tokens per step), rows per step, the share
of tokens that came from grammar-forced drafts, and whether the three outputs are equal token
for token (they must be). Modes run interleaved per request, ``--rounds`` times, best time
kept. Then ``--batch`` requests at once (lp.engine.batch, continuous batching as lp.serve runs
under that many concurrent clients), drafts vs G=0: aggregate tokens/s. Writes results.json and
summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "maxLength": 60}, "city": {"type": "string", "maxLength": 40},
        "is_member": {"type": "boolean"}}, "required": ["name", "age", "email", "city", "is_member"],
        "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "order_id": {"type": "string", "maxLength": 20},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "product": {"type": "string", "maxLength": 30}, "quantity": {"type": "integer", "minimum": 1,
                                                                          "maximum": 99},
            "unit_price": {"type": "number"}}, "required": ["product", "quantity", "unit_price"],
            "additionalProperties": False}, "minItems": 1, "maxItems": 4},
        "priority": {"enum": ["low", "normal", "high"]}, "gift_wrap": {"type": "boolean"}},
        "required": ["order_id", "items", "priority", "gift_wrap"], "additionalProperties": False},
    "tool_call": {"type": "object", "properties": {
        "name": {"enum": ["get_weather", "search_flights"]},
        "arguments": {"type": "object", "properties": {
            "location": {"type": "string", "maxLength": 40}, "date": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["location", "date", "unit"],
            "additionalProperties": False}}, "required": ["name", "arguments"], "additionalProperties": False},
    "review": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60}, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "pros": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "cons": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "would_recommend": {"type": "boolean"}}, "required": ["title", "rating", "pros", "cons",
                                                              "would_recommend"], "additionalProperties": False},
}
PROMPTS = {
    "person": ["Invent a customer profile for a bookshop. Answer in JSON.",
               "Give the profile of a retired teacher living in Lyon, as JSON."],
    "order": ["A customer orders three notebooks and two pens, urgently, as a gift. Answer in JSON.",
              "Record an order of one laptop and a mouse, normal priority. Answer in JSON."],
    "tool_call": ["What will the weather be in Paris tomorrow? Call the right tool, answer in JSON.",
                  "Find me flights to Tokyo on 2025-03-14. Call the right tool, answer in JSON."],
    "review": ["Write a short review of a pair of running shoes as JSON.",
               "Review a cheap coffee machine that broke after a month, as JSON."],
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--per-schema", type=int, default=2, help="prompts per schema (of 2)")
    ap.add_argument("--out", default="bench/results/structured")
    a = ap.parse_args(argv)

    import torch
    from transformers import LogitsProcessorList

    from lp.config import DecodingConfig
    from lp.engine.batch import generate_batch
    from lp.engine.decoder import LookaheadDecoder
    from lp.grammar.matcher import GenerateGrammarProcessor, compile_grammar
    from lp.model.loader import load_model, resolve_model_path
    from lp.model.runner import ModelRunner

    torch.set_num_threads(a.threads)
    model, tok = load_model(resolve_model_path("smollm2", None), "float32")
    runner = ModelRunner(model)
    V = model.config.vocab_size
    eos = [tok.eos_token_id]
    load0 = os.getloadavg()

    def chat(text):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def run_lp(prompt, grammar, **kw):
        cfg = DecodingConfig(max_new_tokens=a.tokens, grammar=grammar, **kw)
        return LookaheadDecoder(runner, cfg).generate(prompt, eos, tokenizer=tok)

    def run_hf(prompt, grammar):
        proc = GenerateGrammarProcessor(grammar, tok, V, len(prompt), eos)
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=a.tokens,
                                 logits_processor=LogitsProcessorList([proc]), eos_token_id=eos, pad_token_id=eos[0])
        return out[0, len(prompt):].tolist(), time.perf_counter() - t0

    run_lp(chat("warm up"), compile_grammar("json_schema", SCHEMAS["person"]))  # t(Q) curve, kernels
    rows = []
    jobs = [(name, text) for name in SCHEMAS for text in PROMPTS[name][: a.per_schema]]
    for name, text in jobs:
        grammar = compile_grammar("json_schema", SCHEMAS[name])
        prompt = chat(text)
        best: dict = {}
        for _ in range(a.rounds):
            r_on = run_lp(prompt, grammar)
            r_off = run_lp(prompt, grammar, G=0)
            hf_out, hf_s = run_hf(prompt, grammar)
            for key, val in (("drafts", r_on), ("G=0", r_off)):
                if key not in best or val.stats.decode_time_s < best[key].stats.decode_time_s:
                    best[key] = val
            if "hf" not in best or hf_s < best["hf"][1]:
                best["hf"] = (hf_out, hf_s)
        on, off, (hf_out, hf_s) = best["drafts"], best["G=0"], best["hf"]
        text_out = tok.decode(on.output_ids, skip_special_tokens=True)
        try:
            import jsonschema

            jsonschema.validate(json.loads(text_out), SCHEMAS[name])
            valid = True
        except Exception:  # noqa: BLE001
            valid = False
        n = len(on.output_ids)
        rows.append({
            "schema": name, "prompt": text, "tokens": n, "valid": valid, "finish": on.finish_reason,
            "equal_drafts_off": on.output_ids == off.output_ids, "equal_generate": on.output_ids == hf_out,
            "drafts_tok_s": round(on.stats.tokens_per_second, 2), "off_tok_s": round(off.stats.tokens_per_second, 2),
            "generate_tok_s": round(len(hf_out) / hf_s, 2),
            "speedup_vs_off": round(on.stats.tokens_per_second / off.stats.tokens_per_second, 3),
            "S": round(on.stats.compression_ratio, 3), "rows_per_step": round(on.stats.mean_rows, 2),
            "off_rows_per_step": round(off.stats.mean_rows, 2),
            "forced_share": round(on.stats.forced_tokens / max(n, 1), 3), "output": text_out,
        })
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "output"}), flush=True)

    # concurrent requests in batched steps (continuous batching, as lp.serve runs them)
    batch_rows = []
    prompts = [chat(text) for _, text in jobs][: a.batch]
    grammars = [compile_grammar("json_schema", SCHEMAS[name]) for name, _ in jobs][: a.batch]
    best_b: dict = {}
    for _ in range(a.rounds):
        for key, kw in (("drafts", {}), ("G=0", {"G": 0})):
            cfgs = [DecodingConfig(max_new_tokens=a.tokens, grammar=g, **kw) for g in grammars]
            t0 = time.perf_counter()
            outs = generate_batch(LookaheadDecoder(runner, cfgs[0]), prompts, eos, tokenizer=tok, configs=cfgs,
                                  max_batch=a.batch)
            dt = time.perf_counter() - t0
            if key not in best_b or dt < best_b[key][1]:
                best_b[key] = (outs, dt)
    on_b, off_b = best_b["drafts"], best_b["G=0"]
    tokens = sum(len(o.output_ids) for o in on_b[0])
    batch_rows.append({
        "requests": len(prompts), "tokens": tokens,
        "drafts_tok_s": round(tokens / on_b[1], 2), "off_tok_s": round(sum(len(o.output_ids) for o in off_b[0]) / off_b[1], 2),
        "equal": sum(x.output_ids == y.output_ids for x, y in zip(on_b[0], off_b[0])),
        "forced_share": round(sum(o.stats.forced_tokens for o in on_b[0]) / max(tokens, 1), 3),
    })
    print(json.dumps(batch_rows[-1]), flush=True)
    load1 = os.getloadavg()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python -m bench.structured " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    (out / "results.json").write_text(json.dumps({"command": cmd, "load": [load0, load1], "requests": rows,
                                                  "batch": batch_rows}, indent=1))
    lines = [
        "# Schema-constrained requests: drafts (suffix + grammar-forced) vs G=0 vs generate + llguidance mask", "",
        f"Command: `{cmd.strip()}`  ",
        f"SmolLM2-135M-Instruct fp32, {a.threads} threads, greedy, at most {a.tokens} new tokens, chat prompts, JSON "
        f"schemas compiled by lp.grammar (llguidance, compact separators); best of {a.rounds} interleaved rounds; "
        f"load average at start {list(load0)}, at end {list(load1)}.", "",
        "| schema | tokens | valid | drafts tok/s | G=0 tok/s | generate tok/s | drafts / G=0 | S | rows/step "
        "(G=0) | forced share | == G=0 | == generate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['schema']} | {r['tokens']} | {r['valid']} | {r['drafts_tok_s']} | {r['off_tok_s']} | "
                     f"{r['generate_tok_s']} | {r['speedup_vs_off']}x | {r['S']} | {r['rows_per_step']} "
                     f"({r['off_rows_per_step']}) | {r['forced_share']} | {r['equal_drafts_off']} | "
                     f"{r['equal_generate']} |")
    tot_on = sum(r["tokens"] for r in rows) / sum(r["tokens"] / r["drafts_tok_s"] for r in rows)
    tot_off = sum(r["tokens"] for r in rows) / sum(r["tokens"] / r["off_tok_s"] for r in rows)
    lines += ["", f"All requests: drafts {tot_on:.2f} tok/s vs G=0 {tot_off:.2f} tok/s = **{tot_on / tot_off:.2f}x**.",
              "", f"## {a.batch} concurrent requests (batched steps, lp.engine.batch)", "",
              "| requests | tokens | drafts tok/s | G=0 tok/s | outputs equal | forced share |", "|---|---|---|---|---|---|"]
    for b in batch_rows:
        lines.append(f"| {b['requests']} | {b['tokens']} | {b['drafts_tok_s']} | {b['off_tok_s']} | "
                     f"{b['equal']}/{b['requests']} | {b['forced_share']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
