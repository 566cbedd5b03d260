"""Worker core placement (lp.parallel.cpus, model.cpus): literal core lists, and the real
affinity of a process that pins itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lp.config import ModelConfig
from lp.parallel.cpus import choose_cores, parse_cores


def test_core_lists_parse():
    assert parse_cores("0-3") == [0, 1, 2, 3]
    assert parse_cores("4,0-1") == [0, 1, 4]
    for bad in ("x", "3-1", "-1", "0-", ""):
        with pytest.raises(ValueError, match="model.cpus must be auto, off or a core list"):
            parse_cores(bad)
    with pytest.raises(ValueError, match="model.cpus"):
        ModelConfig(cpus="all").validate()


def test_auto_gives_colocated_workers_disjoint_slices():
    allowed = [0, 1, 2, 3, 4, 5, 6, 7]
    slices = [choose_cores("auto", 0, r, 4, allowed) for r in range(4)]
    assert slices == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [choose_cores("auto", 3, r, 2, allowed) for r in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert choose_cores("auto", 0, 0, 1, allowed) is None  # one process: the OS's placement
    assert choose_cores("auto", 4, 1, 2, [0, 1, 2, 3, 4]) is None  # not enough cores: no pinning
    assert choose_cores("off", 0, 1, 4, allowed) is None
    assert choose_cores("2-3", 0, 0, 1, allowed) == [2, 3]
    with pytest.raises(ValueError, match=r"names cores \[9\]"):
        choose_cores("8-9", 0, 0, 1, [0, 8])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_a_pinned_worker_and_its_openmp_threads_run_on_its_slice():
    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os, torch; from lp.parallel.cpus import pin_worker; "
            "cores = pin_worker('auto', 0); torch.ones(256, 256) @ torch.ones(256, 256); "
            "print(cores, sorted(os.sched_getaffinity(0)), torch.get_num_threads())")
    out = []
    for rank in range(2):
        env = dict(os.environ, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        out.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                  check=True).stdout.strip())
    if len(allowed) >= 2:  # each rank: the cores chosen, the affinity the process has, its thread count
        half = len(allowed) // 2
        mine = [allowed[:half], allowed[half:2 * half]]
        assert out == [f"{c} {c} {half}" for c in mine]
