"""The one module that owns torch.distributed: the (lp, tp) mesh and the per-step exchange.

Contract: ``init_worker_group(parallel_cfg, model_device)`` reads torchrun's
environment (global RANK / WORLD_SIZE, LOCAL_RANK for the device), checks
``parallel.workers x parallel.tp == WORLD_SIZE``, opens one process group (nccl on
CUDA, gloo on CPU) with a bounded timeout and, with ``parallel.tp > 1``, the 2-D
device mesh ``(workers, tp)`` named ("lp", "tp"), every sub-group with the same
timeout; it returns a ``WorkerGroup`` (or None outside torchrun with one process).

The mesh by rank order: global rank r is LP worker ``r // tp``, tp rank ``r % tp``,
so a worker's tp ranks are consecutive (on one node when tp divides the processes
per node) and LP spans the nodes. Each LP worker is one TP group (``group.tp_mesh``,
lp.parallel.tp shards its replica over it); ``lp_rank``/``lp_size`` are what the shard plan
and the decoder see, ``rank``/``world_size`` the global process.

One exchange per step, one fixed-shape int64 ``all_gather_into_tensor`` over the
whole world into buffers allocated once per generation (``begin``; no pickled
objects, no per-step allocation). A sequence's payload travels in a ``Frame`` (its
fixed slot sizes, chosen once per generation), packed and read by the same helpers
(``greedy_payload`` / ``sampled_payload``, ``read_greedy`` / ``read_sampled``) in one
sequence (``exchange``) and in a batched step (``exchange_batch``, lp.engine.batch: every
running sequence's frame, in the batch's order, concatenated into ONE all_gather;
its buffers are reallocated only when the batch's shape changes). Every rank reads
LP worker k's payload from the row of k's tp rank 0, so every tp rank of every
worker applies the very same verdicts (the tp ranks compute the same rows and send
the same payload; reading one of them makes agreement hold by construction, with
no extra broadcast, and rank 0's cancel flag reaches every process). Every frame
ends with [cancel, state_hash]; rank 0's cancel flag stops every rank at the same
step (a batch's cancellations ride with rank 0's step message instead, its flags
are 0). Every rank knows the shard plan, so the payload layout is known to all:

greedy   [hits, winner, emitted[0..E-1], z[0..C-1], state_hash]
         hits: the rank's longest verified run over its own candidates;
         winner: that candidate's global index (-1: none); emitted: the tokens it
         would publish (its ordinary-row token first), -1 padded to E = longest
         candidate + 1; z: the new
         trajectory values of the rank's window columns (C = most columns any
         rank owns this step). All ranks then pick the longest hit, lowest rank on
         ties, and apply the same publication, pool and window update.

sampled  [root, outcome[0..M-1], z[0..C-1], state_hash]
         root: the rank's outcome at the ordinary row; outcome[n]: the outcome at
         node n of the rank's own draft trie (its subtrees of the step's trie, in
         lp.lookahead.tree order; the token sampled at that node, keyed by the seed and the
         node's output position, lp.lookahead.sampling.sample_at); M = the most draft rows a step may
         verify. All ranks walk the whole trie with rank 0's root and each node's
         outcome from the rank that owns it, so all reach the same decision.

logprobs (a frame with ``logprobs`` > 0 slots a token: ``decoding.logprobs`` under LP): after the
         verdict, padded to a fixed offset (``Frame.base``), each rank's own walk's raw logprobs,
         ``emit`` entries of [chosen, top ids[0..k-1], top values[0..k-1]] (floats as their
         float64 bits), k = top_logprobs: a few numbers per token, never a vocabulary row.
         Greedy: the longest hit's rank's own; sampled: the rank owning the accepted subtree
         (its walk from its own root, the same as rank 0's when their root rows agree).

``state_hash`` is a fingerprint of pool, window and output taken before the step
when ``parallel.check_divergence`` is on (else 0), compared over every process
(tp ranks included), per sequence in a batch; a mismatch stops the job at the first
divergent step.

Failure: a collective that does not complete within ``parallel.timeout_s``
(a dead or stuck peer) raises ``WorkerFailure`` (gloo by its process group's timeout, NCCL by
lp's own bounded wait on the collective, ``bounded``: NCCL's watchdog is set longer); ``lp.generate``
turns that into a clear message and a non-zero exit on every live rank, and torchrun stops the rest.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import numpy as np
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


def mesh_shape(cfg: ParallelConfig, world: int) -> tuple[int, int]:
    """(LP workers, tp) for a world of ``world`` processes; ValueError with the fix otherwise."""
    tp = cfg.tp
    if cfg.workers is not None and cfg.workers * tp != world:
        raise ValueError(
            f"parallel.workers={cfg.workers} x parallel.tp={tp} = {cfg.workers * tp} processes but torchrun "
            f"started WORLD_SIZE={world}; launch --nproc-per-node (x nnodes) = workers x tp, or set "
            f"parallel.workers={world // tp if world % tp == 0 else '<world / tp>'} (or drop it)"
        )
    if world % tp:
        raise ValueError(
            f"parallel.tp={tp} does not divide WORLD_SIZE={world}: launch a multiple of {tp} processes "
            f"(workers x tp) or pick parallel.tp from the divisors of {world}"
        )
    return world // tp, tp


def init_worker_group(cfg: ParallelConfig, device: torch.device) -> "WorkerGroup | None":
    rank, world, local_rank = torchrun_env()
    workers, tp = mesh_shape(cfg, world)
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
    timeout = pg_timeout(backend, cfg.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            **({"device_id": device} if backend == "nccl" else {}),
        )
    mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        opts = _pg_options(backend, timeout)  # sub-groups otherwise get torch's 30-min default
        mesh = init_device_mesh(device.type, (workers, tp), mesh_dim_names=("lp", "tp"),
                                backend_override={"lp": (backend, opts), "tp": (backend, opts)})
    return WorkerGroup(rank, world, local_rank, device, cfg, tp=tp, mesh=mesh, backend=backend)


# NCCL's watchdog aborts the whole process once a collective outlives the process group's timeout (lp's
# WorkerFailure message never shows), and 8 ranks' start-up (loads, kernel builds, compiles) skews by minutes
NCCL_STARTUP_S = 600.0


def pg_timeout(backend: str, timeout_s: float) -> datetime.timedelta:
    """The process group's timeout for ``parallel.timeout_s``: gloo raises it in the calling thread (lp's
    WorkerFailure), so gloo gets it as is; NCCL gets the longer of twice it and it + ``NCCL_STARTUP_S``, so its
    watchdog never aborts within lp's own bound nor within start-up skew (not yet run on a GPU: docs/gpu.md)."""
    if not timeout_s > 0:
        raise ValueError(f"parallel.timeout_s must be > 0, got {timeout_s!r}")
    if backend == "nccl":
        return datetime.timedelta(seconds=max(2 * timeout_s, timeout_s + NCCL_STARTUP_S))
    return datetime.timedelta(seconds=timeout_s)


