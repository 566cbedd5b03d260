"""One step's cost on models of real shapes in a Q4_K_M mix, lp against llama.cpp:
``python -m bench.gguf_shapes --dir DIR``.

Contract: writes two GGUF files of random blocks (tests/gguf_tiny.py, SmolLM2's tokenizer): a
Qwen2.5-0.5B shape (hidden 896, 24 layers, ffn 4864, 14 / 2 heads; its Q4_K_M mix as llama.cpp
writes it for rows of 896, which K-quants cannot split: Q5_0 for attention and gate / up, Q8_0 for v,
Q6_K for down, a tied Q8_0 embedding) and a Llama-3.2-1B shape (hidden 2048, 16 layers, ffn 8192,
32 / 8 heads; Q4_K, Q6_K for v and down, a tied Q6_K embedding). For each: ``llama-bench`` (tg32 and
pp4-32, 2 threads; built by bench/llamacpp.sh) and lp's defaults, one packed forward of Q rows after a
128-token prefix (lp.model.calibrate.measure: a single sequence's cache, every logit), the served
one-token step (``serve_step``: lp.serve's BatchEngine on its paged pool, the greedy head: what
llama-bench's tg compares with), with the process's resident memory after the load.
Random weights: the steps' costs only, not lookahead's acceptance. Writes ``shapes.md`` into ``--out``.
``--files A.gguf,B.gguf`` measures those files instead (real models in any block format, the same
columns, the table ``files.md``), with each file's tensor formats.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SHAPES = {
    "qwen2-0.5b-shape-q4km": ("qwen2", {"hidden": 896, "ffn": 4864, "heads": 14, "kv_heads": 2, "head_dim": 64, "layers": 24},
                              {"attn": "Q5_0", "attn_v": "Q8_0", "ffn": "Q5_0", "ffn_down": "Q6_K", "embd": "Q8_0"}),
    "llama-1b-shape-q4km": ("llama", {"hidden": 2048, "ffn": 8192, "heads": 32, "kv_heads": 8, "head_dim": 64, "layers": 16},
                            {"attn": "Q4_K", "attn_v": "Q6_K", "ffn": "Q4_K", "ffn_down": "Q6_K", "embd": "Q6_K"}),
}


def lp_curve(file: str, qs: str) -> dict:
    """lp's t(Q) in ms and RSS after the load, in this process."""
    from lp.config import ModelConfig
    from lp.model.calibrate import measure
    from lp.model.loader import load_model
    from lp.model.runner import ModelRunner

    model, _ = load_model(Path(file), "auto", "cpu", "auto", tokenizer=False)
    mc = ModelConfig()
    runner = ModelRunner(model, mc.attention, mc.cuda_graphs, small_rows=mc.small_rows, linears=mc.linears,
                         compile=mc.compile, fused=mc.fused, head=mc.head)
    curve, _ = measure(runner, [int(q) for q in qs.split(",")], repeats=3)
    rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
    return {"tq_ms": {q: round(t * 1e3, 1) for q, t in curve}, "rss_mib": rss, "serve_ms": serve_step(runner)}


def serve_step(runner, prompt: int = 128, tokens: int = 32, repeats: int = 3) -> float:
    """The median one-token step in ms on lp.serve's path (BatchEngine, the paged pool, the greedy
    head), ``tokens`` plain steps after a ``prompt``-token random prompt, the fastest of ``repeats``."""
    import statistics

    import torch

    from bench.step_profile import run_request
    from lp.config import DecodingConfig
    from lp.engine.batch import BatchEngine

    engine = BatchEngine(runner, kv_tokens=4096, max_batch=1)
    ids = torch.randint(runner.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    dcfg = DecodingConfig(mode="ar", max_new_tokens=tokens + 1)
    best = float("inf")
    for _ in range(repeats + 1):
        walls, _, _ = run_request(engine, ids, dcfg, [])
        best = min(best, statistics.median(walls[1:]))
    return round(best * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/lp_shapes")
    ap.add_argument("--qs", default="1,2,4,8,16,32")
    ap.add_argument("--out", default="bench/results/gguf_formats")
    ap.add_argument("--llamacpp-dir", default=None)
    ap.add_argument("--files", default=None, help="comma-separated GGUF files to measure instead of the random shapes")
    ap.add_argument("--lp-only", default=None, help=argparse.SUPPRESS)  # the child process's file
    args = ap.parse_args()
    if args.lp_only:
        print(json.dumps(lp_curve(args.lp_only, args.qs)))
        return
    from bench.llamacpp import DEFAULT_DIR, binary
    from lp.model.loader import smollm2_path
    from tests.gguf_tiny import tokenizer_fields, write_tiny_gguf

    args.llamacpp_dir = args.llamacpp_dir or DEFAULT_DIR
    tok = tokenizer_fields(smollm2_path(), vocab=None)
    rows = ["| shape | file MiB | llama.cpp tg32 ms | llama.cpp pp4 / pp8 / pp16 / pp32 ms per step | lp t(Q) ms, Q = "
            + args.qs.replace(",", " / ") + " | lp served step ms | lp RSS MiB |", "|---|---|---|---|---|---|---|"]
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    if args.files:
        from collections import Counter

        from gguf import GGMLQuantizationType

        from lp.model.gguf import file_tensors

        files = [Path(f) for f in args.files.split(",")]
        rows[0] = rows[0].replace("| shape |", "| file | formats |")
        rows[1] = "|---" + rows[1]
    else:
        files = []
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        for name, (arch, dims, kinds) in SHAPES.items():
            files.append(Path(args.dir) / f"{name}.gguf")
            if not files[-1].exists():
                write_tiny_gguf(files[-1], arch, kinds, tok, tie=True, dims=dims)
    for file in files:
        bench = binary(args.llamacpp_dir, "llama-bench", "--llamacpp-dir")
        env = dict(os.environ, LD_LIBRARY_PATH=str(Path(bench).parent))
        out = subprocess.run([bench, "-m", str(file), "-t", "2", "-p", "4,8,16,32", "-n", "32", "-r", "3", "-o", "json"],
                             capture_output=True, text=True, env=env, check=True).stdout
        llama = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in json.loads(out)}
        tg = 1e3 / llama[(0, 32)]
        pp = " / ".join(f"{p / llama[(p, 0)] * 1e3:.1f}" for p in (4, 8, 16, 32))
        child = subprocess.run([sys.executable, "-m", "bench.gguf_shapes", "--lp-only", str(file), "--qs", args.qs],
                               capture_output=True, text=True, check=True).stdout
        lp = json.loads(child.strip().splitlines()[-1])
        name = file.stem
        if args.files:
            kinds = Counter(GGMLQuantizationType(t.tensor_type).name for t in file_tensors(file)
                            if t.tensor_type != GGMLQuantizationType.F32)
            name += " | " + ", ".join(f"{k} {n}" for k, n in kinds.most_common())
        rows.append(f"| {name} | {file.stat().st_size / 2**20:.0f} | {tg:.1f} | {pp} | "
                    f"{' / '.join(str(v) for v in lp['tq_ms'].values())} | {lp['serve_ms']} | {lp['rss_mib']} |")
        print(rows[-1], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from bench.envelope import command, commit, cpu_name

    what = "real files" if args.files else "real shapes (module doc: random weights, costs only)"
    (Path(args.out) / ("files.md" if args.files else "shapes.md")).write_text(
        f"# One step on {what}, lp against llama.cpp\n\n`{command('bench.gguf_shapes', None)}` at {commit()}, {cpu_name()}\n\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
