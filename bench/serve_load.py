"""Bounded load test of ``lp.serve`` on localhost: ``python -m bench.serve_load [options]``.

Contract: starts one server (one process, or ``--workers K`` LP workers under torchrun) on a
free localhost port, sends ``--requests`` greedy streaming chat requests from
``--concurrency`` concurrent ``openai`` clients, and checks that every request completes
and that every text equals the offline greedy decode (``LookaheadDecoder`` in this
process, as ``lp.generate`` runs it) of the same chat-templated prompt. Records per
request the client-side time to first token, tokens/s and the server's lookahead stats;
writes ``<out>/load_<tag>.json`` and ``.md`` with the command used, the machine and its
load average. Nothing leaves localhost; the server is killed at the end.

    python -m bench.serve_load                       # 40 requests, 8 clients, 64 tokens, 1 process
    python -m bench.serve_load --workers 2           # the same behind 2 LP workers (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "List three uses of a hash map, one line each.",
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that reverses a string.",
    "Explain what a KV cache is in two sentences.",
    "Give me a haiku about the sea.",
    "What is 17 times 23? Show the steps.",
    "Name four planets of the solar system.",
    "How do I read a file line by line in Python?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What are the benefits of unit testing?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m lp.serve`` (or torchrun with K workers) in its own session, logs to a file;
    ``cmd`` (with its ``port``) starts any other OpenAI-compatible server the same way, ``env`` added
    to its environment; it must answer ``/health`` within ``start_timeout_s``."""

    def __init__(self, workers: int = 1, threads: int = 2, overrides: list[str] = (), log_path: Path | None = None,
                 port: int | None = None, cmd: list[str] | None = None, env: dict[str, str] | None = None,
                 start_timeout_s: float = 600.0):
        import httpx

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [f"server.port={self.port}", "model.dtype=float32", "server.log_level=warning", *overrides]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), **(env or {}))
        if cmd is None and workers == 1:
            cmd = [sys.executable, "-m", "lp.serve", f"model.threads={threads}", *args]
        elif cmd is None:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
                   "-m", "lp.serve", f"parallel.workers={workers}", f"model.threads={threads}", *args]
        self.cmd = cmd
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t > start_timeout_s:
                self.stop()
                raise RuntimeError(f"server not healthy after {start_timeout_s:g} s; see {log_path}")
            time.sleep(0.5)

    def memory(self) -> dict | None:
        """The server's resident memory now and at its peak (Linux /proc: VmRSS and VmHWM summed over
        the processes of its session: lp.serve's one, torchrun's workers), MiB; None where /proc is missing."""
        now = peak = 0
        found = False
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[3]) != self.proc.pid:  # its session's group
                    continue
                fields = dict(line.split(":", 1) for line in (d / "status").read_text().splitlines() if ":" in line)
                now += int(fields["VmRSS"].split()[0])
                peak += int(fields["VmHWM"].split()[0])
                found = True
            except (OSError, ValueError, KeyError, IndexError):
                continue
        return {"rss_mib": now // 1024, "rss_peak_mib": peak // 1024} if found else None

    def stop(self) -> int | None:
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(wait)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        self.log.close()
        return self.proc.returncode


def machine() -> dict:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}


def offline_references(prompts: list[str], max_tokens: int, threads: int, raw: bool = False,
                       model_path=None) -> dict:
    """Greedy outputs as ``python -m lp.generate`` computes them (same prompt ids, eos, default W/N/G);
    ``raw``: the prompts tokenized as they are (a /v1/completions prompt), else in the chat template;
    ``model_path``: the model (a folder or a GGUF file; None: the default SmolLM2)."""
    import torch

    from lp.config import DecodingConfig, GenerateConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.generate import build_prompt_ids, eos_ids
    from lp.model.runner import ModelRunner
    from lp.model.loader import load_model, resolve_model_path

    torch.set_num_threads(threads)
    model, tok = load_model(model_path or resolve_model_path("smollm2", None), "float32")
    runner, eos = ModelRunner(model), eos_ids(model, tok)
    refs = {}
    for p in prompts:
        ids = build_prompt_ids(tok, GenerateConfig(prompt=p, raw_prompt=raw))
        res = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=max_tokens)).generate(ids, eos)
        refs[p] = {"prompt_ids": ids, "output_ids": res.output_ids,
                   "text": tok.decode(res.output_ids, skip_special_tokens=True)}
    return refs


