"""Worker script for the LP batch tests: ``torchrun --nproc-per-node K tests/lp_batch_worker.py SPEC.json OUT.json``.

Every rank builds the same tiny random model (tests.helpers.make_tiny_model, spec "model")
and one ``lp.engine.batch.BatchEngine`` on the torchrun worker group (or none when started without
torchrun), then plays the spec's literal schedule of joins and aborts (``run_schedule``,
which the tests also call in one process): ``schedule[step]`` lists ["join", name] /
["abort", name] done before that step. A request's settings are the spec's "base"
decoding fields (if any) updated by its own. After every step the block table's invariants
hold (tests.helpers.assert_block_invariants) and freed blocks are filled with NaN. Rank 0
writes, per request name, the tokens the steps streamed, the final output ids and finish
reason (None for a request aborted before it started), where it was when aborted
("waiting", "prefill" with the prompt rows fed, or "decoding"), the prompt rows it found in
the prefix cache (spec engine "prefix_cache": true), and the blocks left in use, the
prefix-cache hit blocks and evictions at the end.

Spec "channel": the server's way (lp.server.batched) instead of every rank deciding
alike: rank 0 alone plays the schedule and decides each step's admissions, and sends
the step's joins, aborts and admissions (with rank 0's prefix-cache hits) through ``lp.parallel.dist.RequestChannel``
(``lp.server.engine.pack_step``); the other ranks run ``lp.server.batched.worker_loop``,
which replays them (only the fields pack_request carries may differ per request).

Spec "runs": a list of specs (each updating this one) played one after the other in the
same processes; rank 0 writes the list of their results.

Spec "generate_batch": instead, every rank calls ``lp.engine.batch.generate_batch`` on the
requests (max_batch 2); rank 0 writes each one's output ids.
"""

import faulthandler
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp.engine.batch import BatchEngine  # noqa: E402
from lp.config import DecodingConfig, ParallelConfig  # noqa: E402
from lp.model.runner import ModelRunner  # noqa: E402


def decoding(spec: dict, name: str) -> DecodingConfig:
    """Request ``name``'s settings: the spec's "base" fields, then its own."""
    return DecodingConfig(**{**spec.get("base", {}), **spec["requests"][name]["decoding"]})


def _where(engine: BatchEngine, rid: int) -> list:
    """Where request ``rid`` is before an abort: ["waiting"], ["prefill", prompt rows fed], ["decoding"]."""
    if any(r.id == rid for r in engine.waiting):
        return ["waiting"]
    req = next(r for r in engine.running if r.id == rid)
    if req.run.step == 0:
        return ["prefill", engine.cache.blocks.lengths[rid]]
    return ["decoding"]


def run_schedule(runner: ModelRunner, spec: dict, group=None) -> dict:
    """Play ``spec`` (requests, schedule, engine sizes) on one BatchEngine; -> results by name.
    Under a group with spec "channel", rank 0 decides and sends (the ranks >= 1 run
    ``lp.server.batched.worker_loop`` and return None)."""
    from lp.parallel.dist import RequestChannel
    from lp.server.engine import pack_step
    from tests.helpers import assert_block_invariants

    e = spec["engine"]
    engine = BatchEngine(runner, e["kv_tokens"], block_size=e["block_size"], max_batch=e["max_batch"],
                         max_prefill_tokens=e["max_prefill_tokens"], tq_curve=[tuple(p) for p in spec["tq_curve"]],
                         group=group, prefix_cache=e.get("prefix_cache", False))
    engine.cache.poison_released()
    channel = None
    if group is not None and spec.get("channel"):
        if group.rank != 0:
            from lp.server.batched import worker_loop

            worker_loop(engine, None, [], DecodingConfig(**spec.get("base", {})), group)
            assert engine.blocks_in_use == 0 and not engine.has_work
            assert_block_invariants(engine.cache.blocks)
            return None
        channel = RequestChannel(group)
    reqs = spec["requests"]
    schedule = {int(k): v for k, v in spec["schedule"].items()}
    ids, streamed, aborted_in, most = {}, {}, {}, 0
    for step in range(2000):
        joined, aborted = [], []
        for action, name in schedule.pop(step, []):
            if action == "join":
                cfg = decoding(spec, name)
                ids[name] = engine.add(reqs[name]["prompt"], cfg, reqs[name].get("eos", []))
                joined.append((ids[name], reqs[name]["prompt"], cfg))
            else:
                aborted_in[name] = _where(engine, ids[name])
                assert engine.abort(ids[name])
                aborted.append(ids[name])
            assert_block_invariants(engine.cache.blocks)
        if not engine.has_work and not schedule:
            break
        admit = cached = None
        if channel is not None:  # as lp.server.batched.BatchedEngine._announce
            admit = engine.admissions() if engine.has_work else []
            cached = engine.cached_rows(admit)
            channel.send(RequestChannel.STEP, *pack_step(joined, aborted, admit, engine.has_work, cached))
        if engine.has_work:
            for out in engine.step(admit, cached):
                streamed.setdefault(out.request_id, []).extend(out.new_tokens)
        most = max(most, len(engine.running))
        assert_block_invariants(engine.cache.blocks)
    else:
        raise AssertionError("the engine did not drain")
    if channel is not None:
        channel.send(RequestChannel.SHUTDOWN)
    out = {}
    for name, rid in ids.items():
        res = engine.result(rid)
        out[name] = {"streamed": streamed.get(rid, []), "output_ids": None if res is None else res.output_ids,
                     "finish": None if res is None else res.finish_reason,
                     "workers": None if res is None else res.stats.workers,
                     "steps": None if res is None else res.stats.steps, "aborted_in": aborted_in.get(name),
                     "cached": None if res is None else res.stats.cached_tokens}
    blocks = engine.cache.blocks
    return {"requests": out, "blocks_in_use": engine.blocks_in_use, "steps": engine.steps, "most_running": most,
            "hit_blocks": blocks.hit_blocks, "evictions": blocks.evictions}


def main() -> None:
    faulthandler.enable()  # a native abort prints every thread's Python stack
    from lp.parallel.dist import init_worker_group
    from tests.helpers import finish_worker, make_tiny_model

    spec = json.load(open(sys.argv[1]))
    torch.set_num_threads(1)
    group = init_worker_group(ParallelConfig(timeout_s=spec.get("timeout_s", 120), check_divergence=True),
                              torch.device("cpu"))
    runner = ModelRunner(make_tiny_model(**spec["model"]), attention=spec.get("attention", "sdpa"))
    if spec.get("generate_batch"):  # the offline call, every rank with the same prompts
        from lp.engine.batch import generate_batch
        from lp.engine.decoder import LookaheadDecoder

        cfgs = [decoding(spec, name) for name in spec["requests"]]
        decoder = LookaheadDecoder(runner, cfgs[0], group, tq_curve=[tuple(p) for p in spec["tq_curve"]])
        results = generate_batch(decoder, [r["prompt"] for r in spec["requests"].values()], configs=cfgs, max_batch=2)
        result = {name: res.output_ids for name, res in zip(spec["requests"], results)}
    elif "runs" in spec:  # several schedules in one torchrun (one model, one group)
        result = [run_schedule(runner, dict(spec, **run), group) for run in spec["runs"]]
    else:
        result = run_schedule(runner, spec, group)
    finish_worker(group, result, sys.argv[2])


if __name__ == "__main__":
    main()
