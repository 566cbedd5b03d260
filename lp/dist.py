"""The one module that owns torch.distributed: worker setup and the per-step exchange.

Contract: ``init_worker_group(parallel_cfg, model_device)`` reads torchrun's
environment (global RANK / WORLD_SIZE, LOCAL_RANK for the device), opens one
process group (nccl on CUDA, gloo on CPU) with a bounded timeout, and returns a
``WorkerGroup`` (or None outside torchrun with one worker).

One exchange per step, one fixed-shape int64 ``all_gather`` (no pickled objects).
Every rank knows the shard plan, so the payload layout is known to all:

greedy   [hits, winner, emitted[0..N-1], z[0..C-1], state_hash]
         hits: the rank's longest verified run over its own candidates;
         winner: that candidate's global index (-1: none); emitted: the tokens it
         would publish (its ordinary-row token first), -1 padded; z: the new
         trajectory values of the rank's window columns (C = most columns any
         rank owns this step). All ranks then pick the longest hit, lowest rank on
         ties, and apply the same publication, pool and window update.

sampled  [root, outcome[0..M-1, 0..R-1], z[0..C-1], state_hash]
         root: the rank's outcome at the ordinary row; outcome[i][d]: the outcome
         at its i-th candidate's row d (the exact verifier at that trie node, with
         randomness keyed by (seed, step, depth), lp.sampling). All ranks walk the
         candidate trie with rank 0's root and the lowest-index candidate's outcome
         at each node, so all reach the same decision.

``state_hash`` is a fingerprint of pool, window and output taken before the step
when ``parallel.check_divergence`` is on (else 0); a mismatch stops the job at
the first divergent step.

Failure: a collective that does not complete within ``parallel.timeout_s``
(a dead or stuck peer) raises; ``lp.generate`` turns that into a clear message
and a non-zero exit on every live rank, and torchrun stops the rest.
"""

from __future__ import annotations

import datetime
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lp.config import ParallelConfig


class WorkerFailure(RuntimeError):
    pass


@dataclass
class RankHit:
    hits: int
    winner: int
    emitted: list[int]
    z: list[int]


def torchrun_env() -> tuple[int, int, int]:
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def worker_device(requested: str) -> torch.device:
    """The device of this worker: cuda:LOCAL_RANK when CUDA is used, else cpu."""
    _, _, local_rank = torchrun_env()
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if requested.startswith("cuda:"):
        return torch.device(requested)
    if not torch.cuda.is_available():
        raise ValueError("model.device=cuda but CUDA is not available")
    return torch.device("cuda", local_rank)


def init_worker_group(cfg: ParallelConfig, device: torch.device) -> "WorkerGroup | None":
    rank, world, local_rank = torchrun_env()
    if cfg.workers is not None and cfg.workers != world:
        raise ValueError(
            f"parallel.workers={cfg.workers} but torchrun started WORLD_SIZE={world} workers; "
            "launch with --nproc-per-node (x nnodes) equal to parallel.workers, or drop it"
        )
    if world == 1:
        return None
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("parallel.backend=nccl needs CUDA devices; use gloo on CPU")
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            **({"device_id": device} if backend == "nccl" else {}),
        )
    return WorkerGroup(rank, world, local_rank, device, cfg)


class WorkerGroup:
    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device, cfg: ParallelConfig):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.check_divergence = cfg.check_divergence
        self.kill_at = tuple(cfg.kill_rank_at_step) if cfg.kill_rank_at_step else None
        self.state_hash = 0
        self._cancel = 0
        self.cancelled = False

    # -- the exchange ---------------------------------------------------------

    def _all_gather(self, payload: list[int]) -> list[list[int]]:
        mine = torch.tensor(payload + [self._cancel, self.state_hash], dtype=torch.long, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(gathered, mine)
        except Exception as e:  # gloo/nccl raise on timeout or a vanished peer
            raise WorkerFailure(f"rank {self.rank}: per-step exchange failed ({type(e).__name__}: {e})") from e
        rows = torch.stack(gathered).cpu().tolist()
        self.cancelled = bool(rows[0][-2])  # rank 0 decides
        if self.check_divergence:
            hashes = [row[-1] for row in rows]
            if len(set(hashes)) != 1:
                raise WorkerFailure(
                    f"ranks diverged: pool/window/output fingerprints differ across ranks {hashes}"
                )
        return [row[:-2] for row in rows]

    def exchange_greedy(self, hits, winner, emitted, z_local, plan) -> list[RankHit]:
        n_slots = self._n_slots
        c_slots = max(len(s.columns) for s in plan)
        payload = [hits, winner] + _pad(emitted, n_slots) + _pad(z_local, c_slots)
        out = []
        for k, row in enumerate(self._all_gather(payload)):
            n = row[0] + 1
            cols = len(plan[k].columns)
            out.append(RankHit(row[0], row[1], row[2 : 2 + n], row[2 + n_slots : 2 + n_slots + cols]))
        return out

    def exchange_sampled(self, root, outcomes, z_local, plan, R):
        m_slots = max(len(s.candidates) for s in plan)
        c_slots = max(len(s.columns) for s in plan)
        flat = [t for row in outcomes for t in row]
        payload = [root] + _pad(flat, m_slots * R) + _pad(z_local, c_slots)
        rows = self._all_gather(payload)
        roots = [row[0] for row in rows]
        table: dict[int, list[int]] = {}
        zs = []
        for k, row in enumerate(rows):
            for i, c in enumerate(plan[k].candidates):
                table[c] = row[1 + i * R : 1 + (i + 1) * R]
            zs.append(row[1 + m_slots * R : 1 + m_slots * R + len(plan[k].columns)])
        return roots, table, zs

    def set_state(self, fingerprint: int, n_slots: int, cancel: bool = False) -> None:
        """Called at the start of each step: the state hash to send, the emitted slots (N)
        and whether this rank asks to cancel (only rank 0's flag is read)."""
        self.state_hash = fingerprint if self.check_divergence else 0
        self._n_slots = n_slots
        self._cancel = int(cancel)

    # -- failure injection (tests) --------------------------------------------

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _pad(values: list[int], size: int) -> list[int]:
    assert len(values) <= size, (len(values), size)
    return list(values) + [-1] * (size - len(values))
