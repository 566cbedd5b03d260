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
    python -m bench.tp_memory --padded --tps 1,2 --quants none,int8,exact4 --rounds 1 \
        --out bench/results/tp_memory/smollm2_quant   # SmolLM2 (12 / 4 heads) quantized on TP 2

``--quants`` runs each model.quant at each tp; each rank also reports the bytes its model holds
and lp.parallel.memory's plan of them.
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


def worker(path: str, tp: int, whole: bool, out: str, device: str = "cpu", dtype: str = "float32",
           quant: str = "none") -> None:
    import torch
    from transformers import AutoConfig

    from lp.config import DecodingConfig, ParallelConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.model.loader import load_model
    from lp.model.runner import ModelRunner
    from lp.parallel.dist import exit_process, init_worker_group, worker_device
    from lp.parallel.memory import held_bytes, weights_bytes
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
        model, _ = load_for(Path(path), dtype, str(dev), quant, group)
    load_s = time.perf_counter() - t0
    loaded = status_mb("VmHWM")
    planned, _, planned_peak = weights_bytes(Path(path), AutoConfig.from_pretrained(path), tp, getattr(torch, dtype),
                                             dev, quant)
    res = LookaheadDecoder(ModelRunner(model, small_rows="off"), DecodingConfig(W=4, N=3, G=4, max_new_tokens=8),
                           group).generate(PROMPT)
    row = {"rank": 0 if group is None else group.rank, "before_mb": before, "loaded_mb": loaded,
           "peak_mb": status_mb("VmHWM"), "anon_end_mb": status_mb("RssAnon"), "load_s": load_s,
           "output_ids": res.output_ids, "quant": getattr(model, "_lp_quant", None) or "none",
           "weight_bytes": held_bytes(model), "planned_weight_bytes": planned, "planned_load_peak_bytes": planned_peak,
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


def pad_heads(src: Path, dst: Path, q_heads: int, kv_heads: int) -> Path:
    """``src`` (a Llama checkpoint in safetensors) rewritten with ``q_heads`` / ``kv_heads``
    attention heads, the added ones zero: zero rows of q/k/v_proj, zero columns of o_proj. The
    query-to-key grouping (q_heads // kv_heads) must stay the same, so every old query head keeps its
    old key/value head; an added head attends to zero values and o_proj ignores it, so the padded
    model computes the same function (to float rounding). SmolLM2-135M (9 / 3 heads, which no TP 2
    divides) padded to 12 / 4 runs on TP 2 (and TP 4)."""
    if (dst / "config.json").exists():
        return dst
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    q0, kv0 = config["num_attention_heads"], config["num_key_value_heads"]
    assert q0 // kv0 == q_heads // kv_heads and q_heads % kv_heads == 0 and q_heads >= q0, (q0, kv0, q_heads, kv_heads)
    hd = config.get("head_dim") or config["hidden_size"] // q0
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                if k.endswith("self_attn.q_proj.weight"):
                    t = torch.cat([t, t.new_zeros((q_heads - q0) * hd, t.shape[1])])
                elif k.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                    t = torch.cat([t, t.new_zeros((kv_heads - kv0) * hd, t.shape[1])])
                elif k.endswith("self_attn.o_proj.weight"):
                    t = torch.cat([t, t.new_zeros(t.shape[0], (q_heads - q0) * hd)], dim=1)
                tensors[k] = t.contiguous()
    assert not any(k.endswith("_proj.bias") and "self_attn" in k for k in tensors), "attention biases: not padded"
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.update(num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=hd)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, tmp / f.name)
    tmp.rename(dst)
    return dst


def padded_smollm2() -> Path:
    """SmolLM2-135M padded to 12 / 4 heads (``pad_heads``), written once under LP_CACHE."""
    from lp.model.loader import smollm2_folder

    cache = Path(os.environ.get("LP_CACHE", Path.home() / ".cache" / "lp"))
    return pad_heads(smollm2_folder(), cache / "smollm2-135m-instruct-pad12h4kv", 12, 4)


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


