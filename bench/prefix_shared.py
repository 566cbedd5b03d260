"""Many clients sharing one system prompt, with and without the prefix cache:
``python -m bench.prefix_shared [options]``.

Contract: starts two one-process ``lp.serve`` servers on localhost, ``warm``
(``server.prefix_cache=true``) and ``cold`` (``false``), and sends ``--waves`` waves of
``--clients`` concurrent chat requests through the real ``openai`` client (streaming, greedy,
``--max-tokens`` each). Every request of every wave starts with the same ~``--system-tokens``
system prompt (an agent's instructions and tool list), then its own customer line and question.
A warm-up wave over another system prompt is not recorded. A wave goes to one server, then the
other (which one first alternates by wave), so the two never compete for the cores. Per
server and wave: TTFT p50 / p90 (request sent to the first chunk with content, client side),
aggregate tok/s (completion tokens / the wave's wall time), hit rate (cached prompt tokens /
prompt tokens, from ``usage.prompt_tokens_details``), the most K/V blocks in use during the wave
and the prefix cache's registered blocks after it (/metrics, polled). Checks every warm reply
equals the cold server's; writes ``<out>/prefix_shared.json`` and ``.md`` with the command, the
machine and its load.

In the first recorded wave the clients arrive together: the requests admitted in the same
step as the first one cannot hit it (its blocks register once computed), later ones do.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time

from bench.prefix_ttft import QUESTIONS, system_prompt
from bench.serve_load import ROOT, ServerProcess, machine

NAMES = ["Ada", "Ben", "Chloe", "Dev", "Ema", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia",
         "Oto", "Pia"]


def _metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--out", default="bench/results/prefix/shared")
    a = ap.parse_args(argv)
    for name in ("clients", "waves", "system_tokens", "max_tokens", "threads", "max_batch"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: never leak the servers
    import openai

    from lp.model.loader import load_tokenizer, resolve_model_path

    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.prefix_shared " + " ".join(argv if argv is not None else sys.argv[1:])
    tok = load_tokenizer(resolve_model_path("smollm2", None))
    before = machine()
    common = ["server.kv_tokens=32768", "server.max_tokens=4096", f"server.max_batch={a.max_batch}",
              f"server.max_queue={max(64, a.clients)}"]
    servers = {}
    try:
        for name, on in (("warm", "true"), ("cold", "false")):
            servers[name] = ServerProcess(1, a.threads, [*common, f"server.prefix_cache={on}"],
                                          out / f"{name}_server.log")
        clients = {k: openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=1800)
                   for k, s in servers.items()}

        def ask(name, messages, into, i):
            t = time.perf_counter()
            ttft, text, use = None, [], None
            stream = clients[name].chat.completions.create(
                model="smollm2", messages=messages, max_tokens=a.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
            for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t
                    text.append(ch.choices[0].delta.content)
                if ch.usage is not None:
                    use = ch.usage
            details = use.prompt_tokens_details
            into[i] = {"ttft_s": ttft, "text": "".join(text), "prompt_tokens": use.prompt_tokens,
                       "cached_tokens": details.cached_tokens if details is not None else 0,
                       "completion_tokens": use.completion_tokens}

        def wave(name, system):
            """All clients at once on one server; -> (per-client answers, wall s, peak blocks in use)."""
            answers, peak, done = [None] * a.clients, [0.0], threading.Event()

            def poll():
                while not done.is_set():
                    peak[0] = max(peak[0], _metrics(servers[name].url).get("lp_kv_blocks_in_use", 0))
                    done.wait(0.2)

            msgs = [[{"role": "system", "content": system},
                     {"role": "user", "content": f"Customer {NAMES[i % len(NAMES)]}: {QUESTIONS[i % len(QUESTIONS)]}"}]
                    for i in range(a.clients)]
            threads = [threading.Thread(target=ask, args=(name, m, answers, i)) for i, m in enumerate(msgs)]
            poller = threading.Thread(target=poll)
            t = time.perf_counter()
            poller.start()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            wall = time.perf_counter() - t
            done.set()
            poller.join()
            if any(x is None for x in answers):
                raise RuntimeError(f"{name}: a client got no answer; see {out}/{name}_server.log")
            cached_blocks = _metrics(servers[name].url).get("lp_prefix_cache_blocks", 0)
            return answers, wall, peak[0], cached_blocks

        shared = system_prompt(0, tok, a.system_tokens)
        rows = []
        for w in range(-1, a.waves):  # wave -1: warm-up over another system prompt, not recorded
            system = system_prompt(-1, tok, a.system_tokens) if w < 0 else shared
            order = ("warm", "cold") if w % 2 == 0 else ("cold", "warm")
            got = {name: wave(name, system) for name in order}
            same = [x["text"] == y["text"] for x, y in zip(got["warm"][0], got["cold"][0])]
            for name in ("warm", "cold"):
                answers, wall, peak, cached_blocks = got[name]
                ttfts = [x["ttft_s"] for x in answers if x["ttft_s"] is not None]
                completion = sum(x["completion_tokens"] for x in answers)
                row = {"wave": w, "server": name, "first": order[0], "clients": a.clients,
                       "prompt_tokens": sum(x["prompt_tokens"] for x in answers),
                       "cached_tokens": sum(x["cached_tokens"] for x in answers),
                       "ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_p90_s": round(_pct(ttfts, 0.9), 4),
                       "wall_s": round(wall, 3), "tok_per_s": round(completion / wall, 2),
                       "completion_tokens": completion, "peak_blocks_in_use": peak,
                       "cached_blocks_after": cached_blocks, "all_same_text": all(same)}
                row["hit_rate"] = round(row["cached_tokens"] / row["prompt_tokens"], 4)
                if w >= 0:
                    rows.append(row)
                print(f"[prefix_shared] {row}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    summary = summarize(rows, a)
    summary.update(command=command, server_commands={k: " ".join(s.cmd) for k, s in servers.items()},
                   machine_before=before, machine_after=machine(), rows=rows)
    (out / "prefix_shared.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = markdown(summary)
    (out / "prefix_shared.md").write_text(md)
    print(md)
    return 0


def summarize(rows: list[dict], a) -> dict:
    def of(name, key):
        return [r[key] for r in rows if r["server"] == name]

    s = {"clients": a.clients, "waves": a.waves, "system_tokens": a.system_tokens, "max_tokens": a.max_tokens,
         "threads": a.threads, "max_batch": a.max_batch, "all_same_text": all(r["all_same_text"] for r in rows)}
    for name in ("warm", "cold"):
        s[name] = {"ttft_p50_s_median_over_waves": round(statistics.median(of(name, "ttft_p50_s")), 4),
                   "ttft_p90_s_median_over_waves": round(statistics.median(of(name, "ttft_p90_s")), 4),
                   "tok_per_s_median_over_waves": round(statistics.median(of(name, "tok_per_s")), 2),
                   "hit_rate": round(sum(of(name, "cached_tokens")) / sum(of(name, "prompt_tokens")), 4),
                   "peak_blocks_in_use_max": max(of(name, "peak_blocks_in_use"))}
    w, c = s["warm"], s["cold"]
    s["ttft_p50_cold_over_warm"] = round(c["ttft_p50_s_median_over_waves"] / w["ttft_p50_s_median_over_waves"], 3)
    s["tok_per_s_warm_over_cold"] = round(w["tok_per_s_median_over_waves"] / c["tok_per_s_median_over_waves"], 3)
    return s


def markdown(s: dict) -> str:
    busy = max(s["machine_before"]["load_avg"][0], s["machine_after"]["load_avg"][0])
    lines = [
        "# Prefix caching: many clients sharing one system prompt", "",
        f"Command: `{s['command']}`  ",
        f"Warm server: `{s['server_commands'].get('warm', '')}`  ",
        f"Cold server: `{s['server_commands'].get('cold', '')}`", "",
        f"SmolLM2-135M-Instruct fp32, {s['threads']} thread(s) per server, server.max_batch={s['max_batch']}; "
        f"{s['waves']} waves of {s['clients']} concurrent clients, every request the same ~{s['system_tokens']}-token "
        f"system prompt + its own customer line and question, {s['max_tokens']} streamed greedy tokens, the real "
        f"openai client; a wave goes to one server then the other (order alternating). Machine: "
        f"{s['machine_before']['cpus']} cores, 1-min load {s['machine_before']['load_avg'][0]} before, "
        f"{s['machine_after']['load_avg'][0]} after" + (" (busy: timings noisy)." if busy > 1.5 else "."), "",
        "| wave | server | prompt tokens | cached | hit rate | TTFT p50 s | TTFT p90 s | tok/s | wall s | "
        "peak blocks in use | cached blocks after | same text |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        lines.append(f"| {r['wave']} | {r['server']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['hit_rate']} | "
                     f"{r['ttft_p50_s']} | {r['ttft_p90_s']} | {r['tok_per_s']} | {r['wall_s']} | "
                     f"{r['peak_blocks_in_use']:.0f} | {r['cached_blocks_after']:.0f} | {r['all_same_text']} |")
    w, c = s["warm"], s["cold"]
    lines += ["",
              f"- TTFT p50 (median over waves): warm {w['ttft_p50_s_median_over_waves']} s, cold "
              f"{c['ttft_p50_s_median_over_waves']} s: **{s['ttft_p50_cold_over_warm']}x sooner with the cache**",
              f"- TTFT p90: warm {w['ttft_p90_s_median_over_waves']} s, cold {c['ttft_p90_s_median_over_waves']} s",
              f"- aggregate tok/s: warm {w['tok_per_s_median_over_waves']}, cold {c['tok_per_s_median_over_waves']} "
              f"({s['tok_per_s_warm_over_cold']}x)",
              f"- hit rate: warm {w['hit_rate']}, cold {c['hit_rate']}; peak blocks in use: warm "
              f"{w['peak_blocks_in_use_max']:.0f}, cold {c['peak_blocks_in_use_max']:.0f}",
              f"- every warm reply == the cold server's: {s['all_same_text']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
