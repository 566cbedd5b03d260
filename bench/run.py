"""Strong-scaling benchmark runner: ``python -m bench.run [hydra overrides]`` (from the repo root).

Contract: the Hydra main is thin: it turns the composed config (conf/bench/)
into ``bench.config.BenchConfig`` and calls ``run_bench``, which tests call
directly. ``run_bench`` loads the model once, tokenizes the prompt sets, runs
every method on the same prompts (single-process methods here, lp/tp/pp with K>1
workers under ``torchrun -m bench.worker``), compares every output with ``ar``'s
and writes results.jsonl, summary.md, machine.json, fit.json and plots to the
output dir.

    python -m bench.run                                   # the documented full run (bench/README.md)
    python -m bench.run prompts=smoke methods=[ar,lookahead,lp] workers=[1,2] name=smoke
    python -m bench.run dtype=bfloat16 lookahead=paper workers=[1,2,4]

Multi-worker methods degenerate at K=1 to their single-process counterpart
(lp -> lookahead at the base W/G, tp and pp -> ar); those rows are reused and
carry ``same_as``.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lp import cli

from bench.config import IN_PROCESS_DECODING, BenchConfig, LookaheadConfig, PromptsConfig, SweepConfig
from bench.prompts import Prompt, select, to_ids

ROOT = Path(__file__).resolve().parent.parent


def repo_path(p: str) -> Path:
    path = Path(p).expanduser()
    return path if path.is_absolute() else ROOT / path


# ---------------------------------------------------------------------------
# jobs: what to run, and which runs are the same computation


@dataclass(frozen=True)
class Job:
    method: str  # the label in the results
    workers: int
    threads: int
    W: int | None = None
    N: int | None = None
    G: int | None = None
    engine: str | None = None  # tp engine; for lp_tp the mesh split, "lp{A}xtp{B}"

    @property
    def kernel(self) -> tuple:
        """The computation actually run; equal kernels share their runs."""
        if self.method in ("ar", "prompt_lookup", *IN_PROCESS_DECODING):
            return (self.method, 1, self.threads)
        if self.method == "lookahead" or (self.method == "lp" and self.workers == 1):
            return ("lookahead", 1, self.threads, self.W, self.N, self.G)
        if self.method in ("tp", "pp") and self.workers == 1:
            return ("ar", 1, self.threads)
        return (self.method, self.workers, self.threads, self.W, self.N, self.G, self.engine)

    @property
    def same_as(self) -> str | None:
        return self.kernel[0] if self.kernel[0] != self.method else None

    @property
    def label(self) -> str:
        wng = f" W={self.W} N={self.N} G={self.G}" if self.W is not None else ""
        engine = f" {self.engine}" if self.engine else ""
        return f"{self.method}{engine} x{self.workers} t{self.threads}{wng}"


def mesh_splits(k: int, valid_tp=None) -> list[tuple[int, int]]:
    """(LP workers, tp) for every split of k processes with tp > 1 (and tp in ``valid_tp``)."""
    return [(k // tp, tp) for tp in range(2, k + 1) if k % tp == 0 and (valid_tp is None or tp in valid_tp)]


def plan_jobs(cfg: BenchConfig, valid_tp=None) -> list[tuple[Job, str]]:
    """(job, which prompts: 'main' or 'sweep'), ar first: every other output is compared with it.
    ``valid_tp``: the tp degrees the model's heads allow (lp_tp), None: every divisor."""
    la: LookaheadConfig = cfg.lookahead
    t, ref = cfg.threads, cfg.reference_threads
    jobs: list[tuple[Job, str]] = [(Job("ar", 1, t), "main")]
    if ref and ref != t:
        jobs.append((Job("ar", 1, ref), "main"))
    if "prompt_lookup" in cfg.methods:
        jobs.append((Job("prompt_lookup", 1, t), "main"))
    for m in IN_PROCESS_DECODING:
        if m in cfg.methods:
            jobs.append((Job(m, 1, t), "main"))
    if "lookahead" in cfg.methods:
        jobs.append((Job("lookahead", 1, t, la.W, la.N, la.G), "main"))
        if ref and ref != t:
            jobs.append((Job("lookahead", 1, ref, la.W, la.N, la.G), "main"))
    for k in cfg.workers:
        for m in ("lp", "tp", "pp"):
            if m not in cfg.methods:
                continue
            if m == "lp":
                W, N, G = la.for_workers(k)
                jobs.append((Job("lp", k, t, W, N, G), "main"))
            elif m == "tp" and k > 1:
                jobs += [(Job("tp", k, t, engine=e), "main") for e in cfg.tp_engines]
            else:
                jobs.append((Job(m, k, t), "main"))
        if "lp_tp" in cfg.methods:
            for lp_k, tp in mesh_splits(k, valid_tp):
                W, N, G = la.for_workers(lp_k)
                jobs.append((Job("lp_tp", k, t, W, N, G, engine=f"lp{lp_k}xtp{tp}"), "main"))
    if "lookahead" in cfg.methods or "lp" in cfg.methods:
        for w in cfg.sweep.W:
            jobs.append((Job("lookahead", 1, t, w, la.N, w), "sweep"))
    return jobs


