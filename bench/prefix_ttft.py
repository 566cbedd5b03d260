"""Time to first token with automatic prefix caching: ``python -m bench.prefix_ttft [options]``.

Contract: starts two one-process ``lp.serve`` servers on localhost, ``warm``
(``server.prefix_cache=true``) and ``cold`` (off), and runs ``--rounds`` conversations of
``--turns`` turns through the real ``openai`` client (streaming, greedy, ``--max-tokens``
each). Each round has its own ~``--system-tokens`` system prompt (a round tag at its very
start, so no block of it is cached from an earlier round): turn 1 is cold on both
servers; later turns resend the system prompt, the earlier turns and replies, and a new
question. A first round (its own system prompt) warms both servers up and is not
recorded. Every turn goes to both servers back to back (which one first alternates by
round), so both see the same machine state. TTFT = request sent to the first chunk with
content, client side. Checks every warm reply equals the cold one; writes
``<out>/prefix_ttft.json`` and ``.md`` with the command, the machine and its load.

The claim measured: on the warm server, later turns' TTFT vs the cold first turn
(per round the ratio, then median and range over rounds), and vs the same later turn on
the cold server.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time

from bench.serve_load import ROOT, ServerProcess, machine

RULES = [
    "Greet every customer by name when the order history gives one.",
    "Sourdough loaves are baked at 6:30 and again at 11:00; rye only on weekdays.",
    "Croissants sell out by nine on Saturdays, so suggest pre-ordering them the day before.",
    "Cakes need two days' notice; wedding cakes need three weeks and a tasting appointment.",
    "The shop is closed on Mondays and on public holidays, except the Saturday before Easter.",
    "Gluten-free bread is baked in a separate oven but the kitchen handles wheat flour.",
    "Never promise a delivery time: the van leaves at ten and returns when the route is done.",
    "Payment by card, cash or the loyalty app; the app gives every tenth coffee for free.",
    "Seasonal pies: rhubarb in spring, cherry in summer, apple and pumpkin in autumn.",
    "Refunds for a damaged order are given in full if the customer calls the same day.",
    "Large orders for offices get ten percent off above forty items.",
    "Allergens are listed on the shelf labels and in the app; when unsure, say so.",
]
QUESTIONS = ["When do you open on Tuesday, and is rye available then?",
             "Can I order a chocolate cake for Saturday afternoon?",
             "Do you have anything gluten free that is safe for a coeliac?",
             "What pies do you have at this time of year?",
             "How do I get a refund for a squashed delivery?"]


def system_prompt(round_: int, tok, tokens: int) -> str:
    parts, i = [f"Session {round_ * 7919 % 10007}. You are the assistant of a small bakery."], 0
    while len(tok(" ".join(parts))["input_ids"]) < tokens:
        parts.append(f"Rule {i + 1}: {RULES[i % len(RULES)]}")
        i += 1
    return " ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/prefix/ttft")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: never leak the servers
    import openai

    from lp.model.loader import load_tokenizer, resolve_model_path

    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.prefix_ttft " + " ".join(argv if argv is not None else sys.argv[1:])
    tok = load_tokenizer(resolve_model_path("smollm2", None))
    before = machine()
    common = ["server.kv_tokens=32768", "server.max_tokens=4096"]
    servers = {}
    try:
        servers["warm"] = ServerProcess(1, a.threads, [*common, "server.prefix_cache=true"], out / "warm_server.log")
        servers["cold"] = ServerProcess(1, a.threads, [*common, "server.prefix_cache=false"], out / "cold_server.log")
        clients = {k: openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=1800)
                   for k, s in servers.items()}

        def ask(name, messages):
            t = time.perf_counter()
            ttft, text, cached = None, [], None
            stream = clients[name].chat.completions.create(
                model="smollm2", messages=messages, max_tokens=a.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
            for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t
                    text.append(ch.choices[0].delta.content)
                if ch.usage is not None:
                    details = ch.usage.prompt_tokens_details
                    cached = details.cached_tokens if details is not None else 0
                    prompt_tokens = ch.usage.prompt_tokens
            return ttft, "".join(text), cached, prompt_tokens

        rows = []
        for r in range(-1, a.rounds):  # round -1: warm-up (first long prefills, kernels), not recorded
            messages = [{"role": "system", "content": system_prompt(r, tok, a.system_tokens)}]
            order = ("warm", "cold") if r % 2 == 0 else ("cold", "warm")
            for t in range(a.turns):
                messages.append({"role": "user", "content": QUESTIONS[(r + t) % len(QUESTIONS)]})
                got = {name: ask(name, messages) for name in order}
                row = {"round": r, "turn": t + 1, "prompt_tokens": got["warm"][3], "first": order[0],
                       "warm_ttft_s": round(got["warm"][0], 4), "cold_ttft_s": round(got["cold"][0], 4),
                       "warm_cached_tokens": got["warm"][2], "same_text": got["warm"][1] == got["cold"][1]}
                if r >= 0:
                    rows.append(row)
                print(f"[prefix_ttft] {row}", flush=True)
                messages.append({"role": "assistant", "content": got["cold"][1]})
    finally:
        for s in servers.values():
            s.stop()
    summary = summarize(rows, a)
    summary.update(command=command, server_commands={k: " ".join(s.cmd) for k, s in servers.items()},
                   machine_before=before, machine_after=machine(), rows=rows)
    (out / "prefix_ttft.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = markdown(summary)
    (out / "prefix_ttft.md").write_text(md)
    print(md)
    return 0


def summarize(rows: list[dict], a) -> dict:
    first = {r["round"]: r["warm_ttft_s"] for r in rows if r["turn"] == 1}
    later = [r for r in rows if r["turn"] > 1]
    vs_first = [first[r["round"]] / r["warm_ttft_s"] for r in later]
    vs_cold = [r["cold_ttft_s"] / r["warm_ttft_s"] for r in later]

    def spread(xs):
        return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}

    return {"rounds": a.rounds, "turns": a.turns, "system_tokens": a.system_tokens, "max_tokens": a.max_tokens,
            "threads": a.threads,
            "cold_first_turn_ttft_s": spread(list(first.values())),
            "warm_later_turn_ttft_s": spread([r["warm_ttft_s"] for r in later]),
            "cold_later_turn_ttft_s": spread([r["cold_ttft_s"] for r in later]),
            "speedup_later_vs_cold_first": spread(vs_first),
            "speedup_later_warm_vs_cold_server": spread(vs_cold),
            "all_same_text": all(r["same_text"] for r in rows)}


def markdown(s: dict) -> str:
    busy = max(s["machine_before"]["load_avg"][0], s["machine_after"]["load_avg"][0])
    lines = [
        "# Prefix caching: time to first token of a chat's later turns", "",
        f"Command: `{s['command']}`  ",
        f"Warm server: `{s['server_commands'].get('warm', '')}`  ",
        f"Cold server: `{s['server_commands'].get('cold', '')}`", "",
        f"SmolLM2-135M-Instruct fp32, {s['threads']} threads per server, a ~{s['system_tokens']}-token system "
        f"prompt per round (its own, nothing shared between rounds), {s['turns']} turns, {s['max_tokens']} "
        f"new tokens per turn, streaming, the real openai client; each turn sent to both servers back to back. "
        f"Machine: {s['machine_before']['cpus']} cores, 1-min load {s['machine_before']['load_avg'][0]} before, "
        f"{s['machine_after']['load_avg'][0]} after" + (" (busy: timings noisy)." if busy > 1.5 else "."), "",
        "| round | turn | prompt tokens | cached (warm) | warm TTFT s | cold TTFT s | first sent to | same text |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        lines.append(f"| {r['round']} | {r['turn']} | {r['prompt_tokens']} | {r['warm_cached_tokens']} | "
                     f"{r['warm_ttft_s']} | {r['cold_ttft_s']} | {r['first']} | {r['same_text']} |")

    def fmt(d, unit=""):
        return f"median {d['median']}{unit} (min {d['min']}, max {d['max']})"

    lines += ["",
              f"- cold first turn TTFT (warm server): {fmt(s['cold_first_turn_ttft_s'], ' s')}",
              f"- later turns, warm server: {fmt(s['warm_later_turn_ttft_s'], ' s')}",
              f"- later turns, cold server: {fmt(s['cold_later_turn_ttft_s'], ' s')}",
              f"- **later turn vs its round's cold first turn: {fmt(s['speedup_later_vs_cold_first'], 'x')} sooner**",
              f"- later turn, warm vs cold server: {fmt(s['speedup_later_warm_vs_cold_server'], 'x')}",
              f"- every warm reply == the cold server's: {s['all_same_text']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
