"""Worker script for the LP tests: ``torchrun --nproc-per-node K tests/lp_worker.py SPEC.json OUT.json``.

Runs every job of SPEC (prompt ids + decoding config) with ``LookaheadDecoder`` on the
torchrun worker group (spec "tp": LP workers x tp processes, lp.parallel.tp shards each replica; or one
process when started without torchrun) and writes, from rank 0, one result per job: output ids,
steps, rows per rank. ``planted_bug``: the name of a wrong sampled draw in tests.helpers swapped in
on every rank, or on ``planted_rank`` alone (a negative control). ``kill_rank_at_step: [R, S]``: rank R SIGKILLs itself after
its step S (a dead worker for the survivors to detect); ``kill_rank_in_forward: [R, F]``: inside
its F-th forward, at its last decoder layer (a tensor-parallel peer dying mid-forward). ``tokenizer: true``: every rank loads the
model's tokenizer and passes it to ``generate`` (structured output: decoding.json_schema / grammar). ``load: "whole"``: every rank loads
the whole replica and shards it in memory (the default reads only its shards). The first
result carries ``memory``: per global rank, peak RSS before and after loading, the dtypes and
every parameter's local shape, the scheme ``model.quant`` resolved to and the count of each module
class, the bytes its weights hold. ``compile``: model.compile of the runner. ``return_logits``: the first result also carries the first job's prompt logits.
"""

import faulthandler
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import torch

from lp.config import DecodingConfig, ParallelConfig
from lp.engine.decoder import LookaheadDecoder
from lp.parallel.dist import init_worker_group
from lp.model.runner import ModelRunner
from lp.parallel.memory import held_bytes
from lp.model.loader import load_model, resolve_model_path
from lp.parallel.tp import load_for, local_shapes, shard_for


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (VmHWM; not ru_maxrss, which a process
    inherits from the one that forked it, e.g. pytest holding a model)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    faulthandler.enable()  # a native abort prints every thread's Python stack
    spec = json.load(open(sys.argv[1]))
    torch.set_num_threads(spec.get("threads", 1))
    parallel = ParallelConfig(
        timeout_s=spec.get("timeout_s", 120),
        check_divergence=spec.get("check_divergence", True),
        tp=spec.get("tp", 1),
    )
    group = init_worker_group(parallel, torch.device("cpu"))
    planted_rank = spec.get("planted_rank")  # None: every rank
    if spec.get("planted_bug") and (planted_rank is None or (group.rank if group else 0) == planted_rank):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a negative control: a wrong draw
        from tests import helpers

        helpers.plant_draw(getattr(helpers, spec["planted_bug"]))
    path = spec.get("model_path") or resolve_model_path("smollm2", None)
    rss_before = peak_rss_mb()
    if spec.get("load") == "whole":  # every rank loads the whole replica, then shards it in memory
        model, tokenizer = load_model(path, spec.get("dtype", "float32"), quant=spec.get("quant", "none"))
        shard_for(model, group)
    else:  # spec "tp" > 1: each rank reads only its shards of the checkpoint
        model, tokenizer = load_for(path, spec.get("dtype", "float32"), "cpu", spec.get("quant", "none"), group,
                                    tokenizer=bool(spec.get("tokenizer")))
    memory = {"rss_before_load_mb": rss_before, "peak_rss_mb": peak_rss_mb(),
              "local_shapes": local_shapes(model), "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
              "quant": getattr(model, "_lp_quant", None) or "none",
              "modules": dict(Counter(type(m).__name__ for m in model.modules())), "weight_bytes": held_bytes(model)}
    runner = ModelRunner(model, compile=spec.get("compile", "auto"))
    kill = spec.get("kill_rank_at_step")
    in_forward = spec.get("kill_rank_in_forward")
    if in_forward and group is not None and group.rank == in_forward[0]:
        calls = [0]

        def die_inside(module, args):  # the last decoder layer, between the forward's collectives
            calls[0] += 1
            if calls[0] == in_forward[1]:
                os.kill(os.getpid(), signal.SIGKILL)

        model.model.layers[-1].register_forward_pre_hook(die_inside)

    def on_step(step, rec):
        if kill and group is not None and group.rank == kill[0] and step == kill[1]:
            os.kill(os.getpid(), signal.SIGKILL)

    results = []
    for job in spec["jobs"]:
        res = LookaheadDecoder(runner, DecodingConfig(**job["decoding"]), group).generate(
            job["prompt_ids"], job.get("eos", []), on_step=on_step, tokenizer=tokenizer if spec.get("tokenizer") else None
        )
        results.append(
            {
                "output_ids": res.output_ids,
                "steps": res.stats.steps,
                "mean_rows_per_rank": res.stats.mean_rows_per_rank,
                "accept_hist": res.stats.accept_hist,
                # decoding.logprobs: [token, logprob, [[top id, top logprob], ...]] per output token
                "logprobs": None if res.logprobs is None else [[t.token, t.logprob, [list(x) for x in t.top]]
                                                               for t in res.logprobs],
                "forced_tokens": res.stats.forced_tokens,
                "finish_reason": res.finish_reason,
            }
        )
    if group is not None and group.tp_size > 1:
        # the verifier's input: are one forward's logits the same bits on every tp rank?
        import torch.distributed as dist

        with torch.inference_mode():
            logits = model(torch.tensor([spec["jobs"][0]["prompt_ids"]])).logits[0]
        peers = [torch.empty_like(logits) for _ in range(group.tp_size)]
        dist.all_gather(peers, logits, group=group.tp_mesh.get_group())
        for r in results:
            r["tp_logits_identical"] = all(torch.equal(peers[0], p) for p in peers)
    if spec.get("return_logits") and results:  # the first job's prompt logits (float32, rank 0's)
        with torch.inference_mode():
            results[0]["logits"] = model(torch.tensor([spec["jobs"][0]["prompt_ids"]])).logits[0].float().tolist()
    memory["peak_rss_end_mb"] = peak_rss_mb()  # after the forwards touched every weight
    if results:  # every rank's memory and local shapes, on the first result
        if group is None:
            results[0]["memory"] = [memory]
        else:
            import torch.distributed as dist

            everyone = [None] * group.world_size
            dist.all_gather_object(everyone, memory)
            results[0]["memory"] = everyone
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.helpers import finish_worker

    finish_worker(group, results, sys.argv[2])


if __name__ == "__main__":
    main()
