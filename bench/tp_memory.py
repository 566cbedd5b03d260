"""Peak resident memory per rank and load time under tensor parallelism (issue 24).

Writes a random-weight Llama checkpoint once (default ~477M parameters, untied embeddings,
float32: ~1.9 GB) under ``--ckpt``, then for each tp in ``--tps`` starts ``tp`` processes
(torchrun, gloo, LP 1 x TP tp; tp 1 is one plain process) that each load the model through
``lp.parallel.tp.load_for`` (TP 1: transformers ``from_pretrained``; TP > 1: only the rank's
shards, read from safetensors slices) and decode one short greedy prompt. Each rank reports
VmHWM before loading (the runtime: torch, the process group, lp), after loading and after
decoding, RssAnon at the end, load time and its output. ``--whole`` adds the old path (every
rank loads the whole model, then shards it in memory) for comparison. Runs are interleaved
over ``--rounds``; the table reports the median and the spread per tp.

    python -m bench.tp_memory --out bench/results/tp_memory
    python -m bench.tp_memory --smollm2 --tps 1,3 --out bench/results/tp_memory/smollm2   # tied
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = [5, 17, 300, 4, 5, 17, 300, 4, 5, 17, 300, 4]


def status_mb(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(path: str, tp: int, whole: bool, out: str, device: str = "cpu", dtype: str = "float32") -> None:
    import torch

    from lp.config import DecodingConfig, ParallelConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.model.loader import load_model
    from lp.model.runner import ModelRunner
    from lp.parallel.dist import exit_process, init_worker_group, worker_device
    from lp.parallel.tp import load_for, shard_for

    torch.set_num_threads(1)
    dev = worker_device(device)
    group = init_worker_group(ParallelConfig(tp=tp, timeout_s=600), dev)  # nccl on CUDA, gloo on the CPU
    before = status_mb("VmHWM")
    t0 = time.perf_counter()
    if whole:
        model, _ = load_model(Path(path), dtype, str(dev))
        shard_for(model, group)
    else:
        model, _ = load_for(Path(path), dtype, str(dev), "none", group)
    load_s = time.perf_counter() - t0
    loaded = status_mb("VmHWM")
    res = LookaheadDecoder(ModelRunner(model, small_rows="off"), DecodingConfig(W=4, N=3, G=4, max_new_tokens=8),
                           group).generate(PROMPT)
    row = {"rank": 0 if group is None else group.rank, "before_mb": before, "loaded_mb": loaded,
           "peak_mb": status_mb("VmHWM"), "anon_end_mb": status_mb("RssAnon"), "load_s": load_s,
           "output_ids": res.output_ids,
           "device_peak_mb": torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None}
    rows = [row]
    if group is not None:
        import torch.distributed as dist

        rows = [None] * group.world_size
        dist.all_gather_object(rows, row)
    if group is None or group.rank == 0:
        Path(out).write_text(json.dumps(rows))
    if group is not None:
        group.close()
        exit_process(0)


def make_checkpoint(ckpt: Path, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int) -> Path:
    if (ckpt / "config.json").exists():
        return ckpt
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=False,
                      max_position_embeddings=512, initializer_range=0.02, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(ckpt)
    return ckpt


def run(path: Path, tp: int, whole: bool, tmp: Path, device: str = "cpu", dtype: str = "float32") -> list[dict]:
    out = tmp / f"tp{tp}{'w' if whole else ''}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.tp_memory", "--worker", str(path), str(tp), str(int(whole)), str(out), device,
           dtype]
    if tp > 1:
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", "-m", "bench.tp_memory"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tp={tp} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help="cuda: one rank per GPU (nccl), device memory reported too")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ckpt", default=str(Path(os.environ.get("LP_CACHE", Path.home() / ".cache" / "lp")) / "tp_memory_477m"))
    ap.add_argument("--smollm2", action="store_true", help="the real SmolLM2 (tied embeddings) instead")
    ap.add_argument("--tps", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--whole", action="store_true", help="also the old whole-then-shard load at each tp > 1")
    ap.add_argument("--out", default="bench/results/tp_memory")
    args = ap.parse_args()
    if args.worker:
        path, tp, whole, out, device, dtype = args.worker
        worker(path, int(tp), bool(int(whole)), out, device, dtype)
        return
    if args.smollm2:
        from lp.model.loader import resolve_model_path

        path = resolve_model_path("smollm2", None)
    else:
        path = make_checkpoint(Path(args.ckpt), 1024, 4096, 24, 16, 8, 49152)
    from safetensors import safe_open

    n_params = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                n = 1
                for d in shape:
                    n *= d
                n_params += n
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kinds = [(int(t), False) for t in args.tps.split(",")]
    if args.whole:
        kinds += [(t, True) for t, _ in kinds if t > 1]
    runs: dict = {f"tp{t}{' whole' if w else ''}": [] for t, w in kinds}
    for r in range(args.rounds):  # interleaved: every kind once per round
        for t, w in kinds:
            rows = run(path, t, w, out, args.device, args.dtype)
            runs[f"tp{t}{' whole' if w else ''}"].append(rows)
            print(f"round {r} tp={t}{' whole' if w else ''}: peak per rank "
                  f"{[round(x['peak_mb']) for x in rows]} MB, load {max(x['load_s'] for x in rows):.1f} s", flush=True)
    ref = runs["tp1"][0][0]["output_ids"] if "tp1" in runs else None
    table = []
    base = statistics.median(max(x["peak_mb"] for x in rs) for rs in runs["tp1"]) if "tp1" in runs else None
    for kind, rounds in runs.items():
        peaks = [max(x["peak_mb"] for x in rs) for rs in rounds]
        loads = [max(x["load_s"] for x in rs) for rs in rounds]
        same = all(x["output_ids"] == ref for rs in rounds for x in rs) if ref is not None else None
        dev_peaks = [max((x["device_peak_mb"] or 0) for x in rs) for rs in rounds]
        table.append({"kind": kind, "peak_rank_mb_median": statistics.median(peaks), "peak_rank_mb": peaks,
                      "device_peak_mb_median": statistics.median(dev_peaks) if any(dev_peaks) else None,
                      "runtime_before_load_mb": statistics.median(x["before_mb"] for rs in rounds for x in rs),
                      "anon_end_mb_median": statistics.median(x["anon_end_mb"] for rs in rounds for x in rs),
                      "load_s_median": statistics.median(loads), "load_s": loads,
                      "ratio_to_tp1": statistics.median(peaks) / base if base else None, "outputs_equal_tp1": same})
    meta = {"checkpoint": str(path), "parameters": n_params, "dtype": args.dtype, "device": args.device,
            "rounds": args.rounds,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg_end": os.getloadavg(), "command": "python -m bench.tp_memory " + " ".join(sys.argv[1:])}
    (out / "results.json").write_text(json.dumps({"meta": meta, "table": table, "runs": runs}, indent=1))
    lines = [f"# Peak resident memory per rank, {n_params / 1e6:.0f}M parameters, {args.dtype}, LP 1 x TP k "
             f"({args.device})", "",
             f"`{meta['command']}`; {args.rounds} interleaved rounds (median, all rounds in results.json).", "",
             "| run | peak RSS per rank (MB) | x TP 1 | runtime before load (MB) | anon at end (MB) | device peak (MB) "
             "| load (s) | outputs == TP 1 |",
             "|---|---|---|---|---|---|---|---|"]
    for row in table:
        ratio = f"{row['ratio_to_tp1']:.2f}" if row["ratio_to_tp1"] else "-"
        lines.append(f"| {row['kind']} | {row['peak_rank_mb_median']:.0f} ({min(row['peak_rank_mb']):.0f}-"
                     f"{max(row['peak_rank_mb']):.0f}) | {ratio} | {row['runtime_before_load_mb']:.0f} | "
                     f"{row['anon_end_mb_median']:.0f} | {row['device_peak_mb_median'] or '-'} | "
                     f"{row['load_s_median']:.1f} | {row['outputs_equal_tp1']} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
