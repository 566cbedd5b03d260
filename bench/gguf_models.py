"""GGUF files as stored, offline: load time, memory, and greedy decoding against transformers.

Contract: ``python -m bench.gguf_models FILE.gguf [FILE.gguf ...] [--prompts 4] [--max-new 64]
[--repeats 2] [--out bench/results/gguf]`` runs, per file, in a fresh process each (so each load's
time and peak memory are its own): lp's load (``model.path=FILE``, the defaults: ``model.quant=auto``
keeps the file's blocks in every format lp.model.gguf.KEPT names), the tensors' formats, how many
linears run on which kernel, the decoder stack, the tensors the model holds and peak RSS against
the file's size, then for the first prompts of HumanEval
(raw) and MT-Bench (the chat template: the file's, or the ChatML lp gives a file that holds none)
interleaved per repeat: transformers
``generate`` on lp's loaded model (greedy; the exactness reference: equal token for token), lp's
lookahead with its defaults, and ``from_pretrained(gguf_file=...)`` in float32 (transformers' own
loader: its texts are compared, equal up to near-ties since its dense products sum in another
order). Writes ``gguf.json`` / ``gguf.md`` with the command, commit, CPU and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.envelope import command, commit, cpu_name, write


def _peak_rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_file(path: str, prompts: int, max_new: int, repeats: int) -> dict:
    """Everything measured for one file, in this process."""
    from collections import Counter

    import torch

    from bench.config import PromptsConfig
    from bench.prompts import select
    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.model.loader import load_model
    from lp.model.runner import ModelRunner
    from tests.helpers import hf_greedy

    from lp.kernels.exact4 import Exact4Linear
    from lp.model.gguf import file_tensors

    # the file's index read without gguf.GGUFReader, whose parse of the vocabulary would count in the peak
    formats = dict(Counter(t.tensor_type.name for t in file_tensors(Path(path))))
    t0 = time.perf_counter()
    model, tok = load_model(Path(path), "auto", quant="auto")
    load_s = time.perf_counter() - t0
    rss_loaded = _peak_rss_mb()
    # linears per kernel (a stacked q/k/v counts 3), plain float linears, the embedding's and head's kind
    kernels = Counter()
    for m in model.modules():
        if isinstance(m, Exact4Linear):
            kernels[type(m).__name__] += len(m.splits)
        elif type(m).__name__ in ("Linear", "BlockHead", "BlockEmbedding"):
            kernels[type(m).__name__] += 1
    kernels = dict(kernels)
    held = {}
    for t in list(model.parameters()) + list(model.buffers()):
        held.setdefault(t.data_ptr(), t.numel() * t.element_size())
    held_mb = sum(held.values()) / 2**20
    runner = ModelRunner(model)
    stack = type(runner.fused).__name__ if runner.fused is not None else "transformers' modules"
    data = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
    sets = ["humaneval"] + (["mt_bench"] if tok.chat_template else [])
    items = []
    for s in sets:
        for p in select(PromptsConfig(sets=[s], num_prompts=max(1, prompts // len(sets))), data):
            if p.raw:
                ids = tok(p.text)["input_ids"]
            else:
                ids = tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            items.append((f"{p.set}/{p.id}", list(ids)))
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    LookaheadDecoder(runner, DecodingConfig(max_new_tokens=4)).generate(items[0][1][:16], eos)  # warm-up, t(Q)
    rows, speed = [], {"generate": [], "lp": []}
    for r in range(repeats):
        for name, ids in items:
            t = time.perf_counter()
            want = hf_greedy(model, ids, max_new, eos_token_id=eos or None)
            t_hf = time.perf_counter() - t
            t = time.perf_counter()
            res = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=max_new)).generate(ids, eos)
            t_lp = time.perf_counter() - t
            speed["generate"].append(len(want) / t_hf)
            speed["lp"].append(len(res.output_ids) / t_lp)
            if r == 0:
                rows.append({"prompt": name, "equal_generate": res.output_ids == want, "tokens": len(want),
                             "steps": res.stats.steps, "lp_ids": res.output_ids})
    rss_run = _peak_rss_mb()
    del model, runner
    from transformers import AutoModelForCausalLM

    f = Path(path)
    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32,
                                               attn_implementation="sdpa").eval()
    for row, (name, ids) in zip(rows, items):
        row["equal_transformers_gguf"] = hf_greedy(ref, ids, max_new, eos_token_id=eos or None) == row.pop("lp_ids")
    return {"file": path, "file_mb": round(os.path.getsize(path) / 2**20, 1), "formats": formats,
            "kernels": kernels, "stack": stack, "held_mb": round(held_mb, 1), "load_s": round(load_s, 1),
            "peak_rss_loaded_mb": round(rss_loaded),
            "peak_rss_run_mb": round(rss_run), "rows": rows,
            "tok_s": {k: [round(min(v), 1), round(statistics.median(v), 1), round(max(v), 1)] for k, v in speed.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/results/gguf")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: write one file's result here
    a = ap.parse_args(argv)
    if a.one:
        Path(a.one).write_text(json.dumps(one_file(a.files[0], a.prompts, a.max_new, a.repeats)))
        return 0
    results = []
    for f in a.files:
        tmp = Path(a.out) / f".{Path(f).stem}.json"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
        subprocess.run([sys.executable, "-m", "bench.gguf_models", f, "--prompts", str(a.prompts), "--max-new",
                        str(a.max_new), "--repeats", str(a.repeats), "--one", str(tmp)], check=True, env=env)
        results.append(json.loads(tmp.read_text()))
        tmp.unlink()
    result = {"command": command("bench.gguf_models", argv), "commit": commit(), "cpu": cpu_name(),
              "loadavg": os.getloadavg(), "results": results}
    md = ["# GGUF files as stored: lp's defaults against transformers", "",
          f"`{result['command']}` at {result['commit']}, {result['cpu']}.", "",
          "| file | MiB | formats | lp kernels (linears) | decoder stack | tensors held MiB | load s | "
          "peak RSS MiB (loaded / run) | lp == generate | lp == transformers' GGUF fp32 | tok/s generate | tok/s lp |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        eq = sum(row["equal_generate"] for row in r["rows"])
        eq_t = sum(row["equal_transformers_gguf"] for row in r["rows"])
        md.append(f"| {Path(r['file']).name} | {r['file_mb']} | {r['formats']} | {r['kernels']} | {r['stack']} | "
                  f"{r['held_mb']} | {r['load_s']} | "
                  f"{r['peak_rss_loaded_mb']} / {r['peak_rss_run_mb']} | {eq} / {len(r['rows'])} | "
                  f"{eq_t} / {len(r['rows'])} | "
                  f"{' / '.join(map(str, r['tok_s']['generate']))} | {' / '.join(map(str, r['tok_s']['lp']))} |")
    write(a.out, "gguf", result, md)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
