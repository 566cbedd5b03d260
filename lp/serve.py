"""OpenAI-compatible server: ``python -m lp.serve [overrides]``, or under torchrun for LP.

Contract: the Hydra main is thin: it turns the composed config (groups model, decoding,
parallel, server; conf/serve.yaml) into ``lp.server.config.ServeConfig`` and calls
``run``. Every rank loads the model; under torchrun the ranks first check that they all
loaded the same model (``RequestChannel.handshake``). Rank 0 then serves HTTP
(``lp.server.app`` on uvicorn) and decodes in the engine thread: continuous batching
(``lp.server.batched.BatchedEngine``, ``server.max_batch`` requests per step) in one
process and under LP alike; under LP the other ranks hold the same batch
(``lp.server.batched.worker_loop``: rank 0's joins, aborts and admissions ride with each
step, each sequence's rows are sharded over the workers) until rank 0 sends SHUTDOWN. A dead worker or a silent
rank 0 ends every rank within ``parallel.timeout_s`` with a ``[lp.serve] ...`` log line
and exit status 3; a normal shutdown (SIGINT/SIGTERM to rank 0 or to torchrun) exits 0.

    python -m lp.serve server.port=8000
    torchrun --nproc-per-node 2 -m lp.serve parallel.workers=2
    python launch/lp_run.py --module lp.serve parallel.workers=2
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import sys
from pathlib import Path


from lp import cli
from lp.parallel.dist import RequestChannel, WorkerFailure, exit_process, init_worker_group, torchrun_env, worker_device
from lp.server.config import ServeConfig, ServerConfig

log = logging.getLogger("lp.serve")


def _setup_logging() -> None:
    if not any(getattr(h, "_lp_serve", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        h._lp_serve = True
        log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False
    log.disabled = False  # Hydra's disabled job logging (ranks > 0) turns off existing loggers


def resident() -> str:
    """This process's resident memory now and its peak (Linux: /proc/self/status), as the start-up log
    reports it after each phase: ``612 MiB (peak 1105 MiB)``; ``?`` where /proc is missing."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        now, peak = (int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM"))
    except (OSError, KeyError, ValueError):
        return "?"
    return f"{now} MiB (peak {peak} MiB)"


def release_memory() -> None:
    """What a start-up phase freed (a measurement's engine, K/V and activations, a load's staging
    copies), handed back to the OS: cycles collected, then glibc's heap trimmed (lp.model.gguf).
    What survives is frozen (``gc.freeze``): the ~400k objects of torch's and transformers' modules
    and the model are never garbage, and a full collection walking them took ~0.25 s (five at
    start-up; one now and then while serving, a stall of every request in flight)."""
    import gc

    from lp.model.gguf import trim_heap

    gc.collect()
    gc.freeze()
    trim_heap()


