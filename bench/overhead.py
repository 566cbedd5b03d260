"""Step overhead: lookahead ms/step against transformers ``generate`` ms/token on a near-free model.

Contract: builds a tiny random Llama (2 layers, hidden 64, 4 heads / 2 KV heads) whose
compute is nearly free even for ~120 rows — how an accelerator sees a step (rows are
nearly free, the step is host- and launch-bound) — and times, in one run and one thread:

* transformers greedy ``generate`` on a 200-token prompt: ms per new token;
* lp's lookahead loop at each (W, N, G): ms per step, split into host work (propose,
  lay out, verify, publish, collect, commit) and the forward (model + LM head + the one
  device->host read), and first vs last quarter of the run (the step may grow with the
  output only by the attention over the cache).

``--vocab 49152`` gives the real SmolLM2 vocabulary (the LM head then dominates the
forward; the host work is what the lean step bounds). Writes JSON + markdown.

    python -m bench.overhead --out bench/results/step_cost/host_overhead
    python -m bench.overhead --vocab 49152 --tokens 512 --out bench/results/step_cost/host_overhead/vocab49k
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from bench.envelope import cpu_name

SHAPES = [(15, 5, 15), (5, 4, 5), (1, 2, 0)]  # (1, 2, 0): one-row steps, the loop's own cost


def tiny_llama(vocab: int, max_positions: int, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def time_generate(model, prompt: list[int], new_tokens: int, repeats: int) -> float:
    ids = torch.tensor([prompt])
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        best = min(best, time.perf_counter() - t)
        assert out.shape[1] - len(prompt) == new_tokens
    return best / new_tokens * 1e3


def time_lookahead(model, prompt: list[int], new_tokens: int, shape, repeats: int, attention: str) -> dict:
    from lp import DecodingConfig, LookaheadDecoder, ModelRunner

    W, N, G = shape
    try:
        runner = ModelRunner(model, attention=attention)
    except TypeError:  # a checkout from before model.attention (the "before" column)
        runner = ModelRunner(model)
    # G=0 with window_policy=with_candidates: every step is a one-row plain decode through
    # the whole lookahead loop, i.e. the loop's own overhead over generate
    policy = "with_candidates" if G == 0 else "always"
    dec = LookaheadDecoder(runner, DecodingConfig(W=W, N=N, G=G, max_new_tokens=new_tokens, window_policy=policy))
    best = None
    for _ in range(repeats):
        res = dec.generate(prompt)
        if best is None or res.stats.decode_time_s < best.stats.decode_time_s:
            best = res
    recs = best.stats.records[1:]  # the first step also prefills the prompt
    q = max(1, len(recs) // 4)

    def ms(rs, attr=None):
        if attr is None:
            return sum(r.forward_s + r.host_s + r.exchange_s for r in rs) / len(rs) * 1e3
        return sum(getattr(r, attr) for r in rs) / len(rs) * 1e3

    return {
        "W": W, "N": N, "G": G,
        "steps": best.stats.steps,
        "compression_ratio": round(best.stats.compression_ratio, 3),
        "ms_per_step": round(best.stats.decode_time_s / best.stats.steps * 1e3, 3),
        "host_ms_per_step": round(ms(recs, "host_s"), 3),
        "forward_ms_per_step": round(ms(recs, "forward_s"), 3),
        "first_quarter_ms_per_step": round(ms(recs[:q]), 3),
        "last_quarter_ms_per_step": round(ms(recs[-q:]), 3),
        "mean_rows": round(best.stats.mean_rows, 1),
        "output_ids": best.output_ids,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--shapes", nargs="+", default=[",".join(map(str, s)) for s in SHAPES], help="W,N,G ...")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    model = tiny_llama(args.vocab, args.prompt_len + max(args.tokens) + 64).to(args.device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, args.vocab, (args.prompt_len,), generator=g).tolist()
    time_generate(model, prompt, 16, 1)  # warm up
    rows = []
    for n in args.tokens:
        ar_ms = time_generate(model, prompt, n, args.repeats)
        ref = None
        for shape in shapes:
            r = time_lookahead(model, prompt, n, shape, args.repeats, args.attention)
            if ref is None:
                with torch.inference_mode():
                    ids = torch.tensor([prompt])
                    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=n, min_new_tokens=n)[0, len(prompt):].tolist()
            r.update(new_tokens=n, generate_ms_per_token=round(ar_ms, 3),
                     ratio=round(r["ms_per_step"] / ar_ms, 3), equal_to_generate=r.pop("output_ids") == ref)
            rows.append(r)
            print(json.dumps(r), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python -m bench.overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__,
        "vocab": args.vocab, "prompt_len": args.prompt_len, "attention": args.attention,
        "platform": platform.platform(),
    }
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# Step overhead (tiny Llama, vocab {args.vocab}, {args.prompt_len}-token prompt, {args.threads} thread)",
        "", f"`{meta['command']}` on {meta['cpu']}, torch {meta['torch']}", "",
        "| W, N, G | new tokens | lookahead ms/step | host ms/step | forward ms/step | first / last quarter ms/step "
        "| rows | S | generate ms/token | ratio | equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['W']}, {r['N']}, {r['G']} | {r['new_tokens']} | {r['ms_per_step']:.2f} | {r['host_ms_per_step']:.2f} "
            f"| {r['forward_ms_per_step']:.2f} | {r['first_quarter_ms_per_step']:.2f} / {r['last_quarter_ms_per_step']:.2f} "
            f"| {r['mean_rows']} | {r['compression_ratio']:.2f} | {r['generate_ms_per_token']:.2f} | {r['ratio']:.2f}x "
            f"| {r['equal_to_generate']} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
