"""t(Q) calibration: the measured cost of one packed forward over Q rows, cached per machine.

Contract: ``row_cost_curve(runner)`` returns [(Q, seconds)] for every Q up to 16 and a few
above, after a 128-token prefix, measured once (~10 s on a 2-core CPU) and cached as JSON under
``$LP_CACHE/tq/<model (its config, and a GGUF file's name and size)>-<device>-<dtype>-t<threads>-<attention>-small<mode>-lin<linears>[-compiled][-fused][-<quant>]-<version>.json`` (``LP_CACHE`` defaults to
~/.cache/lp); later calls read the file. A curve measured while the machine was busy
(1-minute load average above the core count) is measured again on the first call that
finds the machine quiet. The load average lags (a build that starts with the measurement
is missed), so a read also re-times t(1) (~0.3 s: the prefix and six one-row forwards):
a cached t(1) more than ``STALE`` times the one timed now (and 2 ms more) was measured at a
slower moment, and the whole curve is measured again (once per file and process: later reads
in the same process trust it). The draft budget (lp.drafts.budget) takes the curve
as a plain argument, so nothing else here depends on timing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from lp.kernels.head import argmax_rows

# every size up to 16 (small sizes are where a BLAS switches kernels), then coarser
QS = tuple(range(1, 17)) + (20, 24, 28, 32, 48, 64)
PREFIX = 128
VERSION = "v14"  # bumped when QS, the measurement or a kernel it prices changes: older files are not read
# sizes past 16 rows whose warm-up step took above CAP x t(1) are left out of the curve (the draft
# budget extrapolates it: lp.drafts.budget.cost): no draft pays for them, and on a 0.5B model on a
# 2-vCPU AVX2 EPYC the 20- to 64-row steps (10-22 x t(1)) were 40% of a first start's t(Q) time
CAP = 8.0
# a cached t(1) above STALE x (and STALE_MIN_S above) the one timed at start-up: measured too slow
STALE, STALE_MIN_S = 1.3, 0.002

log = logging.getLogger(__name__)
_probed: set[Path] = set()  # cache files re-timed in this process (each rank re-times the same ones)


def cache_path(runner) -> Path:
    from lp.model.loader import default_cache_dir

    digest = cache_key(runner.model)
    dtype = str(runner.dtype).replace("torch.", "")
    tp = tp_degree(runner.model)  # a TP step (all-reduces included) is not a one-device step
    name = (f"{digest}-{runner.device.type}-{dtype}-t{torch.get_num_threads()}{f'-tp{tp}' if tp > 1 else ''}"
            f"-{runner.attention}"
            f"-small{runner.small_rows_mode}-lin{runner.linears}{'-compiled' if runner.compiled else ''}"
            f"{'-fused' if getattr(runner, 'fused', None) is not None else ''}"
            f"{_quant_tag(runner)}-{VERSION}.json")
    return default_cache_dir() / "tq" / name


def cache_key(model) -> str:
    """The model's part of its cache file name: a digest of its config, every field but where it was
    read from (``_name_or_path``: a GGUF file's parsed config and its kept copy under ``$LP_CACHE/gguf``
    name different folders, so a restart would measure again) and the stored dtype and version (the
    file name carries the runner's dtype), and of a GGUF file's name and size (its block formats
    change the kernels a step runs: one curve per file)."""
    cfg = model.config
    if hasattr(cfg, "to_dict"):
        blob = json.dumps({k: v for k, v in cfg.to_dict().items() if k not in VOLATILE}, sort_keys=True, default=str)
    else:
        blob = repr(cfg)
    blob += getattr(model, "_lp_gguf_id", "")
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


VOLATILE = ("_name_or_path", "dtype", "torch_dtype", "transformers_version")


def _quant_tag(runner) -> str:
    """``-int8`` / ``-int4`` for a quantized model (lp.model.quant): curves of different quants never mix."""
    return "" if runner.quant == "none" else f"-{runner.quant}"


def row_cost_curve(runner, qs=QS, repeats: int = 3, refresh: bool = False, probe: bool = True
                   ) -> list[tuple[int, float]]:
    """The curve (cached); with ``model.small_rows=auto`` it also sets ``runner.small_rows``
    to the row counts that ran faster with small-row matmuls (lp.kernels.linears). ``probe``:
    a cached curve whose t(1) is stale against a re-time now is measured again."""
    path = cache_path(runner)
    cached = None
    saved = None if refresh else read_cached(path)
    if saved is not None:
        try:
            cached = ([(int(q), float(t)) for q, t in saved["curve"]],
                      frozenset(int(q) for q in saved["small_rows"]))
        except (KeyError, TypeError, ValueError):
            pass
    # under TP the forwards are collective: the worker's tp ranks read or measure together
    if tp_all(runner.model, cached is not None):
        if runner.small_rows_mode == "auto":
            runner.small_rows = cached[1]
        # under TP the re-time is collective too, and every rank keeps the curve or none does
        if not probe or path in _probed or tp_all(runner.model, not _stale(runner, cached[0], path)):
            return cached[0]
    load = _load()
    curve, small = measure(runner, qs, repeats)
    if runner.small_rows_mode == "auto":
        runner.small_rows = small
    write_cached(path, {"curve": curve, "small_rows": sorted(small), "prefix": PREFIX, "repeats": repeats}, load)
    _probed.add(path)
    return curve


def _stale(runner, curve: list[tuple[int, float]], path: Path) -> bool:
    """Whether the cached ``curve`` was measured at a slower moment than now: its t(1)
    against the fastest of a few one-row forwards timed now (module doc)."""
    cached = dict(curve).get(1)
    _probed.add(path)
    if cached is None:
        return False
    now = dict(measure(runner, (1,), repeats=5)[0])[1]
    stale = cached > STALE * now and cached - now > STALE_MIN_S
    if stale:
        log.info("t(Q) cache %s: its t(1) %.1f ms against %.1f ms timed now; measuring the curve again",
                 path.name, 1e3 * cached, 1e3 * now)
    return stale


def read_cached(path: Path) -> dict | None:
    """A cached measurement's JSON object; None when absent, unreadable, or taken while the
    machine was busy and it is quiet now (then it is measured again)."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except ValueError:
        return None
    if not isinstance(saved, dict) or (saved.get("busy") and _load() < 0.75 * (os.cpu_count() or 1)):
        return None
    return saved


def write_cached(path: Path, payload: dict, load: float) -> None:
    """Write a measurement atomically, with the load average before it (``load``) and whether
    the machine was busy during it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{time.time_ns()}.tmp")
    busy = max(load, _load()) > (os.cpu_count() or 1)
    tmp.write_text(json.dumps({**payload, "loadavg": load, "busy": busy}))
    tmp.replace(path)


def tp_degree(model) -> int:
    """The tensor-parallel degree lp.parallel.tp sharded ``model`` with (1: not sharded)."""
    return getattr(model, "_lp_tp", 1)


def tp_all(model, flag: bool) -> bool:
    """True on every tp rank of this worker iff ``flag`` is true on all of them: the
    agreement lp.parallel.tp installed on a sharded model (``flag`` unchanged without TP)."""
    agree = getattr(model, "_lp_tp_all", None)
    return flag if agree is None else agree(flag)


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def measure(runner, qs=QS, repeats: int = 3) -> tuple[list[tuple[int, float]], frozenset[int]]:
    """Fastest forward time of ``repeats`` per Q, after one warm-up round, on a PREFIX-token
    cache; with ``runner.small_rows_mode == "auto"`` each Q is timed both ways and
    keeps the faster (the returned set: the Q where small-row matmuls won)."""
    from lp.lookahead.layout import chain_layout

    limit = runner.max_positions or 4096
    prefix = min(PREFIX, max(limit - max(qs) - 1, 1))
    qs = [q for q in qs if prefix + q <= limit]
    gen = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    cache = runner.new_cache(prefix + max(qs), max(qs))
    runner.forward(chain_layout(torch.randint(vocab, (prefix,), generator=gen).tolist()), cache)
    # the minimum of the repeats kept (noise only ever adds time)
    rows = {q: torch.randint(vocab, (q,), generator=gen).tolist() for q in qs}
    both = runner.small_rows_mode == "auto"
    kept = runner.small_rows
    variants = [(q, v) for q in qs for v in ((False, True) if both else (None,))]
    best = {qv: float("inf") for qv in variants}
    # repeats interleaved over Q (a busy machine slows every Q alike), first over the steps whose
    # logits (Q x vocab floats) take at most 8 MiB, then over the larger ones: after a step with large
    # buffers glibc hands memory back to the OS and the next steps run slow; interleaved with the 9- to
    # 64-row steps, Gemma-3-270M's one-row step (its 262,144-token head, a 2-vCPU AVX2 EPYC) timed
    # 25-36 ms against 20.7-24.6 among 1-8 rows, and an inflated t(1) made every draft row look cheap
    small_steps = [qv for qv in variants if qv[0] * vocab * 4 <= 8 << 20]
    warm: dict = {}
    try:
        for group in (small_steps, [qv for qv in variants if qv not in small_steps]):
            for i in range(repeats + 1):
                if i == 1 and warm:  # past 16 rows, sizes the warm-up round put above CAP x t(1) are not timed
                    one = min(t for (q, _), t in warm.items() if q == min(qs))
                    # under TP the forwards are collective: a size is timed where every tp rank's own
                    # warm-up keeps it (each rank asks in the same order), else a rank that skips it
                    # meets its peers' forward of it with its next one (a gloo size mismatch, an abort)
                    group = [qv for qv in group if qv[0] <= 16 or tp_all(runner.model, warm[qv] <= CAP * one)]
                for q, v in group:
                    if v is not None:
                        runner.small_rows = frozenset([q]) if v else frozenset()
                    t0 = time.perf_counter()
                    logits = runner.forward(chain_layout(rows[q]), cache)
                    argmax_rows(logits)  # the step's device->host read
                    dt = time.perf_counter() - t0
                    runner.crop(cache, prefix)
                    if i:
                        best[(q, v)] = min(best[(q, v)], dt)
                    else:
                        warm[(q, v)] = dt
    finally:
        runner.small_rows = kept
    qs = [q for q in qs if any(best[qv] < float("inf") for qv in variants if qv[0] == q)]
    # kept as measured, not made monotone: a BLAS can run 2-3 rows slower than 4-8
    # (lp.drafts.budget.envelope prices a step at the cheapest size at or above it)
    curve, small = [], set()
    for q in qs:
        if both:
            fast = best[(q, True)] < best[(q, False)]
            curve.append((q, best[(q, fast)]))
            if fast:
                small.add(q)
        else:
            curve.append((q, best[(q, None)]))
    return curve, frozenset(small)