def bounded(what: str, collective, /, *args, wait_s: float | None = None, **kwargs) -> None:
    """Run ``collective(*args, **kwargs)``; a time-out or a vanished peer raises lp's WorkerFailure
    naming ``what``, whatever the backend. gloo (``wait_s`` None) raises in the calling thread within the
    process group's timeout (``parallel.timeout_s``). NCCL enqueues a collective and returns: the host
    would block in its next device read until NCCL's watchdog aborts the whole process (``pg_timeout``,
    longer, lp's message never shown), so there the collective runs async and the host waits for it at
    most ``wait_s`` (``parallel.timeout_s``: ``Work.wait(timeout)`` blocks the CPU thread and raises)."""
    try:
        if wait_s is None:
            collective(*args, **kwargs)
            return
        done = collective(*args, async_op=True, **kwargs).wait(datetime.timedelta(seconds=wait_s))
    except Exception as e:  # gloo/nccl raise on timeout or a vanished peer
        raise WorkerFailure(f"{what} failed ({type(e).__name__}: {e})") from e
    if done is False:
        raise WorkerFailure(f"{what} failed (no answer within parallel.timeout_s={wait_s:g} s: a dead or stuck rank)")


def _pg_options(backend: str, timeout: datetime.timedelta):
    opts = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    return opts


@dataclass(frozen=True)
class Frame:
    """The fixed shape of one sequence's exchange payload (chosen once per generation):
    ``emit``: most tokens a step publishes (longest candidate + 1); ``nodes``: most
    draft-trie rows of a step; ``columns``: most window columns one rank can own
    (W + N - 2: the warm-up window is widest); ``logprobs``: slots per emitted token's
    logprobs (1 + 2 x top_logprobs; 0: none asked). ``base``: the larger of the greedy and
    sampled payloads; ``size``: base, the logprobs, cancel flag and state hash."""

    emit: int
    nodes: int
    columns: int
    logprobs: int = 0

    @property
    def base(self) -> int:
        return max(2 + self.emit, 1 + self.nodes) + self.columns

    @property
    def size(self) -> int:
        return self.base + self.emit * self.logprobs + 2


