"""One multi-worker benchmark job: ``torchrun --standalone --nproc-per-node K -m bench.worker --spec S --out O``.

Contract: ``bench.run`` writes the job spec (method, model, dtype, threads,
W/N/G, the prompts as token ids, eos ids) to a JSON file and starts this module
under torchrun with OMP_NUM_THREADS = threads per worker. Every rank loads the
model, applies its parallel plan (lp: a WorkerGroup; tp: shards; pp: a stage; lp_tp: the
(lp, tp) mesh, each LP worker's replica sharded by lp.parallel.tp over its tp ranks),
and decodes every prompt with the same call. Rank 0 writes the per-prompt runs
to ``--out``; a rank that fails exits non-zero and torchrun stops the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist


def decode_all(spec: dict, progress: bool) -> tuple[list[dict], dict]:
    from tqdm import tqdm

    from bench import methods
    from lp.config import ParallelConfig
    from lp.parallel.dist import init_worker_group, torchrun_env, worker_device
    from lp.parallel.tp import load_for

    torch.set_num_threads(spec["threads"])
    rank, world, _ = torchrun_env()
    device = worker_device(spec.get("device", "cpu"))
    method, eos = spec["method"], spec["eos"]
    tp = (spec.get("tp") or 1) if method == "lp_tp" else 1
    group = init_worker_group(ParallelConfig(timeout_s=spec["dist_timeout_s"], tp=tp), device)
    # lp_tp: each rank reads only its shards (lp.parallel.tp.load_for)
    model, _ = load_for(Path(spec["model_path"]), spec["dtype"], str(device), spec.get("quant", "none"), group)
    info: dict = {"workers": world, "threads": torch.get_num_threads()}
    if method == "lp_tp":
        info.update(lp_workers=world // tp, tp=tp)
    if method in ("lp", "lp_tp"):

        def decode(ids, n):
            W, N, G = spec["W"], spec["N"], spec["G"]
            return methods.run_lookahead(
                model, ids, n, eos, W, N, G, spec["prompt_pool"], group,
                window_policy=spec.get("window_policy", "always"),
            )

    elif method == "tp":
        sharded, timer = methods.apply_tp(model, world, rank, spec["tp_engine"])
        info.update(tp_engine=spec["tp_engine"], tp_sharded=sharded)

        def decode(ids, n):
            return methods.run_tp(model, ids, n, eos, timer)

    elif method == "pp":
        stage = methods.PipelineStage(model, rank, world)
        info.update(pp_stages=stage.bounds)

        def decode(ids, n):
            return stage.run(ids, n, eos)

    else:
        raise ValueError(f"bench.worker runs lp, lp_tp, tp or pp, got method={method!r}")

    prompts = spec["prompts"]
    if spec["warmup"] and prompts:
        decode(prompts[0]["ids"], min(8, prompts[0]["max_new_tokens"]))
    runs = []
    for p in tqdm(prompts, desc=f"{method} x{world}", disable=not progress, file=sys.stderr):
        run = decode(p["ids"], p["max_new_tokens"])
        runs.append({"key": p["key"], **asdict(run)})
    if world > 1:
        hashes = [hash(tuple(r["output_ids"])) for r in runs]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, hashes)
        info["ranks_agree"] = all(g == gathered[0] for g in gathered)
    if group is not None:
        group.close()
    elif dist.is_initialized():
        dist.destroy_process_group()
    return runs, info


def main(argv: list[str] | None = None) -> int:
    from lp.parallel.dist import WorkerFailure

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    rank = int(os.environ.get("RANK", "0"))
    try:
        runs, info = decode_all(spec, progress=rank == 0)
    except WorkerFailure as e:
        print(f"[bench.worker] rank {rank}: {e}", file=sys.stderr, flush=True)
        return 3
    if rank == 0:
        Path(args.out).write_text(json.dumps({"runs": runs, "info": info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
