"""A batched step's own costs beyond the one-sequence t(Q), measured once per machine and cached.

Contract: ``batch_step_cost(runner)`` returns a ``lp.drafts.select.BatchCost`` (seconds): the
joint draft budget of a batched step (``BatchEngine._propose``) adds ``seq_s`` per sequence
after the first and ``draft_s`` per sequence that verifies drafts to t(rows). The engine only
takes it (``BatchEngine(batch_cost=)``; lp.serve measures it at start-up and passes it):
measuring builds a BatchEngine of its own, so the engine cannot call it. Measured on
the batch engine's own forward: S sequences of a 128-token prompt (a 127-token prefix they share,
prefilled once through the prefix cache, and a last token each: their blocks past it their own), a step of one row each
(T1) and of two rows each (a one-node draft tree: T2), each the fastest of ``repeats``,
interleaved with the chain step's t(S) and t(2S) (lp.model.calibrate.measure) over ``rounds``
rounds, medians over the rounds:

    seq_s = (T1 - t(S)) / (S - 1)        draft_s = (T2 - T1 - (t(2S) - t(S))) / S

(each clamped at 0). Cached as JSON next to the t(Q) file (``-batch`` before its suffix), so
the same machine, model, threads and kernels read it back; a measurement taken while the
machine was busy is taken again on a later quiet call, and so is one older than the t(Q)
file (its curve measured again, lp.model.calibrate: this cost was taken at that moment too).
Measured on the 2-core EPYC of this project (SmolLM2 fp32, compiled, S = 8, twice): seq_s
0.75 / 0.79 ms and draft_s 0.78 / 0.73 ms, against a one-row step of ~20 ms and a t(Q) that
rises ~0.5 ms a row there: a sequence's first draft node costs ~2.5x what the curve alone says.
"""

from __future__ import annotations

import statistics
import time

import torch

from lp.config import DecodingConfig
from lp.drafts.select import BatchCost
from lp.engine.batch import BatchEngine, _Item
from lp.lookahead.layout import build_tree_layout
from lp.model import calibrate
from lp.kernels.head import argmax_rows

SEQS = 8
PREFIX = 128


def cache_path(runner):
    path = calibrate.cache_path(runner)
    return path.with_name(f"{path.stem}-batch{path.suffix}")


def batch_step_cost(runner, refresh: bool = False, rounds: int = 3) -> BatchCost:
    """The cached costs, measured on first use (a few seconds; see the module doc)."""
    path = cache_path(runner)
    cached = None
    saved = None if refresh else calibrate.read_cached(path)
    curve = calibrate.cache_path(runner)
    if saved is not None and curve.is_file() and curve.stat().st_mtime > path.stat().st_mtime:
        saved = None  # the curve was measured again after this
    if saved is not None:
        try:
            cached = BatchCost(float(saved["seq_s"]), float(saved["draft_s"]))
        except (KeyError, TypeError, ValueError):
            pass
    if calibrate.tp_all(runner.model, cached is not None):  # under TP the forwards are collective
        return cached
    load = calibrate._load()
    got = measure(runner, rounds)
    calibrate.write_cached(path, {"seq_s": got.seq_s, "draft_s": got.draft_s, "seqs": SEQS, "prefix": PREFIX}, load)
    return got


@torch.inference_mode()
def measure(runner, rounds: int = 3, repeats: int = 3, shared: bool = True) -> BatchCost:
    # a given curve: this engine never measures (it is the measurement)
    # one shared prompt prefix, computed once (the prefix cache), and a last token each: the steps
    # attend over a PREFIX-token cache each as before, without prefilling SEQS prompts (0.5B shape,
    # 2-vCPU AVX2 EPYC: ~10 s of a fresh start-up's 15-25 s here)
    engine = BatchEngine(runner, kv_tokens=SEQS * (PREFIX + 64), max_batch=SEQS, tq_curve=[(1, 1.0), (2, 1.0)],
                         prefix_cache=shared)
    vocab = runner.vocab_size
    for s in range(SEQS):
        prompt = [(97 * (0 if shared else s) + 31 * i) % (vocab - 3) + 3 for i in range(PREFIX - 1)] + [3 + s]
        engine.add(prompt, DecodingConfig(max_new_tokens=32, W=1, N=2, G=0))
    while engine.waiting or any(r.run.step == 0 for r in engine.running):
        engine.step()  # the prompts in, one token decoded each
    reqs = list(engine.running)
    assert len(reqs) == SEQS, len(reqs)

    def step(rows: int) -> float:
        items = []
        for r in reqs:
            it = _Item(r)
            it.layout = build_tree_layout([r.run.pending[-1]], [], range(0), [(3,)] if rows == 2 else [])
            items.append(it)
        engine.forward(items)  # warm; the rows are written at the same slots every time, never committed
        best = float("inf")
        for _ in range(repeats):  # the fastest, like t(Q): noise only ever adds time
            t0 = time.perf_counter()
            argmax_rows(engine.forward(items))  # with the step's device->host read
            best = min(best, time.perf_counter() - t0)
        return best

    seq, draft = [], []
    for _ in range(rounds):
        chain = dict(calibrate.measure(runner, (SEQS, 2 * SEQS), repeats)[0])
        t1, t2 = step(1), step(2)
        seq.append((t1 - chain[SEQS]) / (SEQS - 1))
        draft.append((t2 - t1 - (chain[2 * SEQS] - chain[SEQS])) / SEQS)
    return BatchCost(max(0.0, statistics.median(seq)), max(0.0, statistics.median(draft)))