def greedy_payload(frame: Frame, hits: int, winner: int, emitted: list[int], z_local: list[int]) -> list[int]:
    return [hits, winner] + _pad(emitted, frame.emit) + list(z_local)


def sampled_payload(frame: Frame, root: int, outcomes: list[int], z_local: list[int]) -> list[int]:
    return [root] + _pad(list(outcomes), frame.nodes) + list(z_local)


def read_greedy(frame: Frame, rows: list[list[int]], plan) -> list[RankHit]:
    """Every LP worker's greedy payload (``rows[k]``) -> its RankHit."""
    out = []
    for k, row in enumerate(rows):
        n = row[0] + 1
        cols = len(plan[k].columns)
        out.append(RankHit(row[0], row[1], row[2 : 2 + n], row[2 + frame.emit : 2 + frame.emit + cols]))
    return out


def read_sampled(frame: Frame, rows: list[list[int]], plan):
    """-> (root outcome per rank, [outcomes by own trie node] per rank, z per rank)."""
    m = frame.nodes
    roots = [row[0] for row in rows]
    nodes = [row[1 : 1 + m] for row in rows]
    zs = [row[1 + m : 1 + m + len(plan[k].columns)] for k, row in enumerate(rows)]
    return roots, nodes, zs


def with_logprobs(frame: Frame, payload: list[int], entries) -> list[int]:
    """``payload`` padded to ``frame.base``, then this rank's logprobs: ``entries`` =
    [(chosen logprob, ((top id, top logprob), ...))] of its own walk, at most ``frame.emit``."""
    k = (frame.logprobs - 1) // 2
    assert len(entries) <= frame.emit and all(len(top) == k for _, top in entries), (len(entries), k)
    floats = np.zeros((frame.emit, frame.logprobs), dtype=np.float64)
    ids = np.full((frame.emit, k), -1, dtype=np.int64)
    for i, (chosen, top) in enumerate(entries):
        floats[i, 0] = chosen
        for j, (t, v) in enumerate(top):
            ids[i, j], floats[i, 1 + k + j] = t, v
    block = floats.view(np.int64)
    block[:, 1 : 1 + k] = ids
    return _pad(payload, frame.base) + block.reshape(-1).tolist()


def read_logprobs(frame: Frame, row: list[int], count: int) -> list[tuple[float, tuple]]:
    """The first ``count`` logprob entries of one rank's payload row (``with_logprobs``)."""
    k = (frame.logprobs - 1) // 2
    block = np.asarray(row[frame.base : frame.base + count * frame.logprobs], dtype=np.int64)
    block = block.reshape(count, frame.logprobs)
    floats = block.view(np.float64)
    return [(float(floats[i, 0]), tuple(zip(block[i, 1 : 1 + k].tolist(), floats[i, 1 + k :].tolist())))
            for i in range(count)]


def _write_frame(buf, payload: list[int], cancel: bool, state_hash: int) -> None:
    """One frame into ``buf`` (a numpy view of its ``Frame.size`` slots): payload, -1 padding,
    cancel flag, state hash."""
    n = len(payload)
    assert n + 2 <= len(buf), (n, len(buf))
    buf[:n] = payload
    buf[n:-2] = -1
    buf[-2] = int(cancel)
    buf[-1] = state_hash


