"""Server overhead: a 128-token greedy request through ``lp.serve`` vs the same decode offline.

Contract: ``python -m bench.serve_overhead [--reps 5]`` times, interleaved so both see the
same machine state, (a) a non-streaming 128-token greedy chat request to a one-process
server on localhost (client wall time: HTTP, chat template, decode, detokenization) and
(b) the same decode in this process the way ``python -m lp.generate`` does it (chat
template + ``LookaheadDecoder.generate`` + decode of the text; the model stays loaded, as
the server's does), both with the same torch threads and the server idle while (b) runs.
It checks both produce the same tokens, runs the CLI itself once for the record, and
writes ``<out>/overhead.json`` and ``.md`` with the command. Overhead =
median(a) / median(b) - 1; the target is <= 5%.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time

from bench.serve_load import ROOT, ServerProcess, machine

PROMPT = "Write a detailed, step by step tutorial on how to bake sourdough bread at home."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/serve")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: never leak the server
    import openai
    import torch

    from lp.config import DecodingConfig, GenerateConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.generate import build_prompt_ids, eos_ids
    from lp.model.runner import ModelRunner
    from lp.model.loader import load_model, resolve_model_path

    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.serve_overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    before = machine()
    torch.set_num_threads(a.threads)
    model, tok = load_model(resolve_model_path("smollm2", None), "float32")
    runner, eos = ModelRunner(model), eos_ids(model, tok)

    def offline() -> tuple[float, list[int], float]:
        t = time.perf_counter()
        ids = build_prompt_ids(tok, GenerateConfig(prompt=PROMPT))
        res = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=a.max_tokens)).generate(ids, eos)
        tok.decode(res.output_ids, skip_special_tokens=True)
        return time.perf_counter() - t, res.output_ids, res.stats.decode_time_s

    srv = ServerProcess(1, a.threads, [], out / "overhead_server.log")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=1800)

    def served() -> tuple[float, list[int], float]:
        t = time.perf_counter()
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=a.max_tokens, temperature=0,
                                           extra_body={"lookahead": {"return_token_ids": True}})
        dt = time.perf_counter() - t
        la = r.model_extra["lookahead"]
        return dt, la["output_ids"], la["decode_time_s"]

    rows = []
    try:
        served(), offline()  # warm-up, not timed
        for i in range(a.reps):
            s_t, s_ids, s_dec = served()
            o_t, o_ids, o_dec = offline()
            rows.append({"rep": i, "server_wall_s": round(s_t, 4), "server_decode_s": round(s_dec, 4),
                         "offline_wall_s": round(o_t, 4), "offline_decode_s": round(o_dec, 4),
                         "tokens": len(s_ids), "same_tokens": s_ids == o_ids})
            print(f"[overhead] rep {i}: server {s_t:.3f} s, offline {o_t:.3f} s, tokens {len(s_ids)}", flush=True)
    finally:
        srv.stop()
    # the CLI itself, once, for the record (its decode_time_s excludes model load and template)
    cli_json = out / "overhead_cli.json"
    cli = [sys.executable, "-m", "lp.generate", f"prompt='{PROMPT}'", f"decoding.max_new_tokens={a.max_tokens}",
           "model.dtype=float32", f"model.threads={a.threads}", "stream=false", f"output={cli_json}",
           "hydra.run.dir=/tmp/lp_overhead_cli"]
    proc = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 or not cli_json.exists():
        print(proc.stderr[-2000:], file=sys.stderr)
        cli_res = {"decode_time_s": None, "output_ids": []}
    else:
        cli_res = json.loads(cli_json.read_text())
        cli_json.unlink()
    s_med = statistics.median(r["server_wall_s"] for r in rows)
    o_med = statistics.median(r["offline_wall_s"] for r in rows)
    summary = {
        "command": command, "server_command": " ".join(srv.cmd), "cli_command": " ".join(cli[1:]),
        "prompt": PROMPT, "max_tokens": a.max_tokens, "threads": a.threads, "reps": a.reps,
        "server_wall_median_s": round(s_med, 4), "offline_wall_median_s": round(o_med, 4),
        "overhead": round(s_med / o_med - 1, 4),
        "server_internal_overhead_median_s": round(statistics.median(r["server_wall_s"] - r["server_decode_s"]
                                                                    for r in rows), 4),
        "cli_decode_time_s": cli_res["decode_time_s"], "cli_tokens": len(cli_res["output_ids"]),
        "cli_same_tokens": cli_res["output_ids"] == o_ids,
        "all_same_tokens": all(r["same_tokens"] for r in rows),
        "machine_before": before, "machine_after": machine(), "rows": rows,
    }
    (out / "overhead.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = markdown(summary)
    (out / "overhead.md").write_text(md)
    print(md)
    return 0


def markdown(s: dict) -> str:
    busy = max(s["machine_before"]["load_avg"][0], s["machine_after"]["load_avg"][0])
    note = ""
    if busy > 0.5 * (s["machine_before"]["cpus"] or 1):
        note = (f"\n**Note:** the machine was busy with other work (1-min load average up to {busy:.2f} on "
                f"{s['machine_before']['cpus']} cores); timings are noisy.\n")
    lines = [
        "# lp.serve overhead: one 128-token greedy request vs the same decode offline", "",
        f"Command: `{s['command']}`  ", f"Server: `{s['server_command']}`  ", f"CLI: `python {s['cli_command']}`",
        note,
        "| rep | server wall s | server decode s | offline wall s | offline decode s | tokens | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        lines.append(f"| {r['rep']} | {r['server_wall_s']} | {r['server_decode_s']} | {r['offline_wall_s']} | "
                     f"{r['offline_decode_s']} | {r['tokens']} | {r['same_tokens']} |")
    lines += [
        "",
        f"Median server request {s['server_wall_median_s']} s vs median offline decode {s['offline_wall_median_s']} s: "
        f"**overhead {100 * s['overhead']:+.1f}%** (target <= +5%). Server time outside the decode loop "
        f"(HTTP, template, queue, detokenization): median {s['server_internal_overhead_median_s']} s.",
        f"`lp.generate` CLI once: decode {s['cli_decode_time_s']} s for {s['cli_tokens']} tokens, same tokens as "
        f"offline: {s['cli_same_tokens']}.",
        f"Machine: {s['machine_before']['cpus']} cores, load average before {s['machine_before']['load_avg']}, "
        f"after {s['machine_after']['load_avg']}.", "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
