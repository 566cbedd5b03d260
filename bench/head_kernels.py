"""The LM head's kernels side by side: the packed fp32 head, the bf16 greedy screen, the exact
8-bit blocks and their int8 greedy screen, on the default model's head (SmolLM2: 49,152 x 576, a
GGUF Q8_0 tensor).

Contract: ``python -m bench.head_kernels [--rows 1 2 4 8 12 16 24 32] [--reps 15] [--threads 1 2]
[--out bench/results/step_cost/head]`` times, interleaved in every round, one head forward of M
rows (the model's own final hidden states, from greedy answers to four chat prompts; a 64 MiB read
between calls evicts the head from the cache, as a step's decoder layers do) per kernel: ``fp32`` (oneDNN's packed GEMM, what
``model.head=exact`` runs), ``screen`` (lp.kernels.head.HeadScreen.logits: the bf16 pass, the
kept tokens' fp32 logits; ``model.head=screen``) and ``exact8`` (lp.kernels.exact4's ``mm8`` on the
head's 8-bit blocks, what ``model.head=auto`` runs under ``model.quant=exact4`` up to
``HEAD8_MAX_ROWS`` rows) and ``exact8_screen`` (``Head8.argmax_logits``: the int8 screen, then
``mm8`` on the kept tokens' groups; what greedy steps of ``SCREEN_ROWS`` rows run), and the bytes
each reads. Writes ``head.json`` and ``head.md`` (min /
median ms) with the command, commit, CPU and the load average at the start (this machine's
noise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.envelope import command, commit, cpu_name, write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="bench/results/step_cost/head")
    a = ap.parse_args(argv)
    from lp.config import ModelConfig
    from lp.kernels import exact4
    from lp.kernels.head import HeadScreen
    from lp.model.loader import load_model, resolve_model_path

    mc = ModelConfig()
    model, tok = load_model(resolve_model_path(mc.name, mc.path, mc.cache_dir), "float32", "cpu", "none")
    w_VD = model.get_output_embeddings().weight.detach().contiguous()
    states = []  # the head's inputs, one a decode step
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: states.append(i[0].detach()[0, -1:]))
    for prompt in ("Write a short story about a lighthouse keeper.", "What is 17 * 23? Explain step by step.",
                   "Write a Python function that reverses a linked list.", "What should I see in Paris?"):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        model.generate(ids, max_new_tokens=32, do_sample=False)
    hook.remove()
    states_SD = torch.cat(states[1:]).contiguous()
    code = exact4.encode8(w_VD)
    if code is None:
        raise ValueError(f"{mc.name}: its head is not exact 8-bit blocks")
    q, d = code
    p8 = exact4.pack8(q, d)
    h8 = exact4.Head8(p8, q.shape[0], q, d)
    if h8.screen is None:
        raise ValueError("the int8 screen needs the kernels' AVX-512 VNNI build")
    screen = HeadScreen(w_VD)
    packed = torch.ops.mkldnn._reorder_linear_weight(w_VD, None)
    kernels = {"fp32": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
               "screen": screen.logits, "exact8": lambda x: exact4.mm8(x, p8, q.shape[0]),
               "exact8_screen": lambda x: exact4.extension().screen8_logits(x, *h8.screen, p8, q.shape[0])[1]}
    nbytes = {"fp32": w_VD.numel() * 4, "screen": w_VD.numel() * 2, "exact8": q.numel() + d.numel() * 4,
              "exact8_screen": sum(t.numel() * t.element_size() for t in h8.screen)}
    flush = torch.ones(16 << 20)  # 64 MiB
    load = os.getloadavg()[0]
    rows = []
    gen = torch.Generator().manual_seed(0)
    for threads in a.threads:
        torch.set_num_threads(threads)
        for m in a.rows:
            x_MD = states_SD[torch.randint(0, len(states_SD), (m,), generator=gen)].contiguous()
            times = {k: [] for k in kernels}
            for _ in range(a.reps):
                for k, fn in kernels.items():
                    flush.sum()
                    t = time.perf_counter()
                    out = fn(x_MD)
                    times[k].append(1e3 * (time.perf_counter() - t) if out is not None else None)
            rows.append({"threads": threads, "rows": m,
                         **{k: {"min_ms": min(v), "median_ms": statistics.median(v)} if None not in v else None  # declined: more rows
                            for k, v in times.items()}})
            print(rows[-1], flush=True)
    result = {"command": command("bench.head_kernels", argv),
              "commit": commit(), "cpu": cpu_name(), "load_average_at_start": load, "bytes": nbytes,
              "head8_max_rows": exact4.HEAD8_MAX_ROWS, "screen_rows": list(exact4.SCREEN_ROWS), "results": rows}
    md = [f"# The LM head's kernels, {mc.name} ({w_VD.shape[0]} x {w_VD.shape[1]})", "",
          f"`{result['command']}` at {result['commit']}, {result['cpu']}, load average {load:.1f} at the start; "
          f"ms a forward, min / median of {a.reps} interleaved rounds. Bytes read: "
          + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in nbytes.items())
          + f". `model.head=auto` under exact4 runs exact8 up to {exact4.HEAD8_MAX_ROWS} rows, fp32 beyond; greedy "
          f"steps of {exact4.SCREEN_ROWS[0]}-{exact4.SCREEN_ROWS[1]} rows run exact8_screen.", "",
          "| threads | rows | fp32 | screen (bf16 + kept fp32) | exact8 | exact8_screen |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['threads']} | {r['rows']} | " + " | ".join(
            f"{r[k]['min_ms']:.2f} / {r[k]['median_ms']:.2f}" if r[k] else "declines (rows)" for k in kernels) + " |")
    write(a.out, "head", result, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