def one_request(client, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    parts, finish, usage, la = [], None, None, None
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
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
                la = (ch.model_extra or {}).get("lookahead")
    t1 = time.perf_counter()
    n = usage.completion_tokens if usage else 0
    return {"prompt": prompt, "text": "".join(parts), "finish_reason": finish, "completion_tokens": n,
            "ttft_s": round((first or t1) - t0, 4), "latency_s": round(t1 - t0, 4),
            "stream_tokens_per_s": round(n / (t1 - first), 3) if first and t1 > first else None,
            "server": la}


def run_load(url: str, prompts: list[str], requests: int, concurrency: int, max_tokens: int) -> tuple[list, float]:
    import openai

    jobs = [prompts[i % len(prompts)] for i in range(requests)]
    lock = threading.Lock()
    rows: list[dict] = []
    errors: list[str] = []

    def client_thread():
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
        while True:
            with lock:
                if not jobs:
                    return
                prompt = jobs.pop(0)
            try:
                row = one_request(client, prompt, max_tokens)
            except Exception as e:  # recorded, never hidden
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                rows.append(row)

    t = time.perf_counter()
    threads = [threading.Thread(target=client_thread) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    if errors:
        rows.append({"errors": errors})
    return rows, wall


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))], 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: 2 / workers)")
    ap.add_argument("--out", default="bench/results/serve")
    ap.add_argument("overrides", nargs="*", help="extra lp.serve Hydra overrides")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: never leak the server
    if a.requests > 200 or a.concurrency > 32:
        raise SystemExit("bounded load test: at most 200 requests and 32 clients")
    threads = a.threads or max(1, 2 // a.workers)
    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    tag = f"w{a.workers}"
    command = "python -m bench.serve_load " + " ".join(argv if argv is not None else sys.argv[1:])
    before = machine()
    print(f"[serve_load] offline references for {len(PROMPTS)} prompts ...", flush=True)
    refs = offline_references(PROMPTS, a.max_tokens, 2)
    print(f"[serve_load] server: {a.workers} worker(s), {threads} thread(s) each", flush=True)
    srv = ServerProcess(a.workers, threads, [f"server.max_queue={a.requests}", *a.overrides], out / f"load_{tag}.log")
    try:
        rows, wall = run_load(srv.url, PROMPTS, a.requests, a.concurrency, a.max_tokens)
        import httpx

        metrics_text = httpx.get(srv.url + "/metrics", timeout=10).text
        healthy = httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        rc = srv.stop()
    ok_rows = [r for r in rows if "errors" not in r]
    errors = [e for r in rows if "errors" in r for e in r["errors"]]
    for r in ok_rows:
        r["equals_offline"] = r["text"] == refs[r["prompt"]]["text"]
    tokens = sum(r["completion_tokens"] for r in ok_rows)
    ttft = [r["ttft_s"] for r in ok_rows]
    tps = [r["stream_tokens_per_s"] for r in ok_rows if r["stream_tokens_per_s"]]
    dec_tps = [r["server"]["tokens_per_second"] for r in ok_rows if r["server"]]
    summary = {
        "command": command,
        "server_command": " ".join(srv.cmd),
        "requests": a.requests, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
        "workers": a.workers, "threads_per_worker": threads,
        "completed": len(ok_rows), "errors": errors,
        "all_equal_offline": bool(ok_rows) and all(r["equals_offline"] for r in ok_rows),
        "equal_offline": sum(r["equals_offline"] for r in ok_rows),
        "healthy_after": healthy, "server_exit_code": rc,
        "wall_s": round(wall, 3), "completion_tokens": tokens,
        "throughput_tokens_per_s": round(tokens / wall, 3),
        "ttft_s": {"p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9), "max": max(ttft), "min": min(ttft)} if ttft else None,
        "stream_tokens_per_s": {"p50": pct(tps, 0.5), "min": min(tps), "max": max(tps)} if tps else None,
        "server_decode_tokens_per_s": {"p50": pct(dec_tps, 0.5), "mean": round(statistics.mean(dec_tps), 3)}
        if dec_tps else None,
        "machine_before": before, "machine_after": machine(),
        "metrics_excerpt": [ln for ln in metrics_text.splitlines() if ln.startswith(("lp_requests_total",
                            "lp_completion_tokens_total", "lp_decode_steps_total", "lp_queue_depth"))],
        "rows": ok_rows,
    }
    (out / f"load_{tag}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / f"load_{tag}.md").write_text(markdown(summary))
    print(markdown(summary), flush=True)
    return 0 if summary["completed"] == a.requests and summary["all_equal_offline"] else 1


def markdown(s: dict) -> str:
    busy = max(s["machine_before"]["load_avg"][0], s["machine_after"]["load_avg"][0])
    note = ""
    if busy > 0.5 * (s["machine_before"]["cpus"] or 1):
        note = (f"\n**Note:** the machine was busy with other work (1-min load average up to {busy:.2f} on "
                f"{s['machine_before']['cpus']} cores); absolute times are inflated and noisy.\n")
    lines = [
        f"# lp.serve load test ({s['workers']} worker(s))", "",
        f"Command: `{s['command']}`  ", f"Server: `{s['server_command']}`", note,
        "| requests | clients | max tokens | completed | equal offline greedy | wall s | tokens | tokens/s (all) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {s['requests']} | {s['concurrency']} | {s['max_tokens']} | {s['completed']} | {s['equal_offline']}/"
        f"{s['completed']} | {s['wall_s']} | {s['completion_tokens']} | {s['throughput_tokens_per_s']} |", "",
        "| time to first token (client, queue wait included) | p50 | p90 | min | max |", "|---|---|---|---|---|",
    ]
    if s["ttft_s"]:
        t = s["ttft_s"]
        lines.append(f"| seconds | {t['p50']} | {t['p90']} | {t['min']} | {t['max']} |")
    if s["stream_tokens_per_s"]:
        t = s["stream_tokens_per_s"]
        lines += ["", f"Per-request streaming speed (tokens / (end - first token)): p50 {t['p50']}, "
                      f"min {t['min']}, max {t['max']} tokens/s; server-side decode p50 "
                      f"{s['server_decode_tokens_per_s']['p50']} tokens/s."]
    lines += ["", f"Errors: {s['errors'] or 'none'}; healthy after the run: {s['healthy_after']}; "
                  f"server exit code after SIGTERM: {s['server_exit_code']}.",
              f"Machine: {s['machine_before']['cpus']} cores, load average before {s['machine_before']['load_avg']}, "
              f"after {s['machine_after']['load_avg']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
