"""One draft budget for the batch vs a static "no drafts above batch k" rule vs no drafts.

Contract: ``python -m bench.batch_policy [--batches 1,2,4,8] [--static 2,4] [--tokens 64]
[--rounds 2] [--out bench/results/batch/policy_queue]`` loads SmolLM2 (fp32, this CPU) once and,
for each batch size B, decodes the first B prompts of a mixed list (chat prompts from
tests/data/prompts.json alternating with HumanEval code prompts) in one ``BatchEngine``
per draft policy:

* ``budget``: lp's default, one draft budget over every sequence's trie nodes on the
  measured t(Q) curve (lp.drafts.select.select_trees);
* ``static<k>``: each sequence drafts with its own one-sequence budget while at most k
  sequences decode, and not at all above k (the kind of rule vLLM's
  ``num_speculative_tokens_per_batch_size`` and TensorRT-LLM's per-batch settings encode);
* ``none``: plain batched decoding, no drafts.

Policies run interleaved per batch size, ``--rounds`` times, best wall time kept. By default
batch size B decodes B prompts together and the time is the batch's makespan (the slowest
sequence's); ``--queue N`` instead queues N prompts with at most B decoding at once, a
finished sequence's slot refilled at the next step (continuous batching, as lp.serve runs).
Aggregate tokens/s = all new tokens / wall time. Every output is checked against
``LookaheadDecoder.generate`` of its prompt (one sequence, == greedy generate by the test
suite): a mismatch is reported in the table, not hidden. Writes results.json and summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def mixed_prompts(tokenizer, k: int) -> list[list[int]]:
    """Chat and HumanEval prompts alternating (bench.batch's sets): the first k."""
    from bench.batch import chat_prompts, code_prompts

    out = []
    for a, b in zip(chat_prompts(tokenizer), code_prompts(tokenizer, k)):
        out += [a, b]
    return out[:k]


def run_policy(runner, cfg, eos, prompts, tq, policy: str, max_batch: int | None = None
               ) -> tuple[float, list[list[int]], float]:
    from lp.engine.batch import BatchEngine

    static = policy.startswith("static")
    engine = BatchEngine(runner, kv_tokens=32768, max_batch=max_batch or len(prompts), tq_curve=tq,
                         draft_policy="static" if static else policy,
                         static_batch=int(policy[6:]) if static else 4)
    ids = [engine.add(p, cfg, eos) for p in prompts]
    rows, steps = 0, 0
    t = time.perf_counter()
    while engine.has_work:
        engine.step()
        rows, steps = rows + engine.last_rows, steps + 1
    wall = time.perf_counter() - t
    return wall, [engine.result(i).output_ids for i in ids], rows / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--static", default="2,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--queue", type=int, default=0,
                    help="0: each batch size B decodes B prompts together (the batch's makespan); N > 0: N "
                         "prompts queued, at most B decoding at once, a finished one's slot refilled at once "
                         "(continuous batching, what lp.serve does)")
    ap.add_argument("--out", default="bench/results/batch/policy_queue")
    args = ap.parse_args()
    from bench.batch import load

    runner, eos, tok, dec = load(args.threads, args.tokens)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = mixed_prompts(tok, max(batches + [args.queue]))
    ref = [dec.generate(p, eos).output_ids for p in prompts]  # also measures / reads t(Q)
    policies = ["budget"] + [f"static{k}" for k in args.static.split(",") if k] + ["none"]
    load0 = os.getloadavg()
    rows = []
    for b in batches:
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for pol in policies:
                queue = prompts[: args.queue or b]
                wall, outs, mean_rows = run_policy(runner, dec.cfg, eos, queue, dec.tq, pol, max_batch=b)
                tokens = sum(len(o) for o in outs)
                if pol not in best or wall < best[pol]["wall_s"]:
                    best[pol] = {"batch": b, "policy": pol, "wall_s": round(wall, 3), "tokens": tokens,
                                 "tok_s": round(tokens / wall, 2), "mean_rows": round(mean_rows, 1),
                                 "equal_generate": sum(o == r for o, r in zip(outs, ref)),
                                 "requests": len(queue)}
        for pol in policies:
            rows.append(best[pol])
            print(json.dumps(best[pol]), flush=True)
    load1 = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python -m bench.batch_policy " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    (out / "results.json").write_text(json.dumps({"command": cmd, "load_start": load0, "load_end": load1,
                                                  "rows": rows}, indent=1))
    lines = ["# Draft policy in batched steps: one budget vs a static rule vs no drafts", "",
             f"Command: `{cmd}`  ", f"SmolLM2-135M-Instruct fp32, {args.threads} threads, {args.tokens} new tokens per "
             f"prompt, mixed chat + HumanEval prompts; best of {args.rounds} interleaved rounds; load average at start "
             f"{[round(x, 2) for x in load0]}, at end {[round(x, 2) for x in load1]}. "
             + (f"Continuous batching: {args.queue} prompts queued, at most `batch` decoding at once, a freed slot "
                "refilled at the next step; tok/s = all tokens / time to drain the queue."
                if args.queue else "Each batch size B decodes B prompts together: tok/s = their tokens / the time "
                "the last one finishes (the batch's makespan)."), "",
             "| batch | " + " | ".join(f"{p} tok/s (rows/step)" for p in policies) + " | outputs == generate |",
             "|---|" + "---|" * (len(policies) + 1)]
    for b in batches:
        cells = {r["policy"]: r for r in rows if r["batch"] == b}
        eq = "/".join(str(cells[p]["equal_generate"]) for p in policies)
        lines.append(f"| {b} | " + " | ".join(f"{cells[p]['tok_s']} ({cells[p]['mean_rows']})" for p in policies)
                     + f" | {eq} of {cells[policies[0]]['requests']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
