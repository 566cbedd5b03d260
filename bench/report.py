"""Summaries and plots of a benchmark run: summary.md, fit.json and PNGs from the result rows;
and docs/benchmarks.md's results tables from bench/results.

Contract: pure functions over the rows ``bench.run`` writes to results.jsonl (and
can be re-run on a results dir: ``python -m bench.report bench/results/default``).
Speedups are ratios of throughput (total new tokens / total decode time over the
same prompts) against ``ar`` with the same threads per worker; "same cores" divides
by ``ar`` with workers x threads threads when that reference was run.

``python -m bench.report --doc [DOC] [--results DIR]`` replaces what lies between the
lines ``<!-- results:begin -->`` and ``<!-- results:end -->`` of DOC (default: the
repository's docs/benchmarks.md, which README.md links) with tables of lp's servers against the peers (vLLM, transformers,
llama.cpp: every ``DIR/*/concurrency.json`` and ``DIR/*/*/concurrency.json`` that has lp and a
peer), each point the median over its repeats, with the command (from the JSON) and the commit
and machine (the JSON's ``commit``, else the folder's ``run.json`` or its parent's) that produced
it; a peer whose texts the JSON marks not compared (llama.cpp) is left out of the count of equal
texts, with the reason. DOC without exactly one pair of markers in that order: ``ValueError``
naming them; nothing is written.
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


# ---------------------------------------------------------------------------
# docs/benchmarks.md's results tables (python -m bench.report --doc)

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
PEERS = {"vllm": "vLLM", "transformers": "transformers", "llama": "llama.cpp"}  # server-name prefix -> peer
LABELS = {"lp": "lp", "lp_exact4": "lp exact4", "lp_compiled": "lp fp32", "lp_max_batch1": "lp max_batch=1",
          "lp_ar": "lp ar steps", "lp_plain": "lp plain linears", "lp_nocal": "lp no calibration", "vllm": "vLLM",
          "vllm_ngram": "vLLM n-gram", "transformers_cb": "transformers CB", "transformers": "transformers",
          "llamacpp": "llama.cpp", "llamacpp_ngram": "llama.cpp n-gram"}


NO_RATIO = {"lp_max_batch1"}  # a deliberately handicapped lp (one request at a time): no ratio column


def peer_of(server: str) -> str | None:
    """'lp' for lp's own servers, the peer's name for another engine's, None if unknown."""
    if server == "lp" or server.startswith("lp_"):
        return "lp"
    for prefix, name in PEERS.items():
        if server.startswith(prefix):
            return name
    return None


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _shell_command(command: str) -> str:
    """The JSON's command as one copyable line: ``lp bench`` for bench.run, no machine-local (absolute)
    out_dir (a relative one, e.g. into a subfolder of bench/results, stays), vLLM's venv as <venv>,
    brackets quoted."""
    import shlex

    out = []
    for tok in command.split():
        if tok.startswith("out_dir=") and Path(tok.partition("=")[2]).is_absolute():
            continue
        if tok.startswith("concurrency.vllm_venv="):
            tok = "concurrency.vllm_venv=<venv>"
        out.append(tok if tok.startswith("concurrency.vllm_venv=") else shlex.quote(tok))
    line = " ".join(out)
    return line.replace("python -m bench.run ", "lp bench ", 1)


def _server_line(command: str | None) -> str | None:
    """A server's start command as a reader would type it: no interpreter path, port, host or log
    settings; the model folder as <model>."""
    if not command:
        return None
    toks = command.split()
    out: list[str] = []
    skip_next = False
    for i, tok in enumerate(toks):
        if skip_next:
            skip_next = False
            continue
        if i == 0:
            name = Path(tok).name
            out.append("lp" if name.startswith("python") else name)
            continue
        if tok == "-m" and i == 1 and out == ["lp"]:  # python -m lp.serve (llama-server's -m is its model)
            continue
        if tok == "lp.serve" and i == 2:
            out.append("serve")
            continue
        if tok.split("=")[0] in ("server.port", "server.log_level", "server.max_queue"):
            continue
        if tok in ("--port", "--host", "--log-level", "--uvicorn-log-level"):
            skip_next = True
            continue
        out.append("<model>" if tok.startswith("/") else tok)
    return " ".join(out)


