"""A scaling model of lookahead decoding and Lookahead Parallelism (LP), and its checks.

Contract: the model is plain arithmetic over measured (or assumed) inputs:

    t(Q)        seconds of one forward with Q packed rows on a ~200-token cache
    S(W,N,G)    step compression (new tokens / steps), measured or from the paper's law
    speedup(P)  = S(W,N,G) * t(1) / (t(Q_dev) + t_exchange)

where Q_dev is the most packed rows any of P devices runs per step (lp.lookahead.shard's
plan) and t_exchange the per-step all_gather. The paper's law (arXiv 2402.02057
§4): E = (γ+1) − Σ_{i=1..γ} (1−α^i)^b and S = (f−1+E)/f with γ = N−1, b = G.

    python -m bench.scaling measure --out DIR [--dtype float32 --threads 1]   # t(Q) -> DIR/tq.json
    python -m bench.scaling check bench/results/default [--tq DIR/tq.json]    # predicted vs measured LP
    python -m bench.scaling search --tq DIR/tq.json --devices 2 --fit bench/results/default
    python -m bench.scaling paper                                             # the 8-GPU note (SCALING.md)
    python -m bench.scaling mesh [--gpu h200 --devices 8]                     # best lp x tp split (SCALING.md)

Only the t(Q) measurement touches a model (lp.model.runner.ModelRunner); the rest reads JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_QS = (1, 2, 4, 8, 16, 32, 64, 128)


# ---------------------------------------------------------------------------
# the paper's law


def expected_tokens(alpha: float, gamma: int, b: float) -> float:
    """E[#tokens] of b parallel speculations of length gamma, per-token acceptance alpha."""
    return (gamma + 1) - sum((1 - alpha**i) ** b for i in range(1, gamma + 1))


def compression(alpha: float, f: float, gamma: int, b: float) -> float:
    """S = (f - 1 + E) / f: one step in f speculates well, the others publish one token."""
    return (f - 1 + expected_tokens(alpha, gamma, b)) / f


def fit_law(points: Sequence[tuple[int, float, float]]) -> tuple[float, float] | None:
    """Least-squares (alpha, f) over measured (gamma, b, S); None with fewer than 2 distinct b.

    With S nearly flat in b (short outputs, few prompts) the fit is degenerate
    (alpha -> 1, f large); ``fit_rmse`` says how well it describes the points."""
    import numpy as np
    from scipy.optimize import curve_fit

    if len({(g, b) for g, b, _ in points}) < 2:
        return None
    x = np.array([[g, b] for g, b, _ in points], dtype=float).T
    y = np.array([s for _, _, s in points], dtype=float)

    def model(x_2M, alpha, f):
        return np.array([compression(alpha, f, int(g), b) for g, b in x_2M.T])

    try:
        with warnings.catch_warnings():  # a flat S(b) leaves the covariance undefined: fine, see fit_rmse
            warnings.simplefilter("ignore")
            (alpha, f), _ = curve_fit(model, x, y, p0=[0.4, 3.0], bounds=([1e-4, 1.0], [0.9999, 1e3]))
    except (RuntimeError, ValueError):
        return None
    return float(alpha), float(f)


def fit_rmse(points: Sequence[tuple[int, float, float]], fit: tuple[float, float]) -> float:
    return math.sqrt(sum((compression(fit[0], fit[1], g, b) - s) ** 2 for g, b, s in points) / len(points))


# ---------------------------------------------------------------------------
# rows per step and per device


def packed_rows(W: int, N: int, G: int, pending: int = 1) -> int:
    """Rows of one steady-state step: pending + base stripe (W-1) + deeper levels W(N-2) + candidates G(N-1)."""
    return pending + (W - 1) + W * (N - 2) + G * (N - 1)


def rows_per_device(P: int, W: int, N: int, G: int, pending: int = 1) -> int:
    """The most rows any of P workers runs under lp.lookahead.shard's balanced plan (every worker runs the pending rows).

    lp.lookahead.shard.plan_shards tries every load from the smallest up, which is slow for the
    large W and G of a search; this bisects on the same feasibility test (lp.lookahead.shard._try_load)
    when it exists, and falls back to plan_shards otherwise."""
    from lp.lookahead import shard

    depth, R = N - 2, N - 1
    if P == 1:
        return pending + shard.column_rows(range(W), depth) + G * R
    try_load = getattr(shard, "_try_load", None)
    if try_load is None:
        return max(s.rows for s in shard.plan_shards(P, pending, W, depth, G, R))
    lo, hi = pending, pending + shard.column_rows(range(W), depth) + G * R  # hi is always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if try_load(mid, P, pending, W, depth, G, R) is not None:
            hi = mid
        else:
            lo = mid + 1
    return max(s.rows for s in try_load(lo, P, pending, W, depth, G, R))


# ---------------------------------------------------------------------------
# t(Q)


@dataclass
class TQCurve:
    """Forward seconds per packed-row count, piecewise linear, extrapolated from the last two points."""

    points: dict[int, float]

    def __call__(self, q: float) -> float:
        qs = sorted(self.points)
        if q <= qs[0]:
            return self.points[qs[0]]
        for a, b in zip(qs, qs[1:]):
            if q <= b:
                ta, tb = self.points[a], self.points[b]
                return ta + (tb - ta) * (q - a) / (b - a)
        a, b = qs[-2], qs[-1]
        slope = (self.points[b] - self.points[a]) / (b - a)
        return self.points[b] + slope * (q - b)

    def to_json(self) -> dict:
        return {str(q): t for q, t in sorted(self.points.items())}

    @classmethod
    def load(cls, path: Path) -> TQCurve:
        data = json.loads(Path(path).read_text())
        return cls({int(q): float(t) for q, t in data["t_s"].items()})


def measure_tq(model, qs: Iterable[int] = DEFAULT_QS, cache_len: int = 200, repeats: int = 7) -> dict[int, float]:
    """Median seconds of one packed forward with Q rows after a ``cache_len``-token prefix.

    Rows form one causal chain and all go through the LM head (as the kept rows
    of a lookahead step mostly do); with SDPA the cost does not depend on the mask's
    content. The cache is cropped back after every forward."""
    import torch

    from lp.lookahead.layout import chain_layout
    from lp.model.runner import ModelRunner

    qs = list(qs)
    runner = ModelRunner(model)
    vocab = runner.vocab_size
    prefix = [(17 * i + 11) % vocab for i in range(cache_len)]
    cache = runner.new_cache(cache_len + max(qs) + 1, max(qs))
    runner.forward(chain_layout(prefix), cache)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    out: dict[int, float] = {}
    for q in qs:
        layout = chain_layout([(31 * i + 7) % vocab for i in range(q)])
        times = []
        for r in range(repeats + 1):  # the first run is a warm-up
            sync()
            t = time.perf_counter()
            runner.forward(layout, cache)
            sync()
            if r:
                times.append(time.perf_counter() - t)
            runner.crop(cache, cache_len)
        out[q] = statistics.median(times)
    return out


# ---------------------------------------------------------------------------
# prediction and search


def predict_speedup(S: float, tq: TQCurve, q_dev: float, t_exchange: float = 0.0, t_host: float = 0.0) -> float:
    return S * tq(1) / (tq(q_dev) + t_exchange + t_host)


def search(tq: TQCurve, devices: int, alpha: float, f: float, t_exchange: float = 0.0,
           Ws: Iterable[int] = range(1, 65), Ns: Iterable[int] = range(3, 9), g_ratio: float = 1.0,
           top: int = 10) -> list[dict]:
    """Best (W, N, G = g_ratio*W) on ``devices`` workers by predicted speedup, with S from the law."""
    out = []
    for N in Ns:
        for W in Ws:
            G = max(0, round(g_ratio * W))
            S = compression(alpha, f, N - 1, G)
            pending = 1 if devices == 1 else max(1, round(S))
            q = rows_per_device(devices, W, N, G, pending)
            out.append({"W": W, "N": N, "G": G, "S": S, "Q_dev": q,
                        "speedup": predict_speedup(S, tq, q, t_exchange if devices > 1 else 0.0)})
    return sorted(out, key=lambda r: -r["speedup"])[:top]


# ---------------------------------------------------------------------------
# the check against measured results


def load_rows(results_dir: Path) -> list[dict]:
    path = Path(results_dir) / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def law_points(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(gamma, b=G, S) per (set, W, N, G) of the lookahead family (lp has the same S)."""
    acc: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        if r["method"] in ("lookahead", "lp") and r["W"] is not None and not r.get("same_as"):
            a = acc[(r["set"], r["W"], r["N"], r["G"])]
            a[0] += r["new_tokens"]
            a[1] += r["steps"]
    return [(N - 1, float(G), tok / steps) for (_, _, N, G), (tok, steps) in sorted(acc.items()) if steps]


def check(rows: list[dict], tq: TQCurve, threads: int | None = None) -> list[dict]:
    """Predicted vs measured speedup over ar (same threads per worker) of every lookahead/lp config.

    Only runs at ``threads`` threads per worker when given (t(Q) was measured at that count);
    rows that reuse another method's runs (``same_as``) are skipped. Q/device is the
    steady-state rows of the busiest worker: the first step (the prompt's prefill) is left out."""
    ar = defaultdict(lambda: [0, 0.0])
    for r in rows:
        if r["method"] == "ar":
            a = ar[(r["threads"], r["set"], r["prompt_index"])]
            a[0], a[1] = r["new_tokens"], r["decode_time_s"]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["method"] in ("lookahead", "lp") and not r.get("same_as") and threads in (None, r["threads"]):
            groups[(r["method"], r["workers"], r["threads"], r["W"], r["N"], r["G"])].append(r)
    out = []
    for (method, workers, threads, W, N, G), rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        ar_rs = [ar[(threads, r["set"], r["prompt_index"])] for r in rs if (threads, r["set"], r["prompt_index"]) in ar]
        if len(ar_rs) != len(rs):
            continue
        tokens = sum(r["new_tokens"] for r in rs)
        steps = sum(r["steps"] for r in rs)
        time_s = sum(r["decode_time_s"] for r in rs)
        S = tokens / steps
        busiest = [max(r["rows_per_rank_per_step"] or [r["rows_per_step"]]) * r["steps"] for r in rs]
        prefill = sum(r["prompt_tokens"] for r in rs if r["steps"] > 1)
        q_dev = (sum(busiest) - prefill) / max(1, steps - sum(1 for r in rs if r["steps"] > 1))
        t_ex = sum((r["exchange_time_s"] or 0.0) for r in rs) / steps
        t_host = sum((r["host_time_s"] or 0.0) for r in rs) / steps
        measured = (tokens / time_s) / (sum(a[0] for a in ar_rs) / sum(a[1] for a in ar_rs))
        out.append({
            "method": method, "workers": workers, "threads": threads, "W": W, "N": N, "G": G,
            "prompts": len(rs), "S": round(S, 3), "Q_dev": round(q_dev, 1),
            "t1_ms": round(tq(1) * 1e3, 2), "tQ_ms": round(tq(q_dev) * 1e3, 2),
            "t_exchange_ms": round(t_ex * 1e3, 3), "t_host_ms": round(t_host * 1e3, 3),
            "predicted": round(predict_speedup(S, tq, q_dev, t_ex), 3),
            "predicted_with_host": round(predict_speedup(S, tq, q_dev, t_ex, t_host), 3),
            "measured": round(measured, 3),
        })
    return out


def check_markdown(checks: list[dict], tq: TQCurve, fit: tuple[float, float] | None) -> str:
    lines = [
        "# Scaling model vs measurement",
        "",
        "Predicted speedup over `ar` (same threads per worker) = S · t(1) / (t(Q_dev) + t_exchange), with",
        "Q_dev the busiest worker's packed rows per step after the prefill step;",
        "`+host` also adds the measured per-step host time (pool, window, layout, mask) the paper's",
        "model leaves out. t(Q) was measured in one process (see tq.json); during LP the workers",
        "share the machine's memory bandwidth, which the model does not see.",
        "",
        "t(Q) ms: " + ", ".join(f"Q={q}: {t * 1e3:.1f}" for q, t in sorted(tq.points.items())),
        "",
    ]
    if fit:
        lines += [f"Fitted law over the lookahead/lp runs: α = {fit[0]:.3f}, f = {fit[1]:.3f} (b = G, γ = N − 1).", ""]
    lines += [
        "| method | workers | threads | W | N | G | S | Q/device | t(Q) ms | exchange ms/step | host ms/step "
        "| predicted | predicted +host | measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c['method']} | {c['workers']} | {c['threads']} | {c['W']} | {c['N']} | {c['G']} | {c['S']:.2f} "
            f"| {c['Q_dev']:.1f} | {c['tQ_ms']:.1f} | {c['t_exchange_ms']:.2f} | {c['t_host_ms']:.2f} "
            f"| {c['predicted']:.2f}x | {c['predicted_with_host']:.2f}x | {c['measured']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def write_check(results_dir: Path, tq: TQCurve, rows: list[dict] | None = None,
                threads: int | None = None) -> list[dict]:
    results_dir = Path(results_dir)
    rows = rows if rows is not None else load_rows(results_dir)
    checks = check(rows, tq, threads)
    fit = fit_law(law_points(rows))
    (results_dir / "scaling_check.json").write_text(json.dumps({"checks": checks, "fit": fit}, indent=2) + "\n")
    (results_dir / "scaling_check.md").write_text(check_markdown(checks, tq, fit))
    return checks


# ---------------------------------------------------------------------------
# on paper: an 8-GPU node from published figures


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_GBps: float  # peak memory bandwidth (datasheet)
    bf16_TFLOPS: float  # dense tensor-core peak (datasheet)
    allgather_us: float  # small-message NCCL all_gather latency on the node (assumed)


GPUS = {
    "a100-40gb": GPU("A100-SXM4-40GB", 1555.0, 312.0, 25.0),
    "a100-80gb": GPU("A100-SXM4-80GB", 2039.0, 312.0, 25.0),
    "h100": GPU("H100-SXM5-80GB", 3350.0, 989.0, 20.0),
    "h200": GPU("H200-SXM-141GB", 4800.0, 989.0, 20.0),
}


def roofline_tq(gpu: GPU, params: float, bytes_per_param: float = 2.0, overhead_ms: float = 0.0,
                bw_eff: float = 0.8, flop_eff: float = 0.5) -> TQCurve:
    """t(Q) = overhead + max(weights / (bw_eff·BW), Q·2·params / (flop_eff·FLOPS)) at Q = 1..1024."""
    t_mem = params * bytes_per_param / (bw_eff * gpu.hbm_GBps * 1e9)
    pts = {}
    for q in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        t_flop = q * 2 * params / (flop_eff * gpu.bf16_TFLOPS * 1e12)
        pts[q] = overhead_ms * 1e-3 + max(t_mem, t_flop)
    return TQCurve(pts)


def paper_table(gpu_key: str, params: float, alpha: float, f: float, overhead_ms: float,
                devices: Sequence[int] = (1, 2, 4, 8)) -> str:
    gpu = GPUS[gpu_key]
    tq = roofline_tq(gpu, params, overhead_ms=overhead_ms)
    rows = [
        f"**{gpu.name}**, {_count(params)} params in bf16, per-step overhead {overhead_ms:g} ms, "
        f"α = {alpha}, f = {f}: t(1) = {tq(1) * 1e3:.2f} ms, compute-bound from Q ≈ "
        f"{_knee(gpu, params):.0f} rows",
        "",
        "| devices | best W | N | G | S | rows/device | t(Q) ms | predicted speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for P in devices:
        best = search(tq, P, alpha, f, gpu.allgather_us * 1e-6, Ws=range(1, 129), Ns=range(3, 9), top=1)[0]
        rows.append(
            f"| {P} | {best['W']} | {best['N']} | {best['G']} | {best['S']:.2f} | {best['Q_dev']} "
            f"| {tq(best['Q_dev']) * 1e3:.2f} | {best['speedup']:.2f}x |"
        )
    return "\n".join(rows) + "\n"


def _count(params: float) -> str:
    return f"{params / 1e9:g}B" if params >= 1e9 else f"{params / 1e6:g}M"


def _knee(gpu: GPU, params: float, bw_eff: float = 0.8, flop_eff: float = 0.5) -> float:
    t_mem = params * 2 / (bw_eff * gpu.hbm_GBps * 1e9)
    return t_mem * flop_eff * gpu.bf16_TFLOPS * 1e12 / (2 * params)


# ---------------------------------------------------------------------------
# the (lp, tp) mesh on paper: which split of D devices decodes one sequence fastest


@dataclass
class ModelShape:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int


MODELS = {  # Llama-3 shapes (tp must divide the 8 KV heads: 1, 2, 4, 8)
    "1b": ModelShape("Llama-3.2-1B", 1.24e9, 16, 2048, 8),
    "8b": ModelShape("Llama-3.1-8B", 8.03e9, 32, 4096, 8),
    "70b": ModelShape("Llama-3.1-70B", 70.6e9, 80, 8192, 8),
}
GPU_MEM_GB = {"h200": 141.0, "h100": 80.0, "a100-80gb": 80.0, "a100-40gb": 40.0}
ALLREDUCE_US = {1: 0.0, 2: 10.0, 4: 15.0, 8: 20.0}  # small-message NCCL all-reduce on NVLink (assumed)
BUS_GBPS = 350.0  # effective NCCL bus bandwidth for the all-reduce's bandwidth term (assumed)


MESH_WS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)  # the search grid of W (= G)


@functools.lru_cache(maxsize=None)
def _rows_cached(P: int, W: int, N: int, G: int, pending: int) -> int:
    return rows_per_device(P, W, N, G, pending)


def mesh_step_time(gpu: GPU, m: ModelShape, q: float, tp: int, overhead_ms: float = 0.0,
                   bw_eff: float = 0.8, flop_eff: float = 0.5) -> float:
    """Seconds of one TP-group forward of q rows: the roofline on 1/tp of the weights, plus the
    2 all-reduces per layer (o_proj, down_proj) of q x hidden bf16 values."""
    t_mem = m.params * 2 / tp / (bw_eff * gpu.hbm_GBps * 1e9)
    t_flop = q * 2 * m.params / tp / (flop_eff * gpu.bf16_TFLOPS * 1e12)
    t_ar = 0.0
    if tp > 1:
        nbytes = q * m.hidden * 2
        t_ar = 2 * m.layers * (ALLREDUCE_US[tp] * 1e-6 + 2 * (tp - 1) / tp * nbytes / (BUS_GBPS * 1e9))
    return overhead_ms * 1e-3 + max(t_mem, t_flop) + t_ar


def mesh_fits(gpu_key: str, m: ModelShape, tp: int, kv_gb: float = 8.0) -> bool:
    """Weights / tp plus a KV cache share fit in 90% of one device's memory."""
    return m.params * 2 / tp / 1e9 + kv_gb / tp <= 0.9 * GPU_MEM_GB[gpu_key]


def mesh_rows(gpu_key: str, model_key: str, overhead_ms: float, devices: int = 8, alpha: float = 0.425,
              f: float = 3.106) -> list[dict]:
    """Every split lp x tp = devices (tp dividing the KV heads, the shard fitting in memory) with
    its best (W, N, G = W) under the law, plus plain TP and PP greedy on all devices; tok/s each."""
    gpu, m = GPUS[gpu_key], MODELS[model_key]
    one = mesh_step_time(gpu, m, 1, 1, overhead_ms)  # greedy on one device (if it fitted)
    rows = []
    for tp in (t for t in (1, 2, 4, 8) if devices % t == 0 and m.kv_heads % t == 0):
        lp = devices // tp
        if not mesh_fits(gpu_key, m, tp):
            rows.append({"split": f"lp{lp} x tp{tp}", "fits": False})
            continue
        best = None
        for N in range(3, 9):
            for W in MESH_WS:
                S = compression(alpha, f, N - 1, W)
                q = _rows_cached(lp, W, N, W, 1 if lp == 1 else max(1, round(S)))
                t = mesh_step_time(gpu, m, q, tp, overhead_ms) + (gpu.allgather_us * 1e-6 if lp > 1 else 0.0)
                if best is None or S / t > best["tok_s"]:
                    best = {"W": W, "N": N, "G": W, "S": S, "Q_dev": q, "t_ms": t * 1e3, "tok_s": S / t}
        rows.append({"split": f"lp{lp} x tp{tp}", "fits": True, **best})
    t_tp = mesh_step_time(gpu, m, 1, devices, overhead_ms)
    rows.append({"split": f"TP {devices} greedy", "fits": mesh_fits(gpu_key, m, devices), "S": 1.0, "Q_dev": 1,
                 "t_ms": t_tp * 1e3, "tok_s": 1 / t_tp})
    # PP at batch 1: the stages run one after another; one device's time plus (D-1) hops
    t_pp = one + (devices - 1) * 10e-6
    rows.append({"split": f"PP {devices} greedy", "fits": mesh_fits(gpu_key, m, 1) or devices > 1, "S": 1.0,
                 "Q_dev": 1, "t_ms": t_pp * 1e3, "tok_s": 1 / t_pp})
    for r in rows:
        if r.get("fits"):
            r["vs_one"] = r["tok_s"] * one  # over greedy on one device (a reference even where it does not fit)
    return rows


def mesh_table(gpu_key: str, model_key: str, overhead_ms: float, devices: int = 8, alpha: float = 0.425,
               f: float = 3.106) -> str:
    m = MODELS[model_key]
    rows = mesh_rows(gpu_key, model_key, overhead_ms, devices, alpha, f)
    best = max((r for r in rows if r.get("fits")), key=lambda r: r["tok_s"])
    lines = [
        f"**{devices} x {GPUS[gpu_key].name}**, {m.name} ({_count(m.params)} params, bf16), per-step overhead "
        f"{overhead_ms:g} ms: best **{best['split']}** ({best['tok_s']:.0f} tok/s)",
        "",
        "| split | W | N | G | S | rows/GPU | step ms | tok/s | vs 1-GPU greedy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("fits"):
            lines.append(f"| {r['split']} | – | – | – | – | – | – | does not fit | – |")
            continue
        w = (r.get("W", "–"), r.get("N", "–"), r.get("G", "–"))
        lines.append(f"| {r['split']} | {w[0]} | {w[1]} | {w[2]} | {r['S']:.2f} | {r['Q_dev']} | {r['t_ms']:.2f} "
                     f"| {r['tok_s']:.0f} | {r['vs_one']:.2f}x |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# CLI


def _measure_cmd(args) -> None:
    import torch

    from lp.model.loader import load_model, resolve_model_path

    torch.set_num_threads(args.threads)
    model, _ = load_model(resolve_model_path(args.model, args.model_path), args.dtype, args.device)
    t = measure_tq(model, args.qs, args.cache_len, args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"t_s": TQCurve(t).to_json(), "dtype": str(model.dtype).replace("torch.", ""), "device": args.device,
            "threads": torch.get_num_threads(), "cache_len": args.cache_len, "repeats": args.repeats}
    (out / "tq.json").write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scaling", description="LP scaling model")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="measure t(Q) and write OUT/tq.json")
    m.add_argument("--out", required=True)
    m.add_argument("--model", default="smollm2")
    m.add_argument("--model-path", default=None)
    m.add_argument("--dtype", default="float32")
    m.add_argument("--device", default="cpu")
    m.add_argument("--threads", type=int, default=1)
    m.add_argument("--qs", type=int, nargs="+", default=list(DEFAULT_QS))
    m.add_argument("--cache-len", type=int, default=200)
    m.add_argument("--repeats", type=int, default=7)
    c = sub.add_parser("check", help="predicted vs measured LP speedup from a results dir")
    c.add_argument("results")
    c.add_argument("--tq", default=None, help="tq.json (default: RESULTS/tq.json)")
    s = sub.add_parser("search", help="W/N/G maximizing the predicted speedup on P devices")
    s.add_argument("--tq", required=True)
    s.add_argument("--devices", type=int, default=2)
    s.add_argument("--fit", default=None, help="results dir to fit alpha, f from")
    s.add_argument("--alpha", type=float, default=0.425)
    s.add_argument("--f", type=float, default=3.106)
    s.add_argument("--t-exchange-ms", type=float, default=0.2)
    p = sub.add_parser("paper", help="on-paper prediction for an 8-GPU node (bench/SCALING.md)")
    p.add_argument("--params", type=float, nargs="+", default=[7e9, 135e6])
    p.add_argument("--alpha", type=float, default=0.425)
    p.add_argument("--f", type=float, default=3.106)
    h = sub.add_parser("mesh", help="on-paper best lp x tp split of one node (bench/SCALING.md)")
    h.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    h.add_argument("--devices", type=int, default=8)
    h.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(MODELS))
    h.add_argument("--overhead-ms", type=float, nargs="+", default=[0.0, 10.0])
    h.add_argument("--alpha", type=float, default=0.425)
    h.add_argument("--f", type=float, default=3.106)
    args = ap.parse_args(argv)

    if args.cmd == "measure":
        _measure_cmd(args)
    elif args.cmd == "check":
        tq_path = Path(args.tq) if args.tq else Path(args.results) / "tq.json"
        tq = TQCurve.load(tq_path)
        checks = write_check(Path(args.results), tq, threads=json.loads(tq_path.read_text()).get("threads"))
        print(check_markdown(checks, tq, fit_law(law_points(load_rows(Path(args.results))))))
    elif args.cmd == "search":
        tq = TQCurve.load(Path(args.tq))
        alpha, f = args.alpha, args.f
        if args.fit:
            fitted = fit_law(law_points(load_rows(Path(args.fit))))
            if fitted is None:
                print("not enough distinct (N, G) in the results to fit; using --alpha/--f", file=sys.stderr)
            else:
                alpha, f = fitted
        print(f"alpha={alpha:.3f} f={f:.3f} devices={args.devices} t_exchange={args.t_exchange_ms} ms")
        for r in search(tq, args.devices, alpha, f, args.t_exchange_ms * 1e-3):
            print(f"W={r['W']:3d} N={r['N']} G={r['G']:3d} S={r['S']:.2f} Q/dev={r['Q_dev']:4d} "
                  f"-> {r['speedup']:.2f}x")
    elif args.cmd == "paper":
        for params in args.params:
            for gpu in ("a100-40gb", "h100"):
                for overhead in (0.0, 10.0):
                    print(paper_table(gpu, params, args.alpha, args.f, overhead))
    elif args.cmd == "mesh":
        for model in args.models:
            for overhead in args.overhead_ms:
                print(mesh_table(args.gpu, model, overhead, args.devices, args.alpha, args.f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
