"""Worker script for the LP tests: ``torchrun --nproc-per-node K tests/lp_worker.py SPEC.json OUT.json``.

Runs every job of SPEC (prompt ids + decoding config) with ``LookaheadDecoder`` on the
torchrun worker group (or one process when started without torchrun) and writes, from
rank 0, one result per job: output ids, steps, rows per rank. ``planted_bug``: the name of a
wrong verifier in tests.helpers swapped in on every rank (a negative control).
"""

import json
import sys
from pathlib import Path

import torch

from lp.config import DecodingConfig, ParallelConfig
from lp.decoding import LookaheadDecoder
from lp.dist import init_worker_group
from lp.model import ModelRunner, load_model, resolve_model_path


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    torch.set_num_threads(spec.get("threads", 1))
    parallel = ParallelConfig(
        timeout_s=spec.get("timeout_s", 120),
        check_divergence=spec.get("check_divergence", True),
    )
    if spec.get("planted_bug"):  # a negative control: a wrong verifier on every rank
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests import helpers

        helpers.plant_verifier(getattr(helpers, spec["planted_bug"]))
    group = init_worker_group(parallel, torch.device("cpu"))
    path = spec.get("model_path") or resolve_model_path("smollm2", None)
    model, _ = load_model(path, spec.get("dtype", "float32"))
    runner = ModelRunner(model)
    results = []
    for job in spec["jobs"]:
        res = LookaheadDecoder(runner, DecodingConfig(**job["decoding"]), group).generate(
            job["prompt_ids"], job.get("eos", [])
        )
        results.append(
            {
                "output_ids": res.output_ids,
                "steps": res.stats.steps,
                "mean_rows_per_rank": res.stats.mean_rows_per_rank,
                "accept_hist": res.stats.accept_hist,
            }
        )
    if group is None or group.rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
    if group is not None:
        group.close()


if __name__ == "__main__":
    main()
