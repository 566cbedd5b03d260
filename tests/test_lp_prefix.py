"""Automatic prefix caching under Lookahead Parallelism: 2 gloo workers under torchrun.

Rank 0 decides each step's admissions and the prefix-cache hit of each (lp.engine.batch
``cached_rows``); both ride the step message (lp.server.engine ``pack_step``) and the other
rank replays them in lp.server.batched ``worker_loop``, checking that its own identical block
tables hit the same rows. The literal schedule (tests.lp_batch_worker) has requests sharing a
long system prompt: two join while the first one decodes (hits on blocks it still holds), two
more after it left (hits on evictable blocks), one sampled, and a pool small enough that
cached blocks are evicted while later requests still hit. Every request's tokens under 2
workers with the cache equal the one-process batch's without it, token for token, and the
greedy ones equal transformers ``generate``; the hits really happened (cached rows > 0 and the
same on both sides, evictions > 0) and the block tables hold on every rank after every step.
"""

from __future__ import annotations

import pytest

from lp.model.runner import ModelRunner
from tests.helpers import hf_greedy
from tests.lp_batch_worker import run_schedule
from tests.test_lp_batch import torchrun

SYSTEM = [(11 * i) % 120 + 3 for i in range(40)]  # a 40-token "system prompt": 5 blocks of 8
# rank 0's step message carries only the per-request fields lp.server.engine.pack_request packs
# (W, N, G, sampling, window_policy, ...); drafts come from the spec's "base", like a server's
TREE = dict(W=5, N=4, G=5, window_policy="always")
POOL = dict(W=3, N=3, G=3)
REQUESTS = {
    "A": {"prompt": SYSTEM + [1, 2, 3], "decoding": dict(max_new_tokens=16, **TREE)},
    "B": {"prompt": SYSTEM + [4, 5], "decoding": dict(max_new_tokens=16, **POOL)},
    "C": {"prompt": SYSTEM + [6], "decoding": dict(max_new_tokens=12, do_sample=True, temperature=0.8,
                                                   top_k=20, seed=3, **POOL)},
    "X": {"prompt": [(7 * i) % 110 + 9 for i in range(44)], "decoding": dict(max_new_tokens=16, **POOL)},
    "D": {"prompt": SYSTEM + [1, 2, 3, 7, 8, 9, 10, 11, 12], "decoding": dict(max_new_tokens=16, **TREE)},
    "E": {"prompt": SYSTEM + [13], "decoding": dict(max_new_tokens=12, **POOL)},
}
# A alone; B and C join while A decodes (hits on A's held blocks); X (no shared prefix) and
# D join later, E last: the pool holds about two worst cases, so X's and the later
# requests' reservations evict cached blocks while D and E still hit the system prompt.
SCHEDULE = {0: [["join", "A"]], 4: [["join", "B"], ["join", "C"]], 8: [["join", "X"], ["join", "D"]],
            14: [["join", "E"]]}
PREFIX = {"model": {"family": "llama"}, "base": {"drafts": "pool"}, "requests": REQUESTS, "schedule": SCHEDULE, "channel": True,
          "engine": {"kv_tokens": 160, "block_size": 8, "max_batch": 3, "max_prefill_tokens": 16,
                     "prefix_cache": True},
          "tq_curve": [[1, 0.01], [16, 0.012], [64, 0.03]], "timeout_s": 120}
OFFLINE = dict(PREFIX, channel=False)  # every rank makes the same calls and decides alike


@pytest.fixture(scope="module")
def lp2_prefix(tmp_path_factory):
    """PREFIX (rank 0 decides, the other replays) and OFFLINE under 2 workers, one torchrun."""
    return torchrun(2, dict(PREFIX, runs=[{}, OFFLINE]), tmp_path_factory.mktemp("lp_prefix"))


@pytest.mark.parametrize("run", [0, 1], ids=["rank0_decides", "every_rank_decides"])
def test_lp_prefix_cache_equals_cache_off_and_generate(tiny_factory, lp2_prefix, run):
    model = tiny_factory("llama")
    lp2 = lp2_prefix[run]
    cold = run_schedule(ModelRunner(model), dict(PREFIX, engine=dict(PREFIX["engine"], prefix_cache=False)))
    warm = run_schedule(ModelRunner(model), PREFIX)  # one process with the cache
    for name, r in REQUESTS.items():
        got, want = lp2["requests"][name], cold["requests"][name]
        assert got["finish"] == want["finish"] == "length", name
        assert got["output_ids"] == got["streamed"] == want["output_ids"], name
        assert got["workers"] == 2, name
        if not r["decoding"].get("do_sample"):
            assert got["output_ids"] == hf_greedy(model, r["prompt"], r["decoding"]["max_new_tokens"]), name
        # the hits happened, the same under LP as in one process: the system prompt's 5 blocks
        want_hit = 0 if name in ("A", "X") else len(SYSTEM)
        assert got["cached"] == warm["requests"][name]["cached"] == want_hit, name
        assert want["cached"] == 0, name
    assert lp2["hit_blocks"] == warm["hit_blocks"] == 4 * len(SYSTEM) // 8
    # the pool evicted cached blocks while hits were served (how many depends on when requests
    # finish: 2 workers accept more per step than one process)
    assert lp2["evictions"] > 0 and warm["evictions"] > 0
    assert lp2["blocks_in_use"] == 0