def sweep_prompts(cfg: BenchConfig, data_dir: Path) -> list[Prompt]:
    sw: SweepConfig = cfg.sweep
    pc = PromptsConfig(**{**asdict(cfg.prompts), "sets": list(sw.sets)})
    chosen = select(pc, data_dir)
    out, seen = [], {}
    for p in chosen:
        seen[p.set] = seen.get(p.set, 0) + 1
        if seen[p.set] <= sw.num_prompts:
            out.append(p)
    return out


# ---------------------------------------------------------------------------
# running jobs


class Runner:
    def __init__(self, cfg: BenchConfig, out: Path):
        from lp.generate import eos_ids
        from lp.model.loader import load_model, resolve_model_path

        self.cfg = cfg
        self.out = out
        self.model_path = resolve_model_path(cfg.model, cfg.model_path)
        self.model, self.tokenizer = load_model(self.model_path, cfg.dtype, cfg.device, cfg.quant)
        self.dtype = str(self.model.dtype).replace("torch.", "")
        self.eos = eos_ids(self.model, self.tokenizer)
        self.memo: dict[tuple, dict] = {}  # (kernel, set, index) -> run dict
        self.warmed: set[tuple] = set()  # kernels that had their untimed warm-up
        self.info: dict[tuple, dict] = {}  # kernel -> worker info
        self.ids: dict[tuple[str, int], list[int]] = {}
        self.errors: list[dict] = []

    def prompt_ids(self, p: Prompt) -> list[int]:
        key = (p.set, p.index)
        if key not in self.ids:
            self.ids[key] = to_ids(self.tokenizer, p)
        return self.ids[key]

    def max_new(self, p: Prompt) -> int:
        return self.cfg.prompts.max_new_tokens[p.set]

    def run(self, job: Job, prompts: list[Prompt]) -> list[tuple[Prompt, dict]]:
        todo = [p for p in prompts if (job.kernel, p.set, p.index) not in self.memo]
        if todo:
            print(f"[bench]   running {job.label} on {len(todo)} prompts", file=sys.stderr, flush=True)
            try:
                if job.kernel[1] == 1:
                    runs = self._in_process(job, todo)
                else:
                    runs = self._torchrun(job, todo)
            except (RuntimeError, ValueError) as e:
                print(f"[bench] {job.label} FAILED: {e}", file=sys.stderr, flush=True)
                self.errors.append({"job": job.label, "error": str(e)})
                return []
            for p, r in zip(todo, runs):
                self.memo[(job.kernel, p.set, p.index)] = r
        return [(p, self.memo[(job.kernel, p.set, p.index)]) for p in prompts]

    def _in_process(self, job: Job, prompts: list[Prompt]) -> list[dict]:
        from tqdm import tqdm

        from bench import methods

        kind = job.kernel[0]
        torch.set_num_threads(job.threads)
        m, eos, cfg = self.model, self.eos, self.cfg

        def decode(ids: list[int], n: int) -> methods.Run:
            if kind == "ar":
                return methods.run_ar(m, ids, n, eos)
            if kind == "prompt_lookup":
                return methods.run_prompt_lookup(m, ids, n, eos, cfg.prompt_lookup_num_tokens)
            if kind in IN_PROCESS_DECODING:
                decoding, runner_kw = IN_PROCESS_DECODING[kind]
                return methods.run_lookahead(m, ids, n, eos, 0, 0, 0, True, decoding=decoding, runner_kw=runner_kw)
            assert kind == "lookahead", kind
            return methods.run_lookahead(
                m, ids, n, eos, job.W, job.N, job.G, cfg.lookahead.prompt_pool,
                window_policy=cfg.lookahead.window_policy,
            )

        if self.cfg.warmup and job.kernel not in self.warmed:
            decode(self.prompt_ids(prompts[0]), min(8, self.max_new(prompts[0])))
            self.warmed.add(job.kernel)
        self.info[job.kernel] = {"workers": 1, "threads": torch.get_num_threads()}
        return [
            asdict(decode(self.prompt_ids(p), self.max_new(p)))
            for p in tqdm(prompts, desc=job.label, file=sys.stderr, leave=False)
        ]

    def _torchrun(self, job: Job, prompts: list[Prompt]) -> list[dict]:
        cfg, la = self.cfg, self.cfg.lookahead
        jobs_dir = self.out / "jobs"
        jobs_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{job.method}_x{job.workers}_t{job.threads}" + (f"_W{job.W}N{job.N}G{job.G}" if job.W else "")
        stem += f"_{job.engine}" if job.engine else ""
        spec_path, out_path = jobs_dir / f"{stem}.spec.json", jobs_dir / f"{stem}.out.json"
        out_path.unlink(missing_ok=True)
        spec = {
            "method": job.method, "model_path": str(self.model_path), "dtype": cfg.dtype, "quant": cfg.quant, "device": cfg.device,
            "threads": job.threads, "W": job.W, "N": job.N, "G": job.G, "prompt_pool": la.prompt_pool,
            "window_policy": la.window_policy,
            "tp_engine": job.engine,
            "tp": int(job.engine.rpartition("tp")[2]) if job.method == "lp_tp" else 1,
            "dist_timeout_s": cfg.dist_timeout_s, "warmup": cfg.warmup, "eos": self.eos,
            "prompts": [
                {"key": [p.set, p.index], "ids": self.prompt_ids(p), "max_new_tokens": self.max_new(p)}
                for p in prompts
            ],
        }
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(job.workers),
               "-m", "bench.worker", "--spec", str(spec_path), "--out", str(out_path)]
        env = dict(os.environ, OMP_NUM_THREADS=str(job.threads))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [x for x in [env.get("PYTHONPATH")] if x])
        run_subprocess(cmd, env, cfg.worker_timeout_s)
        if not out_path.is_file():
            raise RuntimeError(f"torchrun finished but rank 0 wrote no {out_path}")
        result = json.loads(out_path.read_text())
        self.info[job.kernel] = result["info"]
        return result["runs"]


