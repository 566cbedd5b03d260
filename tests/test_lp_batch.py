"""Lookahead Parallelism with batches: lp.engine.batch.BatchEngine on 2 gloo workers under torchrun.

A literal schedule of joins and aborts (tests.lp_batch_worker) with tree drafts
(drafts=suffix), the paper's window and pool (W5 N4 G5), a prompt prefilled in chunks beside
the others' decode rows, a request that waits for room (max_batch) and a sampled pair: every
request's tokens under 2 workers equal the one-process batch's, token for token, and the
greedy ones equal transformers ``generate``. Also: the step message rank 0 sends (joins,
aborts, admissions) survives its int64 packing.
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
    "F": {"prompt": [50, 51, 52, 53, 50, 51, 52], "decoding": dict(max_new_tokens=20, seed=8, **SAMPLED)},
}
# A, B, E start; C joins at step 2 (its 30-token prompt in 16-row chunks beside the decode
# rows); F joins at 3 and waits (max_batch=4) until B is aborted at 4; D joins at 5 and waits
# for the first to finish. Rank 0 decides every admission, the other rank replays it.
SCHEDULE = {0: [["join", "A"], ["join", "B"], ["join", "E"]], 2: [["join", "C"]], 3: [["join", "F"]],
            4: [["abort", "B"]], 5: [["join", "D"]]}
SPEC = {"model": {"family": "llama"}, "requests": REQUESTS, "schedule": SCHEDULE,
        "engine": {"kv_tokens": 1024, "block_size": 8, "max_batch": 4, "max_prefill_tokens": 16},
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


@pytest.mark.slow
def test_lp_batch_schedule_equals_one_process_and_generate(tiny_factory, tmp_path):
    model = tiny_factory("llama")
    one = run_schedule(ModelRunner(model), SPEC)
    lp2 = torchrun(2, SPEC, tmp_path)
    for name in REQUESTS:
        got, want = lp2["requests"][name], one["requests"][name]
        assert got["streamed"] == want["streamed"] == want["output_ids"] == got["output_ids"], name
        assert got["finish"] == want["finish"], name
        assert got["workers"] == 2 and want["workers"] == 1
    for name in "ACD":
        r = REQUESTS[name]
        assert one["requests"][name]["output_ids"] == hf_greedy(model, r["prompt"], r["decoding"]["max_new_tokens"])
        assert lp2["requests"][name]["steps"] < r["decoding"]["max_new_tokens"], f"{name}: no draft accepted"
    b = one["requests"]["B"]
    assert b["finish"] == "cancelled" and 0 < len(b["output_ids"]) < 40
    assert b["output_ids"] == hf_greedy(model, REQUESTS["B"]["prompt"], 40)[: len(b["output_ids"])]
    assert one["requests"]["E"]["output_ids"] != one["requests"]["F"]["output_ids"]
    assert lp2["blocks_in_use"] == one["blocks_in_use"] == 0
    assert lp2["steps"] == one["steps"]


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
                                     logit_bias={4: -2.5}))]
    fields, payload = pack_step(joins, [1, 2], [3], True)
    got_joins, aborts, admits, run = unpack_step(fields, payload, base)
    assert (aborts, admits, run) == ([1, 2], [3], True)
    assert [(rid, p) for rid, p, _ in got_joins] == [(3, [1, 2, 3]), (7, [9])]
    for (_, _, want), (_, _, got) in zip(joins, got_joins):
        assert got == want
    assert unpack_step(*pack_step([], [], [], False), base) == ([], [], [], False)