class WorkerGroup:
    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device, cfg: ParallelConfig,
                 tp: int = 1, mesh=None, backend: str = "gloo"):
        self.rank = rank  # global process rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.tp_size = tp
        self.tp_rank = rank % tp
        self.lp_rank = rank // tp  # this process's LP worker (the shard plan's rank)
        self.lp_size = world_size // tp  # LP workers
        self.mesh = mesh  # DeviceMesh (lp, tp) when tp > 1
        self.tp_mesh = mesh["tp"] if mesh is not None else None
        self.check_divergence = cfg.check_divergence
        self.backend = backend
        self.timeout_s = cfg.timeout_s
        self.started = False  # a collective has completed: every rank is past its start-up
        self._slots = 0
        self._batch_slots = 0

    @property
    def wait_s(self) -> float | None:
        """lp's own bound on a collective where the backend does not raise in time itself (NCCL,
        ``bounded``): ``parallel.timeout_s``, and for the first collective, which waits out the ranks'
        start-up skew (loads, kernel builds, compiles), at least ``NCCL_STARTUP_S`` (still inside NCCL's
        watchdog, ``pg_timeout``). None for gloo, whose process group raises in time."""
        if self.backend != "nccl":
            return None
        return self.timeout_s if self.started else max(self.timeout_s, NCCL_STARTUP_S)

    def collective(self, what: str, fn, /, *args, **kwargs) -> None:
        """``fn(*args, **kwargs)`` under ``bounded``: WorkerFailure naming ``what`` on a dead or stuck rank."""
        bounded(what, fn, *args, wait_s=self.wait_s, **kwargs)
        self.started = True

    # -- the exchange ---------------------------------------------------------

    def begin(self, frame: Frame) -> None:
        """Allocate the exchange buffers for one generation (fixed shape for every step)."""
        slots = frame.size
        if slots != self._slots:
            self._slots = slots
            self._send = torch.zeros(slots, dtype=torch.long, device=self.device)
            self._recv = torch.zeros(self.world_size * slots, dtype=torch.long, device=self.device)
            self._host = torch.zeros(slots, dtype=torch.long, pin_memory=self.device.type == "cuda")
            self._host_np = self._host.numpy()

    def exchange(self, payload: list[int], cancel: bool, state_hash: int) -> tuple[list[list[int]], bool]:
        """One sequence's step: -> (payload row of every LP worker, rank 0's cancel flag)."""
        _write_frame(self._host_np, payload, cancel, state_hash if self.check_divergence else 0)
        rows = self._gather(self._host, self._send, self._recv, self._slots)
        return self._frames_of(rows, 0, self._slots)

    def exchange_batch(self, frames: list[tuple[Frame, list[int], int]]) -> list[list[list[int]]]:
        """A batched step (lp.engine.batch): ``frames`` = [(frame, payload, state_hash)] per sequence,
        in the batch's order (the same on every rank). ONE all_gather of the concatenated
        frames; -> per sequence, the payload row of every LP worker. Cancellation rides with
        the step's request message instead (lp.server.batched), so every cancel flag is 0."""
        total = sum(f.size for f, _, _ in frames)
        if total != self._batch_slots:  # a new batch shape: buffers for it, kept while it lasts
            self._batch_slots = total
            self._bsend = torch.zeros(total, dtype=torch.long, device=self.device)
            self._brecv = torch.zeros(self.world_size * total, dtype=torch.long, device=self.device)
            self._bhost = torch.zeros(total, dtype=torch.long, pin_memory=self.device.type == "cuda")
        host_np, off = self._bhost.numpy(), 0
        for frame, payload, state_hash in frames:
            _write_frame(host_np[off : off + frame.size], payload, False, state_hash if self.check_divergence else 0)
            off += frame.size
        rows = self._gather(self._bhost, self._bsend, self._brecv, total)
        out, off = [], 0
        for frame, _, _ in frames:
            out.append(self._frames_of(rows, off, frame.size)[0])
            off += frame.size
        return out

    def _gather(self, host: torch.Tensor, send: torch.Tensor, recv: torch.Tensor, slots: int) -> list[list[int]]:
        if self.device.type == "cpu":
            send = host
        else:
            send.copy_(host, non_blocking=True)
        self.collective("per-step exchange", dist.all_gather_into_tensor, recv, send)
        return recv.view(self.world_size, slots).tolist()  # one device->host read

    def _frames_of(self, rows: list[list[int]], off: int, size: int) -> tuple[list[list[int]], bool]:
        """One frame [off, off + size) of every process's row: the divergence check, then
        (LP worker k's payload: the row of its tp rank 0, global rank k * tp; rank 0's cancel)."""
        frames = [row[off : off + size] for row in rows]
        if self.check_divergence:
            hashes = [f[-1] for f in frames]
            if len(set(hashes)) != 1:
                raise WorkerFailure(
                    f"ranks diverged: pool/window/output fingerprints differ across ranks {hashes}"
                )
        return frames[:: self.tp_size], bool(frames[0][-2])  # rank 0 decides cancellation

    def share_curve(self, curve, small_rows):
        """Rank 0's [(Q, seconds)] and its small-row kernel set (lp.kernels.linears, a subset of the
        curve's Q) on every rank (one broadcast per generation that calibrates)."""
        from lp.model.calibrate import QS

        buf = torch.full((3 * len(QS) + 1,), -1.0, dtype=torch.float64)
        if self.rank == 0:
            buf[0] = len(curve)
            for i, (q, t) in enumerate(curve):
                buf[1 + 3 * i], buf[2 + 3 * i], buf[3 + 3 * i] = float(q), float(t), float(q in small_rows)
        dev = buf.to(self.device)
        self.collective("t(Q) broadcast", dist.broadcast, dev, src=0)
        vals = dev.cpu().tolist()
        n = int(vals[0])
        curve = [(int(vals[1 + 3 * i]), vals[2 + 3 * i]) for i in range(n)]
        return curve, frozenset(int(vals[1 + 3 * i]) for i in range(n) if vals[3 + 3 * i] > 0.5)

    def share_floats(self, values: list[float]) -> list[float]:
        """Rank 0's ``values`` on every rank (one broadcast)."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        self.collective("broadcast", dist.broadcast, t, src=0)
        return t.cpu().tolist()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. the K/V slots each GPU has room for)."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        self.collective("all_reduce", dist.all_reduce, t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_process(code: int = 0):
    """End a torchrun worker process now, after flushing its output, without the
    interpreter's teardown: torch's C++ threads (gloo pairs, sub-groups) can abort a
    process during teardown ("terminate called without an active exception") even after
    ``destroy_process_group``, and torchrun would then report a clean run as failed."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _pad(values: list[int], size: int) -> list[int]:
    assert len(values) <= size, (len(values), size)
    return list(values) + [-1] * (size - len(values))


