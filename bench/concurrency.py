"""Concurrent clients against real OpenAI-compatible servers: ``python -m bench.run +preset=concurrency``.

Contract: for every server in ``concurrency.servers`` (started here on a free localhost port,
stopped at the end) and every client count in ``concurrency.clients``, ``clients`` threads of
the real ``openai`` client send ``clients x requests_per_client`` (at least ``min_requests``)
greedy streaming chat requests of ``max_tokens`` tokens, prompts taken in turn from the
benchmark's chat prompts. Per point: aggregate completion tokens / wall second, time to first
token p50/p90 (queue wait included), completed requests and how many texts equal lp's offline
greedy decode of the same chat prompt. Writes ``concurrency.jsonl`` (one row per request),
``concurrency.json`` / ``concurrency.md`` (one row per server x clients, with the commands) and
``concurrency.png`` (tok/s and TTFT vs clients) into the output dir. Nothing leaves localhost.

Servers:
    lp              python -m lp.serve (continuous batching, server.max_batch as configured)
    lp_max_batch1   python -m lp.serve server.max_batch=1 (one sequence at a time)
    transformers_cb transformers serve --continuous-batching (transformers' paged-cache batching)
    transformers    transformers serve (one request at a time)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from bench.serve_load import ServerProcess, free_port, machine, pct

SERVERS = ("lp", "lp_max_batch1", "transformers_cb", "transformers")


def server_command(kind: str, port: int, model_path: Path, threads: int, lp_overrides: list[str]) -> list[str]:
    """The command line that starts one server of ``kind`` on ``port``."""
    if kind in ("lp", "lp_max_batch1"):
        extra = ["server.max_batch=1"] if kind == "lp_max_batch1" else []
        return [sys.executable, "-m", "lp.serve", f"server.port={port}", "model.dtype=float32",
                f"model.threads={threads}", "server.log_level=warning", "server.max_queue=256",
                *lp_overrides, *extra]
    exe = shutil.which("transformers")
    if exe is None:
        raise ValueError("concurrency.servers names a transformers server but the `transformers` CLI is not on PATH")
    cb = ["--continuous-batching"] if kind == "transformers_cb" else []
    return [exe, "serve", *cb, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
            "--device", "cpu", "--log-level", "warning", str(model_path)]


def start(kind: str, model_path: Path, threads: int, lp_overrides: list[str], log_path: Path) -> ServerProcess:
    port = free_port()
    cmd = server_command(kind, port, model_path, threads, lp_overrides)
    return ServerProcess(cmd=cmd, port=port, log_path=log_path, threads=threads)


def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    parts, usage, finish = [], None, None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices:
            c = ch.choices[0]
            if c.delta.content:
                if first is None:
                    first = time.perf_counter()
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    t1 = time.perf_counter()
    return {"prompt": prompt, "text": "".join(parts), "finish_reason": finish,
            "completion_tokens": usage.completion_tokens if usage else None,
            "ttft_s": round((first or t1) - t0, 4), "latency_s": round(t1 - t0, 4)}


def drive(url: str, model: str, prompts: list[str], requests: int, clients: int, max_tokens: int) -> tuple[list, float]:
    """``requests`` requests from ``clients`` concurrent threads; rows (errors recorded) and wall seconds."""
    import openai

    jobs = [prompts[i % len(prompts)] for i in range(requests)]
    lock = threading.Lock()
    rows: list[dict] = []

    def client_thread():
        client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("LP_API_KEY", "unused"),
                               max_retries=0, timeout=1800)
        while True:
            with lock:
                if not jobs:
                    return
                prompt = jobs.pop(0)
            try:
                row = one_request(client, model, prompt, max_tokens)
            except Exception as e:  # recorded, never hidden
                row = {"prompt": prompt, "error": f"{type(e).__name__}: {e}"}
            with lock:
                rows.append(row)

    t = time.perf_counter()
    threads = [threading.Thread(target=client_thread) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return rows, time.perf_counter() - t


def summarize(server: str, clients: int, rows: list[dict], wall: float, tokenize) -> dict:
    ok = [r for r in rows if "error" not in r]
    # transformers serve may leave usage out of a stream: count the text's tokens then
    tokens = sum(r["completion_tokens"] if r["completion_tokens"] is not None else len(tokenize(r["text"]))
                 for r in ok)
    ttft = [r["ttft_s"] for r in ok]
    return {
        "server": server, "clients": clients, "requests": len(rows), "completed": len(ok),
        "errors": [r["error"] for r in rows if "error" in r][:5],
        "equal_lp_greedy": sum(bool(r.get("equals_reference")) for r in ok),
        "wall_s": round(wall, 3), "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "ttft_p50_s": pct(ttft, 0.5) if ttft else None, "ttft_p90_s": pct(ttft, 0.9) if ttft else None,
    }


def run_concurrency(cfg, out: Path, model_path: Path) -> list[dict]:
    """Every server x client count of ``cfg.concurrency``; writes the results into ``out``."""
    from transformers import AutoTokenizer

    from bench.prompts import select
    from bench.serve_load import offline_references

    cc = cfg.concurrency
    data_dir = Path(cfg.prompts.data_dir)
    if not data_dir.is_absolute():
        data_dir = Path(__file__).resolve().parent.parent / data_dir
    prompts = [p.text for p in select(cfg.prompts, data_dir, sets=[cc.prompt_set])]
    tok = AutoTokenizer.from_pretrained(model_path)
    print(f"[concurrency] lp offline greedy references for {len(prompts)} prompts ...", file=sys.stderr, flush=True)
    refs = offline_references(prompts, cc.max_tokens, cfg.threads)
    points, request_rows = [], []
    before = machine()
    for server in cc.servers:
        log = out / f"server_{server}.log"
        srv = start(server, model_path, cfg.threads, list(cc.lp_overrides), log)
        model = "smollm2" if server.startswith("lp") else str(model_path)
        try:
            drive(srv.url, model, prompts[:1], 1, 1, 8)  # warm-up (first request pays lazy loading)
            for clients in cc.clients:
                n = max(cc.min_requests, clients * cc.requests_per_client)
                print(f"[concurrency] {server}: {clients} client(s), {n} requests", file=sys.stderr, flush=True)
                rows, wall = drive(srv.url, model, prompts, n, clients, cc.max_tokens)
                for r in rows:
                    if "error" not in r:
                        r["equals_reference"] = r["text"] == refs[r["prompt"]]["text"]
                    request_rows.append({"server": server, "clients": clients, **r})
                point = summarize(server, clients, rows, wall, lambda s: tok(s, add_special_tokens=False).input_ids)
                point["load_avg"] = [round(x, 2) for x in os.getloadavg()]
                points.append(point)
                print(f"[concurrency]   {point['tokens_per_s']} tok/s, TTFT p50 {point['ttft_p50_s']} s, "
                      f"{point['completed']}/{point['requests']} done", file=sys.stderr, flush=True)
        finally:
            rc = srv.stop()
        for p in points:
            if p["server"] == server:
                p["server_command"] = " ".join(srv.cmd)
                p["server_exit_code"] = rc
    summary = {"command": cfg_command(), "machine_before": before, "machine_after": machine(),
               "max_tokens": cc.max_tokens, "threads": cfg.threads, "points": points}
    with (out / "concurrency.jsonl").open("w") as f:
        for r in request_rows:
            f.write(json.dumps(r) + "\n")
    (out / "concurrency.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "concurrency.md").write_text(markdown(summary))
    if cfg.plots:
        plot(points, out / "concurrency.png")
    print(markdown(summary), flush=True)
    return points


def cfg_command() -> str:
    return "python -m bench.run " + " ".join(sys.argv[1:])


def markdown(s: dict) -> str:
    pts = s["points"]
    servers = list(dict.fromkeys(p["server"] for p in pts))
    clients = sorted({p["clients"] for p in pts})
    at = {(p["server"], p["clients"]): p for p in pts}
    lines = ["# Concurrent clients: aggregate tokens/s and time to first token", "",
             f"Command: `{s['command']}`  ",
             f"{s['max_tokens']} tokens per greedy streaming chat request, {s['threads']} torch threads per server, "
             f"machine {s['machine_before']['cpus']} cores, load average before {s['machine_before']['load_avg']}, "
             f"after {s['machine_after']['load_avg']}.", "",
             "| server | " + " | ".join(f"{c} client{'s' if c > 1 else ''}: tok/s (TTFT p50 / p90 s)" for c in clients)
             + " |", "|---|" + "---|" * len(clients)]
    for srv in servers:
        cells = []
        for c in clients:
            p = at.get((srv, c))
            cells.append("-" if p is None else f"{p['tokens_per_s']} ({p['ttft_p50_s']} / {p['ttft_p90_s']})"
                         + ("" if p["completed"] == p["requests"] else f" {p['completed']}/{p['requests']} done"))
        lines.append(f"| {srv} | " + " | ".join(cells) + " |")
    lines += ["", "| server | clients | requests | completed | equal lp greedy | tokens | wall s | load avg |",
              "|---|---|---|---|---|---|---|---|"]
    for p in pts:
        lines.append(f"| {p['server']} | {p['clients']} | {p['requests']} | {p['completed']} | {p['equal_lp_greedy']} | "
                     f"{p['completion_tokens']} | {p['wall_s']} | {p['load_avg']} |")
    lines += ["", "Servers:"]
    for srv in servers:
        cmd = next(p.get("server_command", "") for p in pts if p["server"] == srv)
        lines.append(f"- {srv}: `{cmd}`")
    errors = [e for p in pts for e in p["errors"]]
    lines += ["", f"Errors: {errors or 'none'}", ""]
    return "\n".join(lines)


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for srv in dict.fromkeys(p["server"] for p in points):
        pts = sorted((p for p in points if p["server"] == srv), key=lambda p: p["clients"])
        xs = [p["clients"] for p in pts]
        a.plot(xs, [p["tokens_per_s"] for p in pts], marker="o", label=srv)
        b.plot(xs, [p["ttft_p50_s"] for p in pts], marker="o", label=srv)
    for ax, title in ((a, "aggregate tokens/s"), (b, "time to first token p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    b.set_yscale("log")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

