"""Where a one-sequence decode step's time goes, on lp.serve's path with its defaults.

Contract: ``python -m bench.step_profile [--tokens 96] [--out bench/results/step_cost/profile]`` loads
the default model as ``lp.serve`` does (``model.quant=auto``: exact4 where the linears are 4-bit
blocks; ``model.compile``, ``model.head`` and the rest at their defaults unless given as
``--override key=value`` on ``ModelConfig``), runs one greedy chat request through a
``BatchEngine`` (the server's engine) in plain one-token steps (``decoding.mode=ar``, what the
budget falls back to on text without repeats), the same through transformers' modules where the
runner holds lp.kernels.fused's stack (``ar_modules``: ``model.fused=off``) and through that stack's
per-layer Python loop instead of its one call for the whole stack (``ar_layers``), ``ar`` again with
``lp_exact4::decoder_paged``'s phase clock on (``ar_clocked``: ms per step in each phase, the stack's
own profile, which torch.profiler cannot see into), and with the default
drafts, all interleaved, and reports per
token: wall time of ``BatchEngine.step``, the time inside the batched forward
(``BatchEngine.forward``), the rest (host work: scheduling, drafts, verification, commit),
then torch.profiler's self-CPU table of 20 one-row steps. Writes ``<out>/profile.json`` and
``<out>/profile.md`` with the command, the machine and the commit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.envelope import command, commit, cpu_name, write

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run_request(engine, ids, dcfg, eos, after_prefill=None):
    """(per-step wall seconds, per-step forward seconds, tokens) of one request to the end;
    ``after_prefill()`` runs after its first step."""
    walls, fwds, tokens = [], [], 0
    inner = engine.forward

    def timed(items):
        t = time.perf_counter()
        out = inner(items)
        fwds.append(time.perf_counter() - t)
        return out

    engine.forward = timed
    try:
        engine.add(ids, dcfg, eos_token_ids=eos)
        while engine.has_work:
            t = time.perf_counter()
            outs = engine.step()
            walls.append(time.perf_counter() - t)
            tokens += sum(len(o.new_tokens) for o in outs)
            if after_prefill is not None and len(walls) == 1:
                after_prefill()
    finally:
        engine.forward = inner
    return walls, fwds, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--override", action="append", default=[], help="ModelConfig field=value (e.g. compile=on)")
    ap.add_argument("--out", default="bench/results/step_cost/profile")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from lp.config import DecodingConfig, ModelConfig
    from lp.engine.batch import BatchEngine
    from lp.generate import eos_ids
    from lp.model.loader import load_model, resolve_model_path
    from lp.model.runner import ModelRunner

    mc = ModelConfig()
    for kv in a.override:
        k, _, v = kv.partition("=")
        if not hasattr(mc, k):
            raise ValueError(f"--override: ModelConfig has no field {k!r}")
        setattr(mc, k, v)
    mc.validate()
    path = resolve_model_path(mc.name, mc.path, mc.cache_dir)
    t = time.perf_counter()
    model, tok = load_model(path, mc.dtype, "cpu", mc.quant)
    load_s = time.perf_counter() - t
    runner = ModelRunner(model, mc.attention, small_rows=mc.small_rows, linears=mc.linears, compile=mc.compile, fused=mc.fused,
                         head=mc.head)
    eos = eos_ids(model, tok)
    if tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:  # a base model's file (no template): the prompt as text
        ids = list(tok(PROMPT)["input_ids"])
    engine = BatchEngine(runner, kv_tokens=4096, max_batch=1)
    if runner.compiled:
        from lp.engine.batch import compile_batched_step

        compile_batched_step(runner, 512)
    modes = {"ar": DecodingConfig(mode="ar", max_new_tokens=a.tokens),
             "defaults": DecodingConfig(max_new_tokens=a.tokens)}
    fused = runner.fused
    if fused is not None:  # the same steps through transformers' modules (model.fused=off), interleaved
        modes["ar_modules"] = modes["ar"]
        modes["ar_layers"] = modes["ar"]  # the fused stack's per-layer Python loop (no decoder_paged)
        modes["ar_clocked"] = modes["ar"]  # decoder_paged with its phase clock on
    rows = {m: [] for m in modes}
    phases = []  # per ar_clocked run: ms per decode step in each phase of decoder_paged
    ext = None
    if fused is not None:
        from lp.kernels import exact4

        ext = exact4.extension()
    run_request(engine, ids, modes["ar"], eos)  # warm-up
    for _ in range(a.reps):  # interleaved
        for m, d in modes.items():
            runner.fused = None if m == "ar_modules" else fused
            if fused is not None:
                fused.whole = m != "ar_layers"
            clocked = m == "ar_clocked"
            walls, fwds, n = run_request(engine, ids, d, eos, (lambda: ext.set_clock(True)) if clocked else None)
            decode = walls[1:]  # the first step is the prefill
            if clocked:
                phases.append({k: 1e3 * v / len(decode) for k, v in ext.clock()})
                ext.set_clock(False)
            rows[m].append({"ms_per_token": 1e3 * sum(decode) / max(1, n - 1), "steps": len(decode),
                            "ms_per_step": 1e3 * statistics.median(decode),
                            "forward_ms_per_step": 1e3 * statistics.median(fwds[1:]),
                            "host_ms_per_step": 1e3 * statistics.median([w - f for w, f in zip(decode, fwds[1:])]),
                            "tokens": n})
    runner.fused = fused  # the profiler over the default's one-row steps
    if fused is not None:
        fused.whole = True
    from torch.profiler import ProfilerActivity, profile

    engine.add(ids, modes["ar"], eos_token_ids=eos)
    engine.step()  # prefill
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            engine.step()
    while engine.has_work:
        engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    result = {"command": command("bench.step_profile", argv),
              "commit": commit(), "cpu": cpu_name(), "threads": a.threads, "model": {**vars(mc)},
              "resolved": {"quant": runner.quant, "compiled": bool(runner.compiled), "fused": fused is not None, "attention": runner.attention,
                           "linears": runner.linears},
              "load_s": load_s, "runs": rows, "decoder_paged_phases_ms_per_step": phases,
              "profile_20_one_row_steps": table}
    md = [f"# One-sequence decode step, lp.serve's engine, defaults ({result['resolved']})", "",
          f"`{result['command']}` at {result['commit']}, {result['cpu']}, {a.threads} threads", "",
          "| mode | ms/token | ms/step | forward ms/step | host ms/step | steps |", "|---|---|---|---|---|---|"]
    for m, rs in rows.items():
        rng = lambda k: f"{min(r[k] for r in rs):.2f}-{max(r[k] for r in rs):.2f}"  # noqa: E731
        md.append(f"| {m} | {rng('ms_per_token')} | {rng('ms_per_step')} | {rng('forward_ms_per_step')} | "
                  f"{rng('host_ms_per_step')} | {rs[0]['steps']} |")
    if phases:
        names = list(phases[0])
        md += ["", "Inside `lp_exact4::decoder_paged` (ar_clocked: its phase clock on, ms per step, summed over the "
               "30 layers; `norm` both norms, `residual` both sums):", "",
               "| " + " | ".join(names + ["sum"]) + " |", "|" + "---|" * (len(names) + 1),
               "| " + " | ".join(f"{min(p[k] for p in phases):.2f}-{max(p[k] for p in phases):.2f}" for k in names)
               + f" | {min(sum(p.values()) for p in phases):.2f}-{max(sum(p.values()) for p in phases):.2f} |"]
    md += ["", "torch.profiler, 20 one-row steps (self CPU):", "", "```", table, "```"]
    write(a.out, "profile", result, md)
    print("\n".join(md[:8 + len(rows)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
