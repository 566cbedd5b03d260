"""t(Q) calibration: the measured cost of one packed forward over Q rows, cached per machine.

Contract: ``row_cost_curve(runner)`` returns [(Q, seconds)] for a few Q after a
128-token prefix, measured once (a few seconds) and cached as JSON under
``$LP_CACHE/tq/<model>-<device>-<dtype>-t<threads>.json`` (``LP_CACHE`` defaults to
~/.cache/lp); later calls read the file. A curve measured while the machine was busy
(1-minute load average above the core count) is measured again on the first call that
finds the machine quiet. The draft budget (lp.budget) takes the curve
as a plain argument, so nothing else here depends on timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

QS = (1, 2, 4, 8, 16, 32)
PREFIX = 128


def cache_path(runner) -> Path:
    from lp.model import default_cache_dir

    cfg = runner.model.config
    blob = cfg.to_json_string(use_diff=False) if hasattr(cfg, "to_json_string") else repr(cfg)
    digest = hashlib.sha1(blob.encode()).hexdigest()[:12]
    dtype = str(runner.dtype).replace("torch.", "")
    name = f"{digest}-{runner.device.type}-{dtype}-t{torch.get_num_threads()}-{runner.attention}.json"
    return default_cache_dir() / "tq" / name


def row_cost_curve(runner, qs=QS, repeats: int = 5, refresh: bool = False) -> list[tuple[int, float]]:
    path = cache_path(runner)
    cores = os.cpu_count() or 1
    if path.is_file() and not refresh:
        try:
            saved = json.loads(path.read_text())
            if not (saved.get("busy") and _load() < 0.75 * cores):
                return [(int(q), float(t)) for q, t in saved["curve"]]
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    load = _load()
    curve = measure(runner, qs, repeats)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{time.time_ns()}.tmp")
    busy = max(load, _load()) > cores
    tmp.write_text(json.dumps({"curve": curve, "prefix": PREFIX, "repeats": repeats, "loadavg": load, "busy": busy}))
    tmp.replace(path)
    return curve


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def measure(runner, qs=QS, repeats: int = 5) -> list[tuple[int, float]]:
    """Fastest forward time of ``repeats`` per Q, after one warm-up round, on a PREFIX-token cache."""
    from lp.layout import chain_layout

    limit = runner.max_positions or 4096
    prefix = min(PREFIX, max(limit - max(qs) - 1, 1))
    qs = [q for q in qs if prefix + q <= limit]
    gen = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    cache = runner.new_cache(prefix + max(qs), max(qs))
    runner.forward(chain_layout(torch.randint(vocab, (prefix,), generator=gen).tolist()), cache)
    # repeats interleaved over Q (a busy machine slows every Q alike), the minimum kept
    # (noise only ever adds time)
    rows = {q: torch.randint(vocab, (q,), generator=gen).tolist() for q in qs}
    best = {q: float("inf") for q in qs}
    for i in range(repeats + 1):
        for q in qs:
            t0 = time.perf_counter()
            logits = runner.forward(chain_layout(rows[q]), cache)
            logits.argmax(-1).tolist()  # the step's device->host read
            dt = time.perf_counter() - t0
            runner.crop(cache, prefix)
            if i:
                best[q] = min(best[q], dt)
    curve = [(q, best[q]) for q in qs]
    # cost never falls with more rows (noise): make the curve monotone
    for i in range(1, len(curve)):
        if curve[i][1] < curve[i - 1][1]:
            curve[i] = (curve[i][0], curve[i - 1][1])
    return curve