def peer_runs(results: Path) -> list[dict]:
    """Every ``results/*/concurrency.json`` and ``results/*/*/concurrency.json`` (a comparison kept
    inside its benchmark's folder, e.g. ``llamacpp/vs_lp``) with lp and at least one peer:
    {folder (relative to ``results``), command, commit, machine, points, ...}. The commit and machine
    come from the JSON, else the folder's ``run.json``, else its parent folder's."""
    runs = []
    paths = sorted(results.glob("*/concurrency.json")) + sorted(results.glob("*/*/concurrency.json"))
    for path in paths:
        summary = json.loads(path.read_text())
        servers = {p["server"] for p in summary["points"]}
        kinds = {peer_of(s) for s in servers}
        if "lp" not in kinds or not kinds - {"lp", None}:
            continue
        meta = {}
        for folder in (path.parent, path.parent.parent):
            if folder != results and (folder / "run.json").is_file():
                meta = json.loads((folder / "run.json").read_text())
                break
        commit = summary.get("commit") or meta.get("commit")
        if not commit:
            raise ValueError(f"{path.parent}: no commit (neither concurrency.json's 'commit' nor run.json's)")
        machine = meta.get("machine") or summary.get("machine_before", {}).get("platform", "unknown machine")
        runs.append({"folder": path.parent.relative_to(results).as_posix(), "command": summary["command"],
                     "commit": commit, "machine": machine, "points": summary["points"],
                     "max_tokens": summary.get("max_tokens"), "threads": summary.get("threads"),
                     "texts_not_compared": summary.get("texts_not_compared") or {}})
    return runs


def _groups(runs: list[dict]) -> list[list[dict]]:
    """Runs of the same servers on the same model at the same commit and machine form one table (e.g. 1/8
    clients and a sweep); the model is the command's ``model_path=`` / ``model=`` (none: the default)."""
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        model = next((t for t in r["command"].split() if t.startswith(("model_path=", "model="))), "")
        key = (r["commit"], r["machine"], model, tuple(sorted({p["server"] for p in r["points"]})))
        out.setdefault(key, []).append(r)
    return list(out.values())


