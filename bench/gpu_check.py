"""The prepared one-GPU check (issue 37; run by bench/gpu_check.sh): sections cheapest first, each
in its own process under its own time-out, each writing ``--out/<section>.json`` (and a line of
``--jsonl``) the moment it ends (a time-out or a crash writes it too), so one call of the device
tool always leaves the sections that finished. The time-outs (``SECTIONS``) add up to at most ``BUDGET_S`` = 480 s.

    env        torch / CUDA / GPU, and lp's imports (lp, lp.serve, hydra, llguidance, gguf, fastapi ...)
    model      the kit's GGUF (joined by bench.gpu_kit assemble) converted and loaded; a greedy line
    exact      greedy lookahead == transformers generate per kernel (sdpa, flex, flash when installed):
               fp32 must be token-identical (``fp32_all_equal``: None when no fp32 run finished, never
               a vacuous True); bf16 reported with the first divergence and its top-2 logit gap
    tq         t(Q): packed forward time vs rows (1..512 on the GPU) on a 200-token cache
    lookahead  lookahead (auto kernel, W=15, N=5, G=15) vs generate on the held prompts
    batch      the batched engine (auto kernel, as lp.serve builds it) over 8 prompts vs generate
    serve      lp.serve with 8 concurrent clients, each text vs the one-process greedy output
    graphs     CUDA graphs captured and replayed == eager (the CPU: the static path uncaptured)
    sampling   sampled lookahead: a seed's output reproduced
    profile    one generation under torch.profiler: kernel launches and host syncs per step
    compile    model.compile=on == eager (skipped in the rehearsal: minutes on 2 CPU cores)

``--rehearse``: the same sections on the CPU at CPU sizes (a tiny random model; lp.serve on a
tiny model with SmolLM2's tokenizer), what ``bash bench/gpu_check.sh --rehearse`` runs in a
venv built from the kit with ``--no-index``. A section returns its data; ``"ok": False`` in it
marks it ``fail``, an exception ``error``, the time-out ``timeout``; ``summary.json`` lists all.

    python -m bench.gpu_check --out WORK [--jsonl $OUT/sections.jsonl] [--rehearse] [--sections env,exact]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from bench.envelope import write_json

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 480
# (name, time-out in seconds), cheapest first
SECTIONS = (("env", 15), ("model", 60), ("exact", 60), ("tq", 20), ("lookahead", 40), ("batch", 35),
            ("serve", 65), ("graphs", 35), ("sampling", 20), ("profile", 25), ("compile", 70))
REHEARSE_SCALE = 5  # the rehearsal's time-outs: x5 on this machine's 2 shared cores (not a budget check)
REHEARSE_SKIPS = {"compile": "inductor compiles for minutes on the CPU; the GPU run covers it"}
IMPORTS = ("lp", "lp.serve", "lp.grammar", "hydra", "omegaconf", "antlr4", "llguidance", "gguf", "fastapi",
           "uvicorn", "jsonschema", "pydantic")


@dataclass(frozen=True)
class Sizes:
    device: str
    prompts: int  # exact: prompts per kernel and dtype
    tokens: int  # exact / batch / sampling: new tokens
    long_prompts: int  # lookahead
    long_tokens: int
    qs: tuple
    repeats: int
    clients: int
    serve_tokens: int


GPU = Sizes("cuda", 3, 64, 8, 128, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), 10, 8, 64)
CPU = Sizes("cpu", 1, 12, 2, 16, (1, 2, 4, 8), 2, 8, 8)


def check_budget(sections=SECTIONS, budget: int = BUDGET_S) -> int:
    total = sum(t for _, t in sections)
    assert total <= budget, f"section time-outs add up to {total} s > {budget} s"
    return total


def run_section(out: Path, name: str, fn, *args) -> dict:
    """``fn(*args)`` -> its data, written at once as ``out/name.json`` with status and seconds."""
    t = time.perf_counter()
    try:
        data = fn(*args)
        status = "fail" if data.get("ok") is False else "ok"
    except Exception as e:  # recorded, the check goes on
        data = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        status = "error"
    data = {"status": status, "seconds": round(time.perf_counter() - t, 1), **data}
    write_json(out, name, data)
    print(f"[gpu_check] {name}: {status} ({data['seconds']} s)", flush=True)
    return data


def run_child(out: Path, name: str, timeout_s: float, argv: list[str]) -> dict:
    """One section in its own process group, killed at ``timeout_s``; its JSON is the child's,
    else one saying why there is none (time-out, crash), written the moment it ends."""
    path = out / f"{name}.json"
    path.unlink(missing_ok=True)  # a JSON from an earlier run is not this one's
    t = time.perf_counter()
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and whatever it started (a server)
    except ProcessLookupError:
        pass
    proc.wait()
    log.close()
    seconds = round(time.perf_counter() - t, 1)
    if path.exists():  # the child's own, also when it hung on its way out or left a partial one
        data = json.loads(path.read_text())
        if data["status"] == "partial":
            data.update(status="timeout" if rc is None else "error", timeout_s=timeout_s)
            write_json(out, name, data)
        print(f"[gpu_check] {name}: {data['status']} ({data['seconds']} s; {seconds} s with start-up)", flush=True)
        return data
    if rc is None:
        data = {"status": "timeout", "seconds": seconds, "timeout_s": timeout_s}
    else:
        data = {"status": "error", "seconds": seconds, "error": f"exit {rc} without its JSON"}
    data["log_tail"] = (out / f"{name}.log").read_text()[-2000:]
    write_json(out, name, data)
    print(f"[gpu_check] {name}: {data['status']} ({seconds} s)", flush=True)
    return data


def _child(out: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "bench.gpu_check", "--out", str(out), "--section", name]


def run_all(out: Path, names: list[str], rehearse: bool, sections=SECTIONS, child=None,
            jsonl: Path | None = None) -> dict:
    """Every section of ``names`` in ``sections`` order, ``child(out, name)`` its command line; after
    each, its JSON appended to ``jsonl`` (one file: the device tool returns at most 8) and
    ``summary.json`` rewritten."""
    check_budget(sections)
    summary = {"rehearse": rehearse, "budget_s": BUDGET_S, "sections": {}}
    for name, timeout_s in sections:
        if name not in names:
            continue
        if rehearse and name in REHEARSE_SKIPS:
            data = {"status": "skipped", "seconds": 0.0, "why": REHEARSE_SKIPS[name]}
            write_json(out, name, data)
        else:
            argv = (child or _child)(out, name)
            data = run_child(out, name, timeout_s * (REHEARSE_SCALE if rehearse else 1),
                             argv + (["--rehearse"] if rehearse else []))
        summary["sections"][name] = {"status": data["status"], "seconds": data["seconds"]}
        write_json(out, "summary", summary)
        if jsonl is not None:
            with open(jsonl, "a") as f:
                f.write(json.dumps({"section": name, **data}, default=str) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rehearse", action="store_true", help="the CPU rehearsal: CPU sizes, a tiny model")
    ap.add_argument("--sections", default=",".join(n for n, _ in SECTIONS))
    ap.add_argument("--section", help="run this one section here (the runner's child)")
    ap.add_argument("--jsonl", help="append each section's JSON to this file the moment it ends")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        from bench import gpu_check_sections as s

        sizes = CPU if args.rehearse else GPU
        data = run_section(out, args.section, getattr(s, args.section), sizes, out)
        sys.stdout.flush()
        os._exit(0 if data["status"] in ("ok", "fail") else 1)  # no wait on threads an import left behind
    names = args.sections.split(",")
    unknown = sorted(set(names) - {n for n, _ in SECTIONS})
    if unknown:
        raise ValueError(f"--sections: unknown {unknown}; choose from {', '.join(n for n, _ in SECTIONS)}")
    if not args.rehearse:
        import torch

        if not torch.cuda.is_available():
            print("[gpu_check] CUDA is not available here; --rehearse runs the CPU rehearsal", file=sys.stderr)
            return 2
    summary = run_all(out, names, args.rehearse, jsonl=Path(args.jsonl) if args.jsonl else None)
    bad = [n for n, s in summary["sections"].items() if s["status"] not in ("ok", "skipped")]
    print(f"[gpu_check] {len(summary['sections']) - len(bad)}/{len(summary['sections'])} sections ok"
          + (f"; not ok: {', '.join(bad)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