def run(path: Path, tp: int, whole: bool, tmp: Path, device: str = "cpu", dtype: str = "float32",
        quant: str = "none") -> list[dict]:
    out = tmp / f"tp{tp}{'w' if whole else ''}{'' if quant == 'none' else '_' + quant}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.tp_memory", "--worker", str(path), str(tp), str(int(whole)), str(out), device,
           dtype, quant]
    if tp > 1:
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", "-m", "bench.tp_memory"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tp={tp} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help="cuda: one rank per GPU (nccl), device memory reported too")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ckpt", default=str(Path(os.environ.get("LP_CACHE", Path.home() / ".cache" / "lp")) / "tp_memory_477m"))
    ap.add_argument("--smollm2", action="store_true", help="the real SmolLM2 (tied embeddings) instead")
    ap.add_argument("--padded", action="store_true",
                    help="SmolLM2 padded to 12 / 4 heads (pad_heads: the same function), which TP 2 and 4 divide")
    ap.add_argument("--quants", default="none", help="model.quant values to run at each tp (none, int8, exact4, auto)")
    ap.add_argument("--tps", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--whole", action="store_true", help="also the old whole-then-shard load at each tp > 1")
    ap.add_argument("--out", default="bench/results/tp_memory")
    args = ap.parse_args()
    if args.worker:
        path, tp, whole, out, device, dtype, quant = args.worker
        worker(path, int(tp), bool(int(whole)), out, device, dtype, quant)
        return
    if args.padded:
        path = padded_smollm2()
    elif args.smollm2:
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
    quants = args.quants.split(",")
    kinds = [(int(t), False, q) for q in quants for t in args.tps.split(",")]
    if args.whole:
        kinds += [(t, True, q) for t, _, q in kinds if t > 1]
    runs: dict = {kind_name(t, w, q): [] for t, w, q in kinds}
    for r in range(args.rounds):  # interleaved: every kind once per round
        for t, w, q in kinds:
            rows = run(path, t, w, out, args.device, args.dtype, q)
            runs[kind_name(t, w, q)].append(rows)
            print(f"round {r} {kind_name(t, w, q)}: peak per rank {[round(x['peak_mb']) for x in rows]} MB, weights "
                  f"{[round(x['weight_bytes'] / 2**20) for x in rows]} MiB, "
                  f"load {max(x['load_s'] for x in rows):.1f} s", flush=True)
    table = make_table(runs, {kind_name(t, w, q): kind_name(1, False, q) for t, w, q in kinds})
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    meta = {"checkpoint": str(path), "parameters": n_params, "dtype": args.dtype, "device": args.device,
            "rounds": args.rounds, "commit": commit,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg_end": os.getloadavg(), "command": "python -m bench.tp_memory " + " ".join(sys.argv[1:])}
    (out / "results.json").write_text(json.dumps({"meta": meta, "table": table, "runs": runs}, indent=1))
    lines = markdown(meta, table, n_params)
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def kind_name(tp: int, whole: bool, quant: str) -> str:
    return f"tp{tp}{' whole' if whole else ''}{'' if quant == 'none' else ' ' + quant}"


def make_table(runs: dict, base_of: dict) -> list[dict]:
    """One row per kind: medians over the rounds; outputs and peaks against ``base_of[kind]`` (TP 1,
    same model.quant)."""
    def peaks(kind):
        return [max(x["peak_mb"] for x in rs) for rs in runs[kind]]

    table = []
    for kind, rounds in runs.items():
        base = base_of[kind] if base_of[kind] in runs else None
        ref = runs[base][0][0]["output_ids"] if base else None
        loads = [max(x["load_s"] for x in rs) for rs in rounds]
        dev_peaks = [max((x["device_peak_mb"] or 0) for x in rs) for rs in rounds]
        last = rounds[-1]
        table.append({"kind": kind, "quant": sorted({x.get("quant", "none") for rs in rounds for x in rs}),
                      "peak_rank_mb_median": statistics.median(peaks(kind)), "peak_rank_mb": peaks(kind),
                      "weight_mib_per_rank": max(x["weight_bytes"] for x in last) / 2**20,
                      "planned_weight_mib_per_rank": max(x["planned_weight_bytes"] or 0 for x in last) / 2**20,
                      "planned_load_peak_mib_per_rank": max(x["planned_load_peak_bytes"] or 0 for x in last) / 2**20,
                      "device_peak_mb_median": statistics.median(dev_peaks) if any(dev_peaks) else None,
                      "runtime_before_load_mb": statistics.median(x["before_mb"] for rs in rounds for x in rs),
                      "anon_end_mb_median": statistics.median(x["anon_end_mb"] for rs in rounds for x in rs),
                      "load_s_median": statistics.median(loads), "load_s": loads,
                      "ratio_to_tp1": statistics.median(peaks(kind)) / statistics.median(peaks(base)) if base else None,
                      "outputs_equal_tp1": all(x["output_ids"] == ref for rs in rounds for x in rs) if base else None})
    return table


def markdown(meta: dict, table: list[dict], n_params: int) -> list[str]:
    lines = [f"# Memory per rank, {n_params / 1e6:.0f}M parameters, {meta['dtype']}, LP 1 x TP k ({meta['device']})",
             "", f"`{meta['command']}` at commit {meta['commit']}; {meta['rounds']} interleaved rounds (median, all "
             "rounds in results.json). Weights: the bytes each rank's model holds after loading (the largest rank), "
             "and lp.parallel.memory's plan of them (exact4 planned as float32: an upper bound). x TP 1 and "
             "outputs == TP 1: against TP 1 with the same model.quant.", "",
             "| run | quant | weights per rank (MiB) | planned (MiB) | planned load peak (MiB) "
             "| peak RSS per rank (MB) | x TP 1 | runtime before load (MB) | anon at end (MB) | device peak (MB) "
             "| load (s) | outputs == TP 1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in table:
        ratio = f"{row['ratio_to_tp1']:.2f}" if row["ratio_to_tp1"] else "-"
        lines.append(f"| {row['kind']} | {','.join(row['quant'])} | {row['weight_mib_per_rank']:.0f} | "
                     f"{row['planned_weight_mib_per_rank']:.0f} | {row['planned_load_peak_mib_per_rank']:.0f} | "
                     f"{row['peak_rank_mb_median']:.0f} ({min(row['peak_rank_mb']):.0f}-"
                     f"{max(row['peak_rank_mb']):.0f}) | {ratio} | {row['runtime_before_load_mb']:.0f} | "
                     f"{row['anon_end_mb_median']:.0f} | {row['device_peak_mb_median'] or '-'} | "
                     f"{row['load_s_median']:.1f} | {row['outputs_equal_tp1']} |")
    return lines


if __name__ == "__main__":
    main()
