"""Launch ``lp.generate`` under torchrun: ``python launch/lp_run.py parallel.workers=K [overrides]``.

Takes the same Hydra overrides as ``python -m lp.generate``, plus ``parallel.workers=K``
(LP workers in total, over all nodes) and optionally ``parallel.tp=T`` (each worker a
tensor-parallel group of T processes): K x T processes, (K x T) / nnodes per node, in rank
order, so a worker's tp ranks sit on one node when T divides the processes per node and
LP spans the nodes. Multi-node: pass ``--nnodes``, ``--node-rank`` and
``--rdzv-endpoint HOST:PORT`` (or set LP_NNODES / LP_NODE_RANK / LP_RDZV_ENDPOINT); they
go to torchrun unchanged. Sets one run dir (LP_RUN_DIR) for every rank and
``OMP_NUM_THREADS`` (LP_THREADS, default 1 per worker on CPU).

    python launch/lp_run.py parallel.workers=2 'prompt="def quicksort(arr):"' raw_prompt=true
    python launch/lp_run.py parallel.workers=4 parallel.tp=2                  # 8 processes: LP 4 x TP 2
    python launch/lp_run.py --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500 parallel.workers=8
    python launch/lp_run.py --module lp.serve parallel.workers=2 server.port=8000   # the HTTP server
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

MODULES = ("lp.generate", "lp.serve")


def build_command(argv: list[str]) -> tuple[list[str], dict]:
    torchrun_flags: list[str] = []
    overrides: list[str] = []
    workers = None
    tp = "1"
    module = "lp.generate"
    it = iter(argv)
    for arg in it:
        if arg.startswith("--module"):  # which entry point torchrun starts: lp.generate (default) or lp.serve
            module = arg.partition("=")[2] or next(it, "")
            if module not in MODULES:
                raise SystemExit(f"lp_run: --module must be one of {', '.join(MODULES)}, got {module!r}")
            continue
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            if name not in ("--nnodes", "--node-rank", "--node_rank", "--rdzv-endpoint", "--rdzv_endpoint",
                            "--master-addr", "--master-port", "--rdzv-id", "--rdzv-backend"):
                raise SystemExit(f"lp_run: unknown flag {name}; use Hydra overrides (key=value) or torchrun node flags")
            torchrun_flags += [name, value if value else next(it)]
        else:
            overrides.append(arg)
            if arg.startswith("parallel.workers="):
                workers = arg.split("=", 1)[1]
            if arg.startswith("parallel.tp="):
                tp = arg.split("=", 1)[1]
    if workers is None:
        raise SystemExit("lp_run: pass parallel.workers=K (workers in total, over all nodes)")
    if not workers.isdigit() or int(workers) < 1:
        raise SystemExit(f"lp_run: parallel.workers must be an integer >= 1, got {workers!r}")
    if not tp.isdigit() or int(tp) < 1:
        raise SystemExit(f"lp_run: parallel.tp must be an integer >= 1, got {tp!r}")
    nnodes = os.environ.get("LP_NNODES")
    if nnodes and "--nnodes" not in torchrun_flags:
        torchrun_flags += ["--nnodes", nnodes, "--node-rank", os.environ.get("LP_NODE_RANK", "0")]
        if os.environ.get("LP_RDZV_ENDPOINT"):
            torchrun_flags += ["--rdzv-endpoint", os.environ["LP_RDZV_ENDPOINT"], "--rdzv-backend", "c10d"]
    n = 1
    if "--nnodes" in torchrun_flags:
        n = int(torchrun_flags[torchrun_flags.index("--nnodes") + 1])
    # parallel.workers x parallel.tp is the world size (all nodes together), everywhere in lp
    procs = int(workers) * int(tp)
    if procs % n:
        raise SystemExit(
            f"lp_run: parallel.workers={workers} x parallel.tp={tp} = {procs} processes (in total) must be a "
            f"multiple of --nnodes {n}"
        )
    per_node = str(procs // n)
    if n > 1 and (procs // n) % int(tp):
        print(f"lp_run: warning: parallel.tp={tp} does not divide the {per_node} processes per node: some "
              "tensor-parallel groups span nodes (every layer's all-reduce crosses the network)",
              file=sys.stderr, flush=True)
    endpoint = "--rdzv-endpoint" in torchrun_flags or "--rdzv_endpoint" in torchrun_flags
    if endpoint and "--rdzv-backend" not in torchrun_flags:
        torchrun_flags += ["--rdzv-backend", "c10d"]
    if n == 1 and not endpoint:
        torchrun_flags += ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_flags, "--nproc-per-node", per_node,
           "-m", module, *overrides]
    env = dict(os.environ)
    env.setdefault("LP_RUN_DIR", time.strftime("outputs/lp_run/%Y-%m-%d_%H-%M-%S"))
    env.setdefault("OMP_NUM_THREADS", os.environ.get("LP_THREADS", "1"))
    return cmd, env


def main() -> int:
    cmd, env = build_command(sys.argv[1:])
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