def run_subprocess(cmd: list[str], env: dict, timeout_s: float) -> None:
    """Run ``cmd`` in its own process group; stop that group on timeout, error or Ctrl-C."""
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"torchrun job exceeded worker_timeout_s={timeout_s:g}") from None
    finally:
        if proc.poll() is None:
            _stop_group(proc)
    if rc != 0:
        raise RuntimeError(f"torchrun job exited with status {rc}")


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------------------
# rows


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def make_row(cfg: BenchConfig, job: Job, p: Prompt, run: dict, ar: dict | None, info: dict, dtype: str,
             prompt_tokens: int, max_new_tokens: int) -> dict:
    ids = run["output_ids"]
    n, steps, dt = len(ids), run["steps"], run["decode_time_s"]
    ex = run.get("exchange_time_s")
    mism = first_mismatch(ids, ar["output_ids"]) if ar is not None else None
    row = {
        "name": cfg.name,
        "method": job.method,
        "workers": job.workers,
        "threads": job.threads,
        "W": job.W,
        "N": job.N,
        "G": job.G,
        "set": p.set,
        "prompt_index": p.index,
        "prompt_id": p.id,
        "raw_prompt": p.raw,
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "new_tokens": n,
        "steps": steps,
        "S": round(n / steps, 4) if steps else 0.0,
        "decode_time_s": round(dt, 5),
        "tokens_per_second": round(n / dt, 4) if dt > 0 else 0.0,
        "matches_ar": (mism is None) if ar is not None else None,
        "first_mismatch": mism,
        "exchange_time_s": round(ex, 5) if ex is not None else None,
        "exchange_time_per_step_s": round(ex / steps, 7) if ex is not None and steps else None,
        "rows_per_step": round(run["rows_per_step"], 3) if run.get("rows_per_step") is not None else None,
        "rows_per_rank_per_step": [round(r, 3) for r in run["rows_per_rank_per_step"]]
        if run.get("rows_per_rank_per_step") is not None else None,
        "accept_hist": run.get("accept_hist"),
        "forward_time_s": run.get("extra", {}).get("forward_time_s"),
        "host_time_s": run.get("extra", {}).get("host_time_s"),
        "dtype": dtype,
        "same_as": job.same_as,
        "tp_engine": job.engine,
        "tp_sharded": info.get("tp_sharded"),
        "ranks_agree": info.get("ranks_agree"),
        "output_ids": ids,
    }
    return row


def _row_key(r: dict) -> tuple:
    return (r["method"], r["workers"], r["threads"], r["W"], r["G"], r["tp_engine"], r["set"], r["prompt_index"])


def machine_info(cfg: BenchConfig, dtype: str, model_path: Path) -> dict:
    import transformers

    cpu = "unknown"
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    return {
        "cpu_model": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_features": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma"))),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": dtype,
        "threads_per_worker": cfg.threads,
        "reference_threads": cfg.reference_threads,
        "model_path": str(model_path),
        "device": cfg.device,
        **_gpu_info(cfg.device),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_start": _loadavg(),
    }