class _Phases:
    """Start-up progress on rank 0: a line as each phase begins and one with its seconds as it
    ends, then the total (``ready in``) once the server listens."""

    def __init__(self, rank: int):
        import time

        self.clock = time.perf_counter
        self.rank, self.t0 = rank, self.clock()

    def __call__(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def phase():
            t = self.clock()
            if self.rank == 0:
                log.info("[lp.serve] start-up: %s ...", name)
            yield
            release_memory()
            if self.rank == 0:
                log.info("[lp.serve] start-up: %s done in %.1f s (resident %s)", name, self.clock() - t, resident())

        return phase()

    def total(self) -> float:
        return self.clock() - self.t0


def model_id_of(cfg: ServeConfig) -> str:
    if cfg.server.model_id:
        return cfg.server.model_id
    if not cfg.model.path:
        return cfg.model.name
    p = Path(cfg.model.path)
    return p.stem if p.suffix == ".gguf" else p.name  # a GGUF file: its name without .gguf


def run(cfg: ServeConfig) -> int:
    """Load the model on every rank and serve until shutdown. Returns the exit status (0)."""
    from lp.config import chat_template_text
    from lp.generate import eos_ids
    from lp.model.runner import ModelRunner
    from lp.model.loader import resolve_model_path
    from lp.parallel.cpus import pin_worker
    from lp.parallel.tp import check_tp_path, load_for

    cfg.validate()
    _setup_logging()
    rank, world, _ = torchrun_env()
    phase = _Phases(rank)
    pin_worker(cfg.model.cpus, cfg.model.threads)  # before the first parallel region: OpenMP inherits it
    device = worker_device(cfg.model.device)
    group = init_worker_group(cfg.parallel, device)
    if rank != 0:  # a Ctrl-C reaches every rank: the workers wait for rank 0's SHUTDOWN instead
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path = resolve_model_path(cfg.model.name, cfg.model.path, cfg.model.cache_dir)
    check_tp_path(path, cfg.parallel.tp, cfg.model.quant)  # heads vs parallel.tp, before any weights load
    memory = _memory_plan(cfg, path, device)
    if rank == 0:
        for line in memory.lines():
            log.info("[lp.serve] %s", line)
    memory.check()  # before any weights load
    # the whole replica, or under parallel.tp > 1 only this rank's shards of it
    with phase(f"loading the model (model.quant={cfg.model.quant})"):
        model, tokenizer = load_for(path, cfg.model.dtype, str(device), cfg.model.quant, group)
    if tokenizer is None:
        raise ValueError(f"lp.serve needs a tokenizer in the model folder {path}")
    if cfg.model.chat_template is not None:  # the model's own replaced (model.chat_template)
        tokenizer.chat_template = chat_template_text(cfg.model.chat_template)
    with phase("preparing the runner (kernels, packed weights, head screen)"):
        runner = ModelRunner(model, cfg.model.attention, cfg.model.cuda_graphs, small_rows=cfg.model.small_rows,
                             linears=cfg.model.linears, compile=cfg.model.compile, fused=cfg.model.fused,
                             head=cfg.model.head)
    eos = eos_ids(model, tokenizer)
    if cfg.decoding.draft_budget == "auto":
        # the draft budget's t(Q) curve, measured now on every rank at once (once per machine,
        # then cached) rather than inside the first request
        from lp.model.calibrate import cache_path, row_cost_curve

        log.info("[lp.serve] rank %d: t(Q) for the draft budget: %s", rank, cache_path(runner))
        with phase("the t(Q) curve (measured once per machine and model, then read from its cache)"):
            row_cost_curve(runner)
    if runner.compiled:
        from lp.engine.batch import compile_batched_step

        log.info("[lp.serve] rank %d: model.compile=on: compiling the batched step (minutes the first time; "
                 "inductor caches its kernels on disk for the next start)", rank)
        log.info("[lp.serve] rank %d: compiled in %.0f s", rank, compile_batched_step(runner, cfg.server.max_prefill_tokens))
    with phase("the batched step's costs (measured once per machine and model, then cached)"):
        batch_cost = _batch_cost(cfg, runner, rank)  # after compiling: the costs of the step the server runs
    try:
        if group is not None:
            n_params = sum(p.numel() for p in model.parameters())
            RequestChannel(group).handshake([runner.vocab_size, runner.max_positions or -1, n_params, *eos[:4]])
    except WorkerFailure as e:
        log.error("[lp.serve] rank %d: %s; stopping this worker", rank, e)
        os._exit(3)
    if rank != 0:
        return _serve_worker(cfg, runner, tokenizer, eos, group, batch_cost)
    return _serve_http(cfg, runner, tokenizer, eos, group, model, memory, batch_cost, phase)


def _memory_plan(cfg: ServeConfig, path, device):
    """This rank's memory plan: weights, the paged pool (server.kv_tokens; with
    server.kv_memory_fraction the pool is sized after loading, and one longest request is
    planned instead), the largest batched step (a prefill chunk beside every sequence's decode
    rows)."""
    from lp.model.loader import resolve_dtype
    from lp.parallel.memory import decode_rows, plan_memory

    s = cfg.server
    pool = None if s.kv_memory_fraction is not None else s.kv_tokens
    rows = s.max_prefill_tokens + s.max_batch * decode_rows(cfg.decoding)
    return plan_memory(path, resolve_dtype(cfg.model.dtype, device), device, cfg.parallel.tp,
                       max_len=min(s.kv_tokens, s.max_tokens + s.max_prefill_tokens), step_rows=rows,
                       kv_tokens=pool, cuda_graphs=cfg.model.cuda_graphs, quant=cfg.model.quant)


def _batch_engine(cfg: ServeConfig, runner, group, batch_cost=None):
    """The batch engine every rank holds (its sizes from server.*; under LP a collective:
    every rank builds it at the same point, rank 0's t(Q) curve is shared)."""
    from lp.engine.batch import BatchEngine

    s = cfg.server
    return BatchEngine(runner, kv_tokens(cfg, runner, group), block_size=s.kv_block, max_batch=s.max_batch,
                       max_prefill_tokens=s.max_prefill_tokens, draft_store=_draft_store(cfg), group=group,
                       prefix_cache=s.prefix_cache, batch_cost=batch_cost)


def _batch_cost(cfg: ServeConfig, runner, rank: int):
    """The batched step's own costs for the draft budget (lp.engine.batch_cost: measured once per
    machine, then read from its cache), logged; None without the budget."""
    if cfg.decoding.draft_budget != "auto":
        return None
    from lp.engine.batch_cost import batch_step_cost, cache_path

    log.info("[lp.serve] rank %d: batched-step costs for the draft budget: %s", rank, cache_path(runner))
    cost = batch_step_cost(runner)
    log.info("[lp.serve] rank %d: %.2f ms a sequence, %.2f ms a drafting sequence", rank, 1e3 * cost.seq_s,
             1e3 * cost.draft_s)
    return cost


def kv_tokens(cfg: ServeConfig, runner, group) -> int:
    """The paged pool's slots: server.kv_tokens, or server.kv_memory_fraction of the GPU memory
    free now (the smallest across LP ranks, so every rank admits alike)."""
    s = cfg.server
    if s.kv_memory_fraction is None:
        return s.kv_tokens
    from lp.model.paged import kv_tokens_for_memory

    slots = kv_tokens_for_memory(runner.model.config, runner.dtype, runner.device, s.kv_memory_fraction)
    if group is not None:
        slots = group.min_int(slots)
    log.info("[lp.serve] server.kv_memory_fraction=%s: %d K/V slots", s.kv_memory_fraction, slots)
    return slots


def _serve_worker(cfg: ServeConfig, runner, tokenizer, eos, group, batch_cost=None) -> int:
    from lp.server.batched import worker_loop

    try:
        engine = _batch_engine(cfg, runner, group, batch_cost)
        engine.warm()  # with rank 0's (its step is collective): the K/V pool allocated before serving
        log.info("[lp.serve] rank %d ready, waiting for requests from rank 0", group.rank)
        worker_loop(engine, tokenizer, eos, cfg.decoding, group)
    except WorkerFailure as e:
        log.error("[lp.serve] rank %d: %s (rank 0 gone or silent for parallel.timeout_s=%gs); stopping this worker",
                  group.rank, e, cfg.parallel.timeout_s)
        os._exit(3)
    group.close()
    exit_process(0)


def _draft_store(cfg: ServeConfig):
    """The cross-request draft store (server.draft_store=true): every rank keeps its own,
    identical, copy (each adds the same outputs in the same order)."""
    from lp.drafts.suffix import DraftStore

    return DraftStore(cfg.decoding.draft_store_tokens) if cfg.server.draft_store else None


def _serve_http(cfg: ServeConfig, runner, tokenizer, eos, group, model, memory=None, batch_cost=None,
                phase: _Phases | None = None) -> int:
    import uvicorn

    from lp.server.app import create_app
    from lp.server.batched import BatchedEngine
    from lp.server.metrics import ServerMetrics
    from lp.server.protocol import ServingContext

    s = cfg.server
    world = group.lp_size if group is not None else 1  # LP workers (each a TP group of parallel.tp)
    heartbeat = min(s.heartbeat_s, cfg.parallel.timeout_s / 3)
    metrics = ServerMetrics(world, prefix_cache=s.prefix_cache)
    try:  # continuous batching (lp.engine.batch), under LP too: every rank holds the same batch
        engine = BatchedEngine(runner, tokenizer, eos, s.max_queue, s.max_batch, kv_tokens(cfg, runner, group),
                               s.max_prefill_tokens, metrics, draft_store=_draft_store(cfg), group=group,
                               heartbeat_s=heartbeat, prefix_cache=s.prefix_cache, batch_cost=batch_cost,
                               kv_block=s.kv_block)
        # the first request would otherwise pay the pool's allocation and the step's first-call
        # costs: one throwaway step now, on this thread (BatchedEngine.run's)
        with phase(f"warming the batched step (the K/V pool: {engine.batch.cache.kv_tokens} slots)") \
                if phase is not None else contextlib.nullcontext():
            engine.batch.warm()
    except WorkerFailure as e:
        log.error("[lp.serve] rank 0: worker failure: %s; stopping", e)
        os._exit(3)
    metrics.kv_blocks_total.set(engine.batch.cache.blocks.num_blocks)
    ctx = ServingContext(model_id_of(cfg), tokenizer, runner.vocab_size, runner.max_positions, cfg.decoding, s,
                         workers=world, memory=memory.as_dict() if memory is not None else None)
    app = create_app(engine, ctx, metrics, s.retry_after_s, api_key=s.api_key or os.environ.get("LP_API_KEY"))

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGINT/SIGTERM: also stop the running decode at its next step
            log.info("[lp.serve] signal %d: shutting down", sig)
            engine.request_stop()
            # not super(): uvicorn would re-raise the signal after shutdown (a traceback, no clean exit)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    server = _Server(uvicorn.Config(app, host=s.host, port=s.port, log_level=s.log_level, access_log=s.access_log,
                                    timeout_graceful_shutdown=5, lifespan="off"))
    engine.on_fatal = lambda: setattr(server, "should_exit", True)
    d = cfg.decoding
    log.info("[lp.serve] model %s loaded (%s, %s, quant %s), %d worker(s) x tp %d, W/N/G default %s/%s/%s; "
             "http://%s:%d%s", ctx.model_id, str(model.dtype).replace("torch.", ""), runner.device, runner.quant,
             world, cfg.parallel.tp, d.W, d.N, d.G, s.host, s.port,
             f"; ready {phase.total():.1f} s after start" if phase is not None else "")

    def http() -> None:
        try:
            server.run()
        finally:  # stopped (a signal, a fatal engine error) or never started (the port taken)
            engine.request_stop()

    # HTTP in a thread, decoding on this one: the thread that loaded and timed the model owns
    # torch's OpenMP pool (a second pool ran 30% slower: BatchedEngine.run)
    http_thread = threading.Thread(target=http, name="lp-http", daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    http_thread.start()
    try:
        engine.run()
    finally:
        server.should_exit = True
        http_thread.join(timeout=cfg.parallel.timeout_s)
    if engine.failed is not None:
        log.error("[lp.serve] stopped after a failure: %s", engine.failed)
        sys.stderr.flush()
        os._exit(3)
    if not server.started:
        log.error("[lp.serve] the HTTP server did not start (is port %d free?)", s.port)
        if group is not None:
            group.close()
        return 1
    if group is not None:
        group.close()
    log.info("[lp.serve] stopped")
    return 0


# ---------------------------------------------------------------------------
# Hydra entry point


SCHEMAS = {(None, "serve_schema"): ServeConfig, ("server", "server_schema"): ServerConfig, **cli.RUNTIME_SCHEMAS}


def main() -> None:
    cli.hydra_main("serve", SCHEMAS, run, cli.repo_conf_dir())


if __name__ == "__main__":
    main()
