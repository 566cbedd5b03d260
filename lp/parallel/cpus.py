"""Which CPU cores a worker computes on (``model.cpus``), set before its first parallel region.

Contract: ``pin_worker(spec, threads)`` sets this process's CPU affinity and torch's intra-op
thread count, and returns the cores chosen (None when left alone). The calling (main) thread
is pinned before the OpenMP pool exists, so the pool's threads inherit the set; threads
started later (the HTTP server's, the tokenizer's) inherit it too.

* ``auto``: under torchrun with several workers on one machine (LOCAL_WORLD_SIZE > 1), local
  worker i takes the i-th slice of ``threads`` cores (``threads`` 0: the allowed cores divided
  evenly) of the cores this process may run on, so co-located workers never share a core;
  one process alone keeps the OS's placement (pinning a lone process to every allowed core
  changes nothing).
* ``off``: leave affinity to the OS.
* a list such as ``0-3`` or ``0,2,4``: exactly these cores (every local worker alike: for
  one process per machine, or a launcher that sets it per worker).

Measured on this project's 2-core EPYC (bench/results/step_cost): SmolLM2's one-row step
costs less with 2 threads than with 1, so one process takes both cores (``model.threads=0``).
"""

from __future__ import annotations

import os

import torch


def parse_cores(spec: str) -> list[int]:
    """``"0-3"`` / ``"0,2,4"`` / ``"0-1,4"`` -> sorted cores; ValueError naming model.cpus."""
    cores: set[int] = set()
    try:
        for part in str(spec).split(","):
            lo, dash, hi = part.strip().partition("-")
            a, b = int(lo), int(hi if dash else lo)
            if a < 0 or b < a:
                raise ValueError
            cores.update(range(a, b + 1))
    except ValueError:
        raise ValueError(f"model.cpus must be auto, off or a core list such as 0-3 or 0,2; got {spec!r}") from None
    return sorted(cores)


def choose_cores(spec: str, threads: int, local_rank: int, local_world: int, allowed: list[int]) -> list[int] | None:
    """The cores a worker takes (pure: tested with literal lists)."""
    if spec == "off":
        return None
    if spec == "auto":
        if local_world <= 1:
            return None
        per = threads or max(1, len(allowed) // local_world)
        cores = allowed[local_rank * per : (local_rank + 1) * per]
        return cores if len(cores) == per else None  # more threads than cores: the OS shares them
    cores = parse_cores(spec)
    outside = [c for c in cores if c not in allowed]
    if outside:
        raise ValueError(f"model.cpus={spec!r} names cores {outside} this process may not run on "
                         f"(allowed: {allowed})")
    return cores


def pin_worker(spec: str, threads: int) -> list[int] | None:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if not hasattr(os, "sched_setaffinity"):
        cores = None
    else:
        cores = choose_cores(spec, threads, local_rank, local_world, sorted(os.sched_getaffinity(0)))
        if cores is not None:
            os.sched_setaffinity(0, cores)
    if threads:
        torch.set_num_threads(threads)
    elif cores is not None:
        torch.set_num_threads(len(cores))
    return cores
