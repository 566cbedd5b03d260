"""One-GPU benchmark, under 8 minutes: t(Q) and single-device lookahead vs ar on SmolLM2.

    python -m bench.gpu_bench --out bench/results/gpu                 # cuda, bf16
    python -m bench.gpu_bench --out /tmp/gpu_cpu --device cpu --quick --threads 1  # CPU fallback

Contract: loads the model once on one device and writes, into ``--out``:
tq.json (median forward seconds per packed-row count Q on a 200-token cache),
results.jsonl (the rows of ``bench.run``: ar and lookahead at several W/N/G on
HumanEval and MT-Bench prompts, each output compared with ar's), summary.md,
scaling_check.md and machine.json. Decoding goes prompt by prompt through every
configuration, and stops starting new prompts once ``--budget-s`` is spent, so a
slow device still leaves balanced, complete files.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from itertools import zip_longest
from pathlib import Path

import torch

CONFIGS = [(5, 4, 5), (7, 4, 7), (10, 5, 10), (15, 5, 15), (30, 5, 30)]  # (W, N, G)
GPU_QS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def main(argv: list[str] | None = None) -> int:
    from bench import methods, report, scaling
    from bench.config import BenchConfig, PromptsConfig
    from bench.prompts import select, to_ids
    from bench.run import Job, machine_info, make_row, repo_path
    from lp.generate import eos_ids
    from lp.model import load_model, resolve_model_path

    ap = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (fallback path)")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA (and AMX CPUs), else float32")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-prompts", type=int, default=10, help="per set (humaneval, mt_bench)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop starting new prompts after this")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--quick", action="store_true", help="tiny: 1 prompt, 8 tokens, Q in {1,2,4}, one W/N/G")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available (use --device cpu --quick)", file=sys.stderr)
        return 2
    num_prompts, max_new, qs, repeats, configs = args.num_prompts, args.max_new_tokens, GPU_QS, 20, CONFIGS
    if args.quick:
        num_prompts, max_new, qs, repeats, configs = 1, 8, [1, 2, 4], 2, CONFIGS[:1]
    if args.threads:
        torch.set_num_threads(args.threads)

    path = resolve_model_path(args.model, args.model_path)
    model, tokenizer = load_model(path, args.dtype, args.device)
    dtype = str(model.dtype).replace("torch.", "")
    eos = eos_ids(model, tokenizer)
    machine = machine_info(BenchConfig(dtype=dtype, threads=torch.get_num_threads(), reference_threads=0), dtype, path)
    machine["device"] = args.device
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(args.device))
        machine.update(gpu=props.name, gpu_memory_GiB=round(props.total_memory / 2**30, 1),
                       cuda=torch.version.cuda)
    (out / "machine.json").write_text(json.dumps(machine, indent=2) + "\n")

    # t(Q)
    tq = scaling.TQCurve(scaling.measure_tq(model, qs, repeats=repeats))
    (out / "tq.json").write_text(json.dumps({"t_s": tq.to_json(), "dtype": dtype, "device": args.device,
                                             "cache_len": 200, "repeats": repeats}, indent=2) + "\n")
    print("[gpu_bench] t(Q) ms: " + ", ".join(f"{q}: {t * 1e3:.2f}" for q, t in sorted(tq.points.items())),
          flush=True)

    # prompts
    data_dir = repo_path(args.data_dir) if not Path(args.data_dir).is_absolute() else Path(args.data_dir)
    has_mt_bench = (data_dir / "mt_bench_questions.jsonl").is_file()
    sets = ["humaneval"] + (["mt_bench"] if has_mt_bench and not args.quick else [])
    pc = PromptsConfig(sets=sets, num_prompts=num_prompts, data_dir=str(data_dir),
                       max_new_tokens={s: max_new for s in ("humaneval", "mt_bench", "gsm8k", "classeval")})
    prompts = select(pc, data_dir)
    by_set = [[p for p in prompts if p.set == s] for s in sets]
    order = [p for group in zip_longest(*by_set) for p in group if p is not None]  # a cut-off keeps both sets
    cfg = BenchConfig(name="gpu", dtype=dtype)
    jobs = [Job("ar", 1, torch.get_num_threads())] + [Job("lookahead", 1, torch.get_num_threads(), W, N, G)
                                                      for W, N, G in configs]

    def decode(job: Job, ids: list[int], n: int):
        if job.method == "ar":
            return methods.run_ar(model, ids, n, eos)
        return methods.run_lookahead(model, ids, n, eos, job.W, job.N, job.G, True)

    warm_ids = to_ids(tokenizer, order[0])
    for job in jobs:  # warm-up: kernels, allocator, cuBLAS handles
        decode(job, warm_ids, 4)

    rows: list[dict] = []
    results = out / "results.jsonl"
    results.write_text("")
    t_decode = time.perf_counter()
    for p in order:
        if time.perf_counter() - t_decode > args.budget_s:
            print(f"[gpu_bench] budget of {args.budget_s:g} s spent; stopping before {p.set}#{p.index}", flush=True)
            break
        ids = to_ids(tokenizer, p)
        ar_run = None
        for job in jobs:
            run = asdict(decode(job, ids, max_new))
            ar_run = run if job.method == "ar" else ar_run
            row = make_row(cfg, job, p, run, ar_run, {}, dtype, len(ids), max_new)
            rows.append(row)
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
        last = rows[-len(jobs):]
        print(f"[gpu_bench] {p.set}#{p.index}: " + ", ".join(_brief(r) for r in last), flush=True)

    elapsed = time.perf_counter() - t_start
    report.write_all(rows, out, None, machine, [], elapsed)
    scaling.write_check(out, tq, rows)
    print(f"[gpu_bench] wrote {out} ({len(rows)} rows, {elapsed:.0f} s)", flush=True)
    return 0


def _brief(row: dict) -> str:
    name = row["method"] if row["W"] is None else f"{row['method']} W={row['W']} N={row['N']} G={row['G']}"
    flag = "" if row["matches_ar"] else " MISMATCH"
    return f"{name} {row['tokens_per_second']:.0f} tok/s S={row['S']:.2f}{flag}"


if __name__ == "__main__":
    sys.exit(main())
