"""Summaries and plots of a benchmark run: summary.md, fit.json and PNGs from the result rows.

Contract: pure functions over the rows ``bench.run`` writes to results.jsonl (and
can be re-run on a results dir: ``python -m bench.report bench/results/default``).
Speedups are ratios of throughput (total new tokens / total decode time over the
same prompts) against ``ar`` with the same threads per worker; "same cores" divides
by ``ar`` with workers x threads threads when that reference was run.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from bench.scaling import compression, fit_law, fit_rmse, law_points, load_rows

GROUP = ("method", "workers", "threads", "W", "N", "G", "tp_engine")


def _key(r: dict) -> tuple:
    return tuple(r[k] for k in GROUP)


def aggregate(rows: list[dict]) -> list[dict]:
    """One record per (method, workers, threads, W, N, G, set), plus set='all' per configuration."""
    ar = {(r["threads"], r["set"], r["prompt_index"]): r for r in rows if r["method"] == "ar"}
    pl = {(r["threads"], r["set"], r["prompt_index"]): r for r in rows if r["method"] == "prompt_lookup"}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_key(r) + (r["set"],)].append(r)
        groups[_key(r) + ("all",)].append(r)
    out = []
    for key, rs in groups.items():
        g = dict(zip(GROUP + ("set",), key))
        tokens = sum(r["new_tokens"] for r in rs)
        steps = sum(r["steps"] for r in rs)
        time_s = sum(r["decode_time_s"] for r in rs)
        g.update(
            prompts=len(rs),
            mean_S=sum(r["S"] for r in rs) / len(rs),
            S_total=tokens / steps if steps else 0.0,
            tokens=tokens,
            time_s=time_s,
            tok_s=tokens / time_s if time_s > 0 else 0.0,
            mismatches=sum(1 for r in rs if r["matches_ar"] is False),
            same_as=rs[0].get("same_as"),
            tp_sharded=rs[0].get("tp_sharded"),
            exchange_ms_per_step=_per_step_ms(rs, "exchange_time_s"),
            rows_per_rank=_rows_per_rank(rs),
        )
        g["speedup"] = _speedup(rs, ar, g["threads"], g["tok_s"])
        g["speedup_same_cores"] = _speedup(rs, ar, g["threads"] * g["workers"], g["tok_s"])
        g["vs_prompt_lookup"] = _speedup(rs, pl, g["threads"], g["tok_s"])
        row_vals = [(r["rows_per_step"], r["steps"]) for r in rs if r.get("rows_per_step") is not None]
        all_rows = sum(v * n for v, n in row_vals)
        g["rows_per_step"] = all_rows / sum(n for _, n in row_vals) if row_vals else None
        g["tokens_per_row"] = tokens / all_rows if row_vals and all_rows else None
        out.append(g)
    order = {"ar": 0, "prompt_lookup": 1, "lp_default": 2, "lp_torch_matmul": 3, "suffix": 4, "lp_window": 5,
             "lookahead": 6, "lp": 7, "lp_tp": 8, "tp": 9, "pp": 10}
    out.sort(key=lambda g: (g["set"] == "all", g["set"], order.get(g["method"], 9), g["workers"], g["threads"],
                            g["W"] or 0, g["G"] or 0))
    return out


def _speedup(rs, ar, threads, tok_s) -> float | None:
    base = [ar.get((threads, r["set"], r["prompt_index"])) for r in rs]
    if any(b is None for b in base):
        return None
    t = sum(b["decode_time_s"] for b in base)
    return tok_s / (sum(b["new_tokens"] for b in base) / t) if t > 0 else None


def _per_step_ms(rs, field) -> float | None:
    vals = [(r[field], r["steps"]) for r in rs if r.get(field) is not None]
    if not vals:
        return None
    return 1e3 * sum(v for v, _ in vals) / max(1, sum(s for _, s in vals))


def _rows_per_rank(rs) -> list[float] | None:
    vals = [(r["rows_per_rank_per_step"], r["steps"]) for r in rs if r.get("rows_per_rank_per_step")]
    if not vals:
        return None
    steps = sum(s for _, s in vals)
    return [round(sum(v[k] * s for v, s in vals) / steps, 1) for k in range(len(vals[0][0]))]


# ---------------------------------------------------------------------------
# markdown


def _f(x, fmt="{:.2f}", none="–") -> str:
    return none if x is None else fmt.format(x)


def _load_note(machine: dict) -> str:
    if "loadavg_start" not in machine:
        return ""
    start = machine["loadavg_start"]
    note = f"Load average (1 min) at start / end: {start} / {machine.get('loadavg_end')}"
    if start is not None and start > 0.5:  # before the benchmark started anything
        note += " — other processes were using the cores: timings are unreliable"
    return note + "."


def summary_markdown(groups: list[dict], rows: list[dict], machine: dict, errors: list[dict],
                     fit: tuple[float, float] | None, elapsed_s: float | None = None) -> str:
    lines = [
        "# Benchmark summary",
        "",
        f"{machine.get('cpu_model')} ({machine.get('usable_cores')} usable cores), torch {machine.get('torch')}, "
        f"transformers {machine.get('transformers')}, dtype {machine.get('dtype')}, "
        f"{machine.get('threads_per_worker')} thread(s) per worker. "
        + (f"Wall time {elapsed_s / 60:.1f} min. " if elapsed_s else "")
        + _load_note(machine),
        "",
        "Speedup = throughput (total new tokens / total decode time, prefill included) over `ar` with the same",
        "threads per worker on the same prompts; *same cores* divides by `ar` with workers x threads threads",
        "(when that reference was run). S = new tokens / forward steps. Mismatches: prompts whose greedy output",
        "differs from `ar`'s (token by token). Rows marked † reuse another method's runs (at 1 worker lp is",
        "lookahead, tp and pp are plain greedy decoding).",
        "",
        "| set | method | workers | threads | W | N | G | prompts | mean S | tokens | time s | tok/s | speedup "
        "| vs prompt lookup | rows/step | tokens/row | same cores | exchange ms/step | rows/rank/step | mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        method = g["method"] + (" †" if g["same_as"] else "")
        if g["tp_sharded"]:
            method += f" ({g['tp_engine']}, {g['tp_sharded']})"
        lines.append(
            f"| {g['set']} | {method} | {g['workers']} | {g['threads']} | {_f(g['W'], '{}')} | {_f(g['N'], '{}')} "
            f"| {_f(g['G'], '{}')} | {g['prompts']} | {g['mean_S']:.2f} | {g['tokens']} | {g['time_s']:.1f} "
            f"| {g['tok_s']:.1f} | {_f(g['speedup'], '{:.2f}x')} | {_f(g['vs_prompt_lookup'], '{:.2f}x')} "
            f"| {_f(g['rows_per_step'], '{:.1f}')} | {_f(g['tokens_per_row'], '{:.2f}')} "
            f"| {_f(g['speedup_same_cores'], '{:.2f}x')} "
            f"| {_f(g['exchange_ms_per_step'], '{:.2f}')} | {_f(g['rows_per_rank'], '{}')} | {g['mismatches']} |"
        )
    scaling = [g for g in groups if g["set"] == "all" and g["method"] in ("lp", "lp_tp", "tp", "pp")]
    if scaling:
        ks = sorted({g["workers"] for g in scaling})
        lines += ["", "## Strong scaling (all sets, speedup over ar at the same threads per worker)", "",
                  "| method | " + " | ".join(f"{k} worker{'s' if k > 1 else ''}" for k in ks) + " |",
                  "|---|" + "---|" * len(ks)]
        for m in ("lp", "lp_tp", "tp", "pp"):  # lp_tp: one row per mesh split (lp{A}xtp{B})
            engines = sorted({g["tp_engine"] or "" for g in scaling if g["method"] == m and g["workers"] > 1})
            for engine in engines or [""]:
                by_k = {g["workers"]: g for g in scaling
                        if g["method"] == m and (g["workers"] == 1 or (g["tp_engine"] or "") == engine)}
                if by_k:
                    label = f"{m} ({engine})" if engine else m
                    lines.append(f"| {label} | " + " | ".join(
                        _f(by_k[k]["speedup"], "{:.2f}x") if k in by_k else "–" for k in ks) + " |")
    if fit:
        rmse = fit_rmse(law_points(rows), fit)
        lines += ["", f"Paper's law fitted to the lookahead/lp runs (b = G, γ = N − 1): α = {fit[0]:.3f}, "
                      f"f = {fit[1]:.3f}, RMSE of S {rmse:.3f} (s_vs_w.png, fit.json; the paper: α = 0.425, "
                      "f = 3.106 for LLaMA-2-7B-chat on MT-Bench)."]
    bad = [r for r in rows if r["matches_ar"] is False]
    lines += ["", f"## Output check: {len(bad)} mismatching (method, prompt) pairs of {len(rows)}", ""]
    for r in bad:
        lines.append(f"- {r['method']} x{r['workers']} t{r['threads']} W={r['W']} G={r['G']} {r['set']}#"
                     f"{r['prompt_index']}: first differing token at {r['first_mismatch']}")
    if errors:
        lines += ["", "## Failed jobs", ""] + [f"- {e['job']}: {e['error']}" for e in errors]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# plots


def plot_speedup(groups: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({g["set"] for g in groups}, key=lambda s: (s == "all", s))
    if len(sets) == 2:  # one set: its "all" panel is the same
        sets = sets[:1]
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.6), squeeze=False)
    for ax, s in zip(axes[0], sets):
        gs = [g for g in groups if g["set"] == s]
        for m, style in (("lp", "o-"), ("lp_tp", "D"), ("tp", "s--"), ("pp", "^:")):
            engines = sorted({g["tp_engine"] or "" for g in gs if g["method"] == m and g["workers"] > 1}) or [""]
            for engine in engines:
                pts = sorted((g["workers"], g["speedup"]) for g in gs if g["method"] == m and g["speedup"] is not None
                             and (g["workers"] == 1 or (g["tp_engine"] or "") == engine))
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{m} ({engine})" if engine else m)
        for g in gs:  # single-process references on more threads, plotted at their core count
            single = g["method"] in ("ar", "lookahead", "prompt_lookup") and g["W"] in (None, _base_W(gs))
            if single and g["speedup"] is not None:
                cores = g["threads"] // max(1, min(x["threads"] for x in gs))
                marker = {"ar": "x", "lookahead": "*", "prompt_lookup": "d"}[g["method"]]
                ax.scatter([cores], [g["speedup"]], marker=marker, s=60,
                           label=f"{g['method']} t{g['threads']}", zorder=3)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(s)
        ax.set_xlabel("workers (cores)")
        ax.set_ylabel("speedup over ar (1 worker)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _base_W(gs: list[dict]) -> int | None:
    la = [g["W"] for g in gs if g["method"] == "lookahead" and g["workers"] == 1]
    lp1 = [g["W"] for g in gs if g["method"] == "lp" and g["workers"] == 1]
    return (lp1 or la or [None])[0]


def plot_s_vs_w(rows: list[dict], fit: tuple[float, float] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    acc: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        if r["method"] in ("lookahead", "lp") and r["W"] is not None and not r.get("same_as"):
            a = acc[(r["set"], r["method"], r["W"], r["N"], r["G"])]
            a[0] += r["new_tokens"]
            a[1] += r["steps"]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for (s, m) in sorted({(k[0], k[1]) for k in acc}):
        pts = sorted((k[2], v[0] / v[1]) for k, v in acc.items() if k[0] == s and k[1] == m and v[1])
        ax.plot(*zip(*pts), "o" if m == "lookahead" else "s", label=f"{s} ({m})", alpha=0.8)
    Ns = sorted({k[3] for k in acc})
    if fit and Ns:
        ws = np.linspace(1, max(k[2] for k in acc) * 1.1, 100)
        for N in Ns:
            ax.plot(ws, [compression(fit[0], fit[1], N - 1, w) for w in ws], "-", color="k", lw=1,
                    label=f"law α={fit[0]:.2f} f={fit[1]:.2f} N={N} (b=G=W)")
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel("W (= G)")
    ax.set_ylabel("S = tokens / step")
    ax.set_title("step compression vs window")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_accept_hist(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hists: dict[tuple, list[int]] = {}
    for r in rows:
        if r.get("accept_hist") and r["method"] in ("lookahead", "lp") and not r.get("same_as"):
            k = (r["method"], r["workers"], r["threads"], r["W"], r["N"], r["G"])
            h = hists.setdefault(k, [])
            h.extend([0] * (len(r["accept_hist"]) - len(h)))
            for i, c in enumerate(r["accept_hist"]):
                h[i] += c
    fig, ax = plt.subplots(figsize=(6, 4))
    keys = sorted(hists, key=str)
    width = 0.8 / max(1, len(keys))
    for j, k in enumerate(keys):
        h = hists[k]
        total = sum(h) or 1
        ax.bar([i + j * width for i in range(len(h))], [c / total for c in h], width,
               label=f"{k[0]} x{k[1]} t{k[2]} W={k[3]} N={k[4]} G={k[5]}")
    ax.set_xlabel("tokens published in a step")
    ax.set_ylabel("fraction of steps")
    ax.set_title("accepted length per step")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------


def write_all(rows: list[dict], out: Path, cfg, machine: dict, errors: list[dict], elapsed_s: float | None) -> None:
    groups = aggregate(rows)
    points = law_points(rows)
    fit = fit_law(points)
    (out / "fit.json").write_text(json.dumps(
        {"alpha": fit[0], "f": fit[1], "rmse_S": fit_rmse(points, fit), "b": "G", "gamma": "N-1",
         "points_gamma_b_S": points} if fit else
        {"alpha": None, "f": None, "note": "fewer than 2 distinct (N, G) among lookahead/lp runs",
         "points_gamma_b_S": points}, indent=2) + "\n")
    (out / "summary.md").write_text(summary_markdown(groups, rows, machine, errors, fit, elapsed_s))
    if cfg is None or cfg.plots:
        plot_speedup(groups, out / "speedup_vs_workers.png")
        plot_s_vs_w(rows, fit, out / "s_vs_w.png")
        plot_accept_hist(rows, out / "accept_hist.png")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bench.report RESULTS_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    machine = json.loads((out / "machine.json").read_text()) if (out / "machine.json").exists() else {}
    errors = json.loads((out / "errors.json").read_text()) if (out / "errors.json").exists() else []
    write_all(load_rows(out), out, None, machine, errors, None)
    print(f"wrote {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