# ===========================================================================
# Request channel (lp.serve): rank 0 hands each step's joins and leaves to every rank.
#
# Separate from the per-step exchange above. Rank 0 (the HTTP server) sends one
# fixed-shape int64 header by broadcast, then, when the header announces a payload,
# one int64 broadcast of that payload (lp.server.engine.pack_step: the joining
# requests' token ids and settings, the aborted and the admitted ids, the prefix-cache hit
# rows of each admitted one). No pickled
# objects. The other ranks block in ``recv()`` with the process group's bounded timeout (parallel.timeout_s): rank 0
# sends an IDLE header every few seconds when no request is queued and a SHUTDOWN
# header on exit, so a missing header means a dead rank 0 and the wait ends in
# WorkerFailure instead of hanging forever.
#
#   header [MAGIC, kind, seq, n_payload, field[0..FIELDS-1]]
#          kind: IDLE | STEP | SHUTDOWN; seq: rank 0's running header count
#          (every rank checks it, so a lost or extra header is caught);
#          fields: caller-defined int64 values (lp.server.engine.pack_step: counts and
#          whether a step runs).


class RequestChannel:
    MAGIC = 0x4C50_5256  # "LPRV"
    IDLE, STEP, SHUTDOWN = 0, 1, 2
    FIELDS = 24
    HEADER = 4 + FIELDS

    def __init__(self, group: WorkerGroup):
        self.group = group
        self.seq = 0

    def _broadcast(self, t: torch.Tensor, what: str) -> torch.Tensor:
        self.group.collective(f"request channel {what}", dist.broadcast, t, src=0)
        return t

    def handshake(self, fingerprint: list[int]) -> None:
        """Every rank shows the same model (vocab, context, parameter count ...) before serving."""
        mine = torch.tensor([len(fingerprint)] + list(fingerprint), dtype=torch.long, device=self.group.device)
        gathered = [torch.empty_like(mine) for _ in range(self.group.world_size)]
        self.group.collective("request channel handshake", dist.all_gather, gathered, mine)
        rows = [g.cpu().tolist() for g in gathered]
        if any(r != rows[0] for r in rows):
            raise WorkerFailure(f"ranks loaded different models: fingerprints {rows}")

    def send(self, kind: int, fields: list[int] | None = None, payload: list[int] | None = None) -> None:
        """Rank 0: one header, then the payload if any."""
        assert self.group.rank == 0, "only rank 0 sends requests"
        fields = list(fields or [])
        payload = list(payload or [])
        assert len(fields) <= self.FIELDS, (len(fields), self.FIELDS)
        self.seq += 1
        header = [self.MAGIC, kind, self.seq, len(payload)] + fields + [0] * (self.FIELDS - len(fields))
        self._broadcast(torch.tensor(header, dtype=torch.long, device=self.group.device), "header")
        if payload:
            self._broadcast(torch.tensor(payload, dtype=torch.long, device=self.group.device), "payload")

    def recv(self) -> tuple[int, list[int], list[int]]:
        """Other ranks: (kind, fields, payload); blocks at most parallel.timeout_s per broadcast."""
        header = self._broadcast(torch.zeros(self.HEADER, dtype=torch.long, device=self.group.device), "header")
        magic, kind, seq, n = header[:4].tolist()
        self.seq += 1
        if magic != self.MAGIC or seq != self.seq or kind not in (self.IDLE, self.STEP, self.SHUTDOWN):
            raise WorkerFailure(
                f"rank {self.group.rank}: bad request header (magic {magic:#x}, kind {kind}, seq {seq}, expected {self.seq})"
            )
        fields = header[4:].tolist()
        payload: list[int] = []
        if n > 0:
            payload = self._broadcast(torch.empty(n, dtype=torch.long, device=self.group.device), "payload").tolist()
        return kind, fields, payload