def peer_table(group: list[dict]) -> str:
    """One markdown table: a row per (workload, clients), a column per server (median tok/s over the
    repeats), then each lp server over the fastest server of each peer engine in the run; the
    sources' commit, machine and commands."""
    cells: dict[tuple, list[float]] = {}
    ttft: dict[tuple, list[float]] = {}
    servers: list[str] = []
    equal = requests = 0
    for run in group:
        for p in run["points"]:
            key = (p["server"], p.get("workload", "chat"), p["clients"])
            if p["tokens_per_s"] is not None:
                cells.setdefault(key, []).append(p["tokens_per_s"])
            if p.get("ttft_p50_s") is not None:
                ttft.setdefault(key, []).append(p["ttft_p50_s"])
            if p["server"] not in servers:
                servers.append(p["server"])
            if p.get("texts_compared", True):  # llama.cpp's texts differ by design (Q8_1 activations)
                equal += p["equal_lp_greedy"]
                requests += p["requests"]
    med = {k: _median(v) for k, v in cells.items()}
    commands: dict[str, str] = {}
    for run in group:
        for p in run["points"]:
            commands.setdefault(p["server"], _server_line(p.get("server_command")))
    lp_servers = [s for s in servers if peer_of(s) == "lp"]
    ratio_servers = [s for s in lp_servers if s not in NO_RATIO]
    peer_servers = [s for s in servers if peer_of(s) not in ("lp", None)]
    total = lambda s: sum(v for (srv, _, _), v in med.items() if srv == s)  # noqa: E731
    # each lp server over the fastest server of every peer engine in the run (vLLM, llama.cpp, ...)
    best_peers = [max((s for s in peer_servers if peer_of(s) == kind), key=total)
                  for kind in dict.fromkeys(peer_of(s) for s in peer_servers)]
    rows = sorted({(w, c) for (_, w, c) in med})
    label = lambda s: LABELS.get(s, s)  # noqa: E731
    head = ["workload", "clients"] + [label(s) for s in lp_servers + peer_servers] + \
           [f"{label(s)} / {label(b)}" for s in ratio_servers for b in best_peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w, c in rows:
        vals = [med.get((s, w, c)) for s in lp_servers + peer_servers]
        ratios = []
        for s in ratio_servers:
            for best in best_peers:
                a, b = med.get((s, w, c)), med.get((best, w, c))
                ratios.append(f"{a / b:.2f}x" if a is not None and b else "–")
        lines.append("| " + " | ".join([w, str(c)] + [f"{v:.1f}" if v is not None else "–" for v in vals] + ratios)
                     + " |")
    clients = sorted({c for _, c in rows})
    at = 8 if 8 in clients else clients[-1]
    t_notes = []
    for s in lp_servers + peer_servers:
        ts = [_median(v) for (srv, _, c), v in ttft.items() if srv == s and c == at]
        if ts:
            t_notes.append(f"{label(s)} {min(ts):.2f}-{max(ts):.2f} s" if len(ts) > 1 else f"{label(s)} {ts[0]:.2f} s")
    first = group[0]
    why = {srv: reason for run in group for srv, reason in run["texts_not_compared"].items()}
    not_compared = "".join(f" {label(srv)}'s texts are not compared ({reason})." for srv, reason in why.items())
    notes = [
        "",
        f"Aggregate tokens/s (median over each point's repeats), greedy streaming {first['max_tokens']}-token "
        f"requests from concurrent `openai` clients, {first['threads']} threads per server; "
        f"{equal} of {requests} texts equal lp's offline greedy decode.{not_compared} Time to first token p50 at {at} "
        f"clients: {', '.join(t_notes)}. lp at commit {first['commit']}; machine: {first['machine']}. "
        "Servers: " + "; ".join(f"{label(srv)} `{commands[srv]}`" for srv in lp_servers + peer_servers
                                if commands.get(srv)) + ".",
        "",
        "Produced by:",
        "",
    ]
    for run in group:
        notes.append(f"    {_shell_command(run['command'])}    # bench/results/{run['folder']}")
    return "\n".join(lines + notes)


def results_block(results: Path) -> str:
    """What goes between the doc's markers: one table per comparison, from ``results``."""
    runs = peer_runs(results)
    if not runs:
        raise ValueError(f"no */concurrency.json with lp and a peer server under {results}")
    groups = _groups(runs)
    # the most recent comparison (vs vLLM) first: tables ordered by peers, vLLM, transformers, llama.cpp
    order = {name: i for i, name in enumerate(PEERS.values())}
    groups.sort(key=lambda g: min(order.get(peer_of(p["server"]), 9) for r in g for p in r["points"]
                                  if peer_of(p["server"]) not in ("lp", None)))
    found = {peer_of(p["server"]) for g in groups for r in g for p in r["points"]}
    parts = ["<!-- generated by `python -m bench.report --doc` from bench/results: edit those, not this -->"]
    for g in groups:
        peers = sorted({peer_of(p["server"]) for r in g for p in r["points"]} - {"lp", None})
        parts += ["", f"**lp vs {', '.join(peers)}** (bench/results/{', bench/results/'.join(r['folder'] for r in g)}):",
                  "", peer_table(g)]
    for prefix, name in PEERS.items():
        if name in found:
            continue
        alone = sorted(d.name for d in results.iterdir() if d.is_dir() and d.name.startswith(prefix))
        where = f" ({name} alone, no lp side by side: bench/results/{', bench/results/'.join(alone)})" if alone else ""
        parts += ["", f"No run of lp against {name} is recorded in bench/results{where}."]
    return "\n".join(parts)


def replace_between_markers(text: str, block: str) -> str:
    """``text`` with the lines strictly between the begin and end marker lines replaced by ``block``."""
    lines = text.split("\n")
    begins = [i for i, ln in enumerate(lines) if ln.strip() == BEGIN]
    ends = [i for i, ln in enumerate(lines) if ln.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise ValueError(f"the doc must contain the line {BEGIN} once, followed later by the line {END} once "
                         f"(found {len(begins)} begin and {len(ends)} end marker lines"
                         + (", end before begin" if begins and ends and begins[0] > ends[0] else "") + ")")
    return "\n".join(lines[:begins[0] + 1] + block.split("\n") + lines[ends[0]:])


def update_doc(doc: Path, results: Path) -> bool:
    """Rewrite ``doc``'s results block from ``results``; True if the file changed."""
    text = doc.read_text()
    new = replace_between_markers(text, results_block(results))
    if new != text:
        doc.write_text(new)
    return new != text


def _parser():
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m bench.report",
        description="RESULTS_DIR: rewrite summary.md, fit.json and the plots of a bench.run results folder "
                    "from its results.jsonl. --doc: regenerate docs/benchmarks.md's results block (between "
                    f"{BEGIN} and {END}) from bench/results' */concurrency.json and */*/concurrency.json.")
    ap.add_argument("results_dir", nargs="?", metavar="RESULTS_DIR",
                    help="a folder bench.run wrote (results.jsonl; machine.json and errors.json if present)")
    ap.add_argument("--doc", nargs="?", const=str(ROOT / "docs" / "benchmarks.md"), metavar="DOC",
                    help="rewrite DOC's results block (default DOC: the repository's docs/benchmarks.md)")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"), metavar="DIR",
                    help="with --doc: the results tree to read (default: bench/results)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = _parser()
    a = ap.parse_args(argv)
    if a.doc is not None:
        if a.results_dir is not None:
            ap.error(f"RESULTS_DIR ({a.results_dir}) and --doc are two uses: give one (DOC goes right "
                     "after --doc)")
        try:
            changed = update_doc(Path(a.doc), Path(a.results))
        except ValueError as e:
            print(f"error: {a.doc}: {e}", file=sys.stderr)
            return 2
        print(f"{'updated' if changed else 'unchanged'}: {a.doc}")
        return 0
    if a.results_dir is None:
        ap.error("give RESULTS_DIR or --doc [DOC]")
    if "--results" in argv or any(x.startswith("--results=") for x in argv):
        ap.error("--results goes with --doc (RESULTS_DIR is the folder to summarize)")
    out = Path(a.results_dir)
    if not (out / "results.jsonl").is_file():
        ap.error(f"RESULTS_DIR {out}: no results.jsonl there (a folder bench.run wrote)")
    machine = json.loads((out / "machine.json").read_text()) if (out / "machine.json").exists() else {}
    errors = json.loads((out / "errors.json").read_text()) if (out / "errors.json").exists() else []
    write_all(load_rows(out), out, None, machine, errors, None)
    print(f"wrote {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