def _gpu_info(device: str) -> dict:
    if device != "cuda" or not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpus": torch.cuda.device_count(),
            "gpu_memory_GiB": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda}


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def scaling_check(runner: Runner, cfg: BenchConfig, out: Path, rows: list[dict]) -> None:
    """t(Q) at the per-worker thread count -> tq.json; model vs measurement -> scaling_check.md."""
    from bench import scaling

    torch.set_num_threads(cfg.threads)
    print(f"[bench] measuring t(Q) for Q in {cfg.tq_qs}", file=sys.stderr, flush=True)
    t = scaling.measure_tq(runner.model, cfg.tq_qs, repeats=cfg.tq_repeats)
    tq = scaling.TQCurve(t)
    (out / "tq.json").write_text(json.dumps({"t_s": tq.to_json(), "dtype": runner.dtype, "device": cfg.device,
                                             "threads": cfg.threads, "cache_len": 200,
                                             "repeats": cfg.tq_repeats}, indent=2) + "\n")
    scaling.write_check(out, tq, rows, threads=cfg.threads)


# ---------------------------------------------------------------------------
# the benchmark


def run_bench(cfg: BenchConfig) -> Path:
    """Run every configured job; write results to the output dir and return its path."""
    from bench import report

    cfg.validate()
    out = repo_path(cfg.out_dir or f"bench/results/{cfg.name}")
    out.mkdir(parents=True, exist_ok=True)
    if cfg.kind == "concurrency":
        from bench.concurrency import run_concurrency
        from lp.model.loader import resolve_model_path

        run_concurrency(cfg, out, resolve_model_path(cfg.model, cfg.model_path))
        return out
    data_dir = repo_path(cfg.prompts.data_dir)
    main_prompts = select(cfg.prompts, data_dir)
    sw_prompts = sweep_prompts(cfg, data_dir) if cfg.sweep.W else []
    runner = Runner(cfg, out)
    machine = machine_info(cfg, runner.dtype, runner.model_path)
    (out / "machine.json").write_text(json.dumps(machine, indent=2) + "\n")

    results = out / "results.jsonl"
    results.write_text("")
    rows: list[dict] = []
    ar_kernel = Job("ar", 1, cfg.threads).kernel
    t0 = time.perf_counter()
    from lp.parallel.tp import valid_tp

    plan = plan_jobs(cfg, valid_tp(runner.model.config) if "lp_tp" in cfg.methods else None)
    if cfg.interleave:
        for i, p in enumerate(main_prompts):
            if cfg.budget_s is not None and time.perf_counter() - t0 > cfg.budget_s:
                print(f"[bench] budget of {cfg.budget_s:g} s spent; stopping before {p.set}#{p.index}",
                      file=sys.stderr, flush=True)
                main_prompts = main_prompts[:i]
                break
            for job, which in plan:
                if which == "main" and job.kernel[1] == 1:
                    runner.run(job, [p])
    for i, (job, which) in enumerate(plan):
        print(f"[bench] job {i + 1}/{len(plan)}: {job.label} ({which} prompts)", file=sys.stderr, flush=True)
        prompts = main_prompts if which == "main" else sw_prompts
        if job.kernel != ar_kernel:  # outputs are compared with ar's: make sure ar ran on these prompts
            runner.run(Job("ar", 1, cfg.threads), prompts)
        done = runner.run(job, prompts)
        new_rows = []
        for p, r in done:
            ar = runner.memo.get((ar_kernel, p.set, p.index))
            new_rows.append(make_row(cfg, job, p, r, ar, runner.info.get(job.kernel, {}), runner.dtype,
                                     len(runner.prompt_ids(p)), runner.max_new(p)))
        have = {_row_key(r) for r in rows}
        new_rows = [r for r in new_rows if _row_key(r) not in have]  # sweep rows already in the main run
        rows += new_rows
        with results.open("a") as f:
            for r in new_rows:
                f.write(json.dumps(r) + "\n")
    if cfg.scaling_check:
        scaling_check(runner, cfg, out, rows)
    elapsed = time.perf_counter() - t0
    machine["loadavg_end"] = _loadavg()
    (out / "machine.json").write_text(json.dumps(machine, indent=2) + "\n")
    (out / "errors.json").write_text(json.dumps(runner.errors, indent=2) + "\n")
    report.write_all(rows, out, cfg, machine, runner.errors, elapsed)
    print(f"[bench] wrote {out} ({len(rows)} rows, {elapsed:.0f} s)", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------
# Hydra entry point


SCHEMAS = {
    (None, "bench_schema"): BenchConfig,
    ("prompts", "prompts_schema"): PromptsConfig,
    ("lookahead", "lookahead_schema"): LookaheadConfig,
    ("sweep", "sweep_schema"): SweepConfig,
}


def main() -> None:
    cli.hydra_main("bench", SCHEMAS, run_bench, str(ROOT / "conf" / "bench"))


if __name__ == "__main__":
    main()
