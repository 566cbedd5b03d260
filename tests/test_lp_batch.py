"""Lookahead Parallelism with batches: lp.engine.batch.BatchEngine on 2 gloo workers under torchrun.

A literal schedule of joins and aborts (tests.lp_batch_worker) with tree drafts
(drafts=suffix), the paper's window and pool (W5 N4 G5), prompts prefilled in chunks beside
the others' decode rows, requests that wait for room (max_batch), an abort while running,
one while waiting and one in the middle of a chunked prefill, and a sampled pair with
different prompts: every request's tokens under 2 workers equal the one-process batch's,
token for token, and the greedy ones equal transformers ``generate``. Under K/V pressure
(room for about two worst cases) with rank 0's admissions replayed by the other rank as
lp.serve does (RequestChannel, worker_loop): the same. The block table's invariants hold
after every step on every rank, freed blocks filled with NaN. Also: the step message rank 0
sends (joins, aborts, admissions) survives its int64 packing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lp.config import DecodingConfig
from lp.model.runner import ModelRunner
from lp.server.engine import pack_step, unpack_step
from tests.helpers import REPETITIVE_PROMPT, hf_greedy
from tests.lp_batch_worker import run_schedule

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "lp_batch_worker.py"

TREE = dict(drafts="suffix", draft_budget="all", W=2, N=3, G=3, window_policy="always", max_draft_rows=8)
POOL = dict(drafts="pool", W=5, N=4, G=5)
SAMPLED = dict(drafts="pool", W=3, N=3, G=3, do_sample=True, temperature=0.8, top_k=20)
REQUESTS = {
    "A": {"prompt": REPETITIVE_PROMPT, "decoding": dict(max_new_tokens=30, **TREE)},
    "B": {"prompt": [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], "decoding": dict(max_new_tokens=40, **POOL)},
    "C": {"prompt": list(range(10, 40)), "decoding": dict(max_new_tokens=20, **TREE)},
    "D": {"prompt": [9, 8, 7, 9, 8, 7, 9, 8, 100, 101, 9, 8], "decoding": dict(max_new_tokens=25, **POOL)},
    "E": {"prompt": [50, 51, 52, 53, 50, 51, 52], "decoding": dict(max_new_tokens=20, seed=7, **SAMPLED)},
    "F": {"prompt": [60, 61, 62, 63, 60, 61, 62], "decoding": dict(max_new_tokens=20, seed=8, **SAMPLED)},
    "G": {"prompt": [70, 71, 72, 70, 71, 72], "decoding": dict(max_new_tokens=20, **TREE)},
    "H": {"prompt": [(7 * i) % 120 + 1 for i in range(48)], "decoding": dict(max_new_tokens=20, **POOL)},
}
# A, B, E start; H joins at step 1 (its 48-token prompt fed in 16-row chunks beside the
# others' rows) and C at 2 (30 tokens, chunked after H's); F and G join at 3 and wait
# (max_batch=5); B is aborted at 4, F takes its slot, and G is aborted while still waiting;
# H is aborted at 5 in the middle of its prefill, and D joins into the slot it left. Every
# rank makes the same calls and decides alike (PRESSURE below: rank 0 decides, the other
# replays).
SCHEDULE = {0: [["join", "A"], ["join", "B"], ["join", "E"]], 1: [["join", "H"]], 2: [["join", "C"]],
            3: [["join", "F"], ["join", "G"]], 4: [["abort", "B"], ["abort", "G"]],
            5: [["abort", "H"], ["join", "D"]]}
SPEC = {"model": {"family": "llama"}, "requests": REQUESTS, "schedule": SCHEDULE,
        "engine": {"kv_tokens": 1024, "block_size": 8, "max_batch": 5, "max_prefill_tokens": 16},
        "tq_curve": [[1, 0.01], [16, 0.012], [64, 0.03]], "timeout_s": 120}


def torchrun(nproc: int, spec: dict, tmp_path: Path) -> dict:
    spec_file, out_file = tmp_path / "spec.json", tmp_path / "out.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), str(spec_file), str(out_file)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_file.read_text())


def check_schedule(model, one: dict, lp2: dict, requests: dict) -> None:
    """Every request's tokens under 2 workers == the one-process batch's; greedy ones that
    ran to the end == generate; nothing left in the pool."""
    for name in requests:
        got, want = lp2["requests"][name], one["requests"][name]
        for key in ("streamed", "output_ids", "finish", "aborted_in"):
            assert got[key] == want[key], (name, key)
        assert got["streamed"] == got["output_ids"] or got["output_ids"] is None, name
        assert (got["workers"], want["workers"]) in ((2, 1), (None, None)), name
        r = requests[name]
        if want["finish"] == "length" and not r["decoding"].get("do_sample"):
            assert want["output_ids"] == hf_greedy(model, r["prompt"], r["decoding"]["max_new_tokens"]), name
    assert lp2["blocks_in_use"] == one["blocks_in_use"] == 0
    assert lp2["steps"] == one["steps"]


@pytest.fixture(scope="module")
def lp2_schedules(tmp_path_factory):
    """SCHEDULE and PRESSURE (below) played under 2 workers, in one torchrun."""
    return torchrun(2, dict(SPEC, runs=[{}, PRESSURE]), tmp_path_factory.mktemp("lp_batch"))


@pytest.mark.slow
def test_lp_batch_schedule_equals_one_process_and_generate(tiny_factory, lp2_schedules):
    model = tiny_factory("llama")
    one = run_schedule(ModelRunner(model), SPEC)
    lp2 = lp2_schedules[0]
    check_schedule(model, one, lp2, REQUESTS)
    req = one["requests"]
    for name in "ACD":
        assert req[name]["finish"] == "length", name
        assert lp2["requests"][name]["steps"] < REQUESTS[name]["decoding"]["max_new_tokens"], f"{name}: no draft accepted"
    b = req["B"]
    assert b["finish"] == "cancelled" and b["aborted_in"] == ["decoding"] and 0 < len(b["output_ids"]) < 40
    assert b["output_ids"] == hf_greedy(model, REQUESTS["B"]["prompt"], 40)[: len(b["output_ids"])]
    # G was aborted before it started: no result, nothing streamed
    assert req["G"]["aborted_in"] == ["waiting"] and req["G"]["output_ids"] is None and req["G"]["streamed"] == []
    # H in the middle of its chunked prefill: some of its prompt fed, no token
    h = req["H"]
    assert h["aborted_in"][0] == "prefill" and 0 < h["aborted_in"][1] < len(REQUESTS["H"]["prompt"]), h
    assert (h["finish"], h["output_ids"], h["streamed"]) == ("cancelled", [], [])
    assert req["E"]["finish"] == req["F"]["finish"] == "length"


def _pressure_requests() -> dict:
    import random

    rng = random.Random(1)
    shapes = [dict(W=5, N=4, G=5), dict(W=3, N=3, G=3), dict(W=1, N=2, G=0), dict(W=4, N=4, G=4)]
    out = {}
    for i in range(8):
        d = dict(max_new_tokens=rng.randrange(12, 25), **shapes[i % 4])
        if i % 3 == 2:
            d.update(do_sample=True, temperature=0.8, top_k=20, seed=i)
        out[f"R{i}"] = {"prompt": [rng.randrange(1, 128) for _ in range(rng.randrange(6, 25))], "decoding": d}
    return out


# K/V room for about two worst cases (max_batch 4 never binds): rank 0 decides each
# admission when the pool has room and sends it with the step (the server's RequestChannel);
# the other rank replays it in lp.server.batched.worker_loop. R7 is aborted while it waits.
PRESSURE = dict(SPEC, requests=_pressure_requests(), channel=True,
                schedule={0: [["join", f"R{i}"] for i in range(6)], 2: [["join", "R6"], ["join", "R7"]],
                          3: [["abort", "R7"]]},
                engine={"kv_tokens": 200, "block_size": 8, "max_batch": 4, "max_prefill_tokens": 16})


@pytest.mark.slow
def test_lp_batch_under_kv_pressure_replays_rank0(tiny_factory, lp2_schedules):
    """Requests wait for K/V room, not for max_batch: under 2 workers, with rank 0's
    admissions replayed by the other rank as lp.serve does, every request's tokens equal the
    one-process batch's and the greedy ones equal generate; the block table holds after
    every step on every rank (the workers check it; freed blocks are filled with NaN)."""
    model = tiny_factory("llama")
    one = run_schedule(ModelRunner(model), PRESSURE)
    lp2 = lp2_schedules[1]
    check_schedule(model, one, lp2, PRESSURE["requests"])
    assert 2 <= one["most_running"] < PRESSURE["engine"]["max_batch"], one["most_running"]  # the pool binds
    assert one["requests"]["R7"]["aborted_in"] == ["waiting"] and one["requests"]["R7"]["output_ids"] is None
    assert all(r["finish"] == "length" for name, r in one["requests"].items() if name != "R7")


@pytest.mark.slow
def test_lp_generate_batch_offline_equals_generate(tiny_factory, tmp_path):
    """``generate_batch`` under 2 workers (every rank the same call; 4 requests, 2 at a time):
    the greedy ones equal generate, the sampled one equals its one-process run."""
    model = tiny_factory("llama")
    names = "ABDE"
    spec = dict(SPEC, requests={n: REQUESTS[n] for n in names}, generate_batch=True)
    got = torchrun(2, spec, tmp_path)
    for name in "ABD":
        r = REQUESTS[name]
        assert got[name] == hf_greedy(model, r["prompt"], r["decoding"]["max_new_tokens"]), name
    one = run_schedule(ModelRunner(model), dict(SPEC, requests={"E": REQUESTS["E"]}, schedule={0: [["join", "E"]]}))
    assert got["E"] == one["requests"]["E"]["output_ids"]


def test_step_message_round_trip():
    base = DecodingConfig(max_new_tokens=99)
    joins = [(3, [1, 2, 3], DecodingConfig(max_new_tokens=5, W=5, N=4, G=5, stop_strings=["é\n"])),
             (7, [9], DecodingConfig(max_new_tokens=8, do_sample=True, temperature=0.5, seed=11,
                                     logit_bias={4: -2.5})),
             # logprobs, and a completions echo's prompt logprobs / prompt-only (max_tokens 0) job
             (8, [4, 5], DecodingConfig(logprobs=True, top_logprobs=4), 3, True),
             (9, [6], DecodingConfig(logprobs=True), 0, False)]
    fields, payload = pack_step(joins, [1, 2], [3, 7], True, [32, 0])
    got_joins, aborts, admits, cached, run = unpack_step(fields, payload, base)
    assert (aborts, admits, cached, run) == ([1, 2], [3, 7], [32, 0], True)
    assert [(rid, p) for rid, p, *_ in got_joins] == [(3, [1, 2, 3]), (7, [9]), (8, [4, 5]), (9, [6])]
    for (_, _, want, *extra), (_, _, got, *_), join in zip(joins, got_joins, got_joins):
        assert got == want
        assert (join.prompt_logprobs, join.prompt_only) == (tuple(extra) or (None, False))
    assert unpack_step(*pack_step([], [], [], False), base) == ([], [], [], [], False)
