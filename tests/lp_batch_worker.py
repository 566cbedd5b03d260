"""Worker script for the LP batch tests: ``torchrun --nproc-per-node K tests/lp_batch_worker.py SPEC.json OUT.json``.

Every rank builds the same tiny random model (tests.helpers.make_tiny_model, spec "model")
and one ``lp.engine.batch.BatchEngine`` on the torchrun worker group (or none when started without
torchrun), then plays the spec's literal schedule of joins and aborts (``run_schedule``,
which the tests also call in one process): ``schedule[step]`` lists ["join", name] /
["abort", name] done before that step. Rank 0 writes, per request name, the tokens the steps
streamed, the final output ids and finish reason, and the blocks left in use at the end.
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


def run_schedule(runner: ModelRunner, spec: dict, group=None) -> dict:
    """Play ``spec`` (requests, schedule, engine sizes) on one BatchEngine; -> results by name."""
    e = spec["engine"]
    engine = BatchEngine(runner, e["kv_tokens"], block_size=e["block_size"], max_batch=e["max_batch"],
                         max_prefill_tokens=e["max_prefill_tokens"], tq_curve=[tuple(p) for p in spec["tq_curve"]],
                         group=group)
    reqs = spec["requests"]
    schedule = {int(k): v for k, v in spec["schedule"].items()}
    ids, streamed = {}, {}
    for step in range(2000):
        for action, name in schedule.pop(step, []):
            if action == "join":
                r = reqs[name]
                ids[name] = engine.add(r["prompt"], DecodingConfig(**r["decoding"]), r.get("eos", []))
            else:
                engine.abort(ids[name])
        if not engine.has_work and not schedule:
            break
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_tokens)
    else:
        raise AssertionError("the engine did not drain")
    out = {}
    for name, rid in ids.items():
        res = engine.result(rid)
        out[name] = {"streamed": streamed.get(rid, []), "output_ids": res.output_ids, "finish": res.finish_reason,
                     "workers": res.stats.workers, "steps": res.stats.steps}
    return {"requests": out, "blocks_in_use": engine.blocks_in_use, "steps": engine.steps}


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

        cfgs = [DecodingConfig(**r["decoding"]) for r in spec["requests"].values()]
        decoder = LookaheadDecoder(runner, cfgs[0], group, tq_curve=[tuple(p) for p in spec["tq_curve"]])
        results = generate_batch(decoder, [r["prompt"] for r in spec["requests"].values()], configs=cfgs, max_batch=2)
        result = {name: res.output_ids for name, res in zip(spec["requests"], results)}
    else:
        result = run_schedule(runner, spec, group)
    finish_worker(group, result, sys.argv[2])


if __name__ == "__main__":
    main()
