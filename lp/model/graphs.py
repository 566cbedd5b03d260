"""Static-shape packed steps and their CUDA-graph capture (``model.cuda_graphs=true``).

Contract: ``StaticStepper(runner)`` runs a runner's packed steps with every shape fixed
per *row bucket* (8, 16, 32, ... rows), so that on CUDA each bucket's forward is
captured once and replayed:

* rows are padded up to the bucket: a padding row holds token 0 at the step's first
  position, has no parent (it sees the prefix and itself) and is never read; its K/V
  lands after the real rows and the commit drops it;
* the cache (lp.model.kv.PackedCache in static mode) is written at positions read from a
  device tensor and read whole, the mask hiding the unfilled tail;
* inputs (token ids, positions, write positions) are copied into static device
  buffers; no tensor is built on the host inside the forward.

The mask buffer ``[1, 1, Q_max, capacity]`` holds 0 (visible) for the cached prefix,
the tree block of the current step, and the most negative value elsewhere; a step
rewrites only the columns that changed since the previous one.

Steps longer than the largest bucket (the prefill) run eagerly through the same
cache. The capture itself runs only on CUDA; on the CPU the same static path runs
uncaptured, which is how it is tested.

Legend: Qb bucket rows, Q real rows, C cache capacity, V vocabulary.
"""

from __future__ import annotations

import torch

from lp.model.kv import PackedCache

BUCKETS = (8, 16, 32, 64, 128, 256, 512)


def bucket_for(q: int) -> int | None:
    return next((b for b in BUCKETS if b >= q), None)


class StaticStepper:
    def __init__(self, runner, capture: bool):
        if runner.attention not in ("sdpa", "eager"):
            raise ValueError(
                f"model.cuda_graphs=true runs the dense-mask kernels (model.attention=sdpa or eager), "
                f"got model.attention={runner.attention}"
            )
        if runner.sliding_window is not None:
            raise ValueError("model.cuda_graphs=true does not support sliding-window models yet")
        self.runner = runner
        self.capture = capture
        self.cache: PackedCache | None = None
        self.graphs: dict = {}  # bucket -> (graph, logits buffer)
        self.inputs: dict = {}  # bucket -> (ids_1Qb, pos_1Qb, write_Qb, keep_Qb)
        self._local: dict = {}

    # -- per generation ------------------------------------------------------------

    def new_cache(self, capacity: int, max_step_rows: int) -> PackedCache:
        top = bucket_for(max_step_rows) or max_step_rows
        capacity += top  # room for the padding rows of the last step
        if self.cache is None or self.cache.capacity < capacity:
            r = self.runner
            self.cache = PackedCache(capacity, full_view=True)
            self.mask = torch.full((1, 1, top, capacity), torch.finfo(r.dtype).min, dtype=r.dtype, device=r.device)
            self.graphs.clear()  # captured against the old buffers
            self.inputs.clear()
        else:
            self.cache.reset()
            self.mask.fill_(torch.finfo(self.runner.dtype).min)
        self.cache.write_index = None
        self._visible_end = 0
        self._dirty = (0, 0)
        return self.cache

    # -- the step ----------------------------------------------------------------------

    def forward(self, layout, cache) -> torch.Tensor:
        assert cache is self.cache, "static steps run on the stepper's own cache"
        r = self.runner
        sk = layout.skeleton
        q = sk.num_rows
        k = cache.get_seq_length()
        qb = bucket_for(q) if q <= self.mask.shape[2] else None
        neg = torch.finfo(r.dtype).min
        depths_Q, keep, local_add_QQ, _ = r._tensors(sk)
        if qb is None:  # the prefill: eager, one-off mask over the whole buffer
            mask = torch.full((1, 1, q, cache.capacity), neg, dtype=r.dtype, device=r.device)
            mask[0, 0, :, :k] = 0
            mask[0, 0, :, k : k + q] = local_add_QQ
            cache.write_index = torch.arange(k, k + q, device=r.device)
            ids = torch.tensor([layout.tokens], dtype=torch.long).to(r.device)
            logits = self._model(ids, (depths_Q + k)[None], mask, cache, keep)
            cache.set_length(k + q)
            self._visible_end = 0
            self.mask.fill_(neg)
            self._dirty = (0, 0)
            return logits
        ids_1Qb, pos_1Qb, write_Qb, arange_Qb = self._inputs(qb)
        # inputs into the static buffers
        host = torch.zeros(qb, dtype=torch.long)
        host[:q] = torch.tensor(layout.tokens, dtype=torch.long)
        ids_1Qb[0].copy_(host, non_blocking=True)
        pos_1Qb[0].fill_(k)
        pos_1Qb[0, :q].add_(depths_Q)
        torch.add(arange_Qb, k, out=write_Qb)
        # mask: only the columns that changed
        a, b = self._dirty
        if b > a:
            self.mask[:, :, :, a:b].fill_(neg)
        if k > self._visible_end:
            self.mask[:, :, :, self._visible_end : k].zero_()
        self._visible_end = k
        self.mask[0, 0, :qb, k : k + qb] = self._local_block(sk, qb, local_add_QQ)
        self._dirty = (k, k + qb)
        cache.write_index = write_Qb
        if self.capture:
            logits_QbV = self._replay(qb, ids_1Qb, pos_1Qb, arange_Qb)
        else:
            logits_QbV = self._model(ids_1Qb, pos_1Qb, self.mask[:, :, :qb], cache, arange_Qb)
        cache.set_length(k + qb)
        return logits_QbV.index_select(0, keep)

    def _model(self, ids, pos, mask, cache, keep) -> torch.Tensor:
        r = self.runner
        with r._kernel():
            out = r.model(input_ids=ids, position_ids=pos, attention_mask=mask, **{r._cache_kw: cache},
                          use_cache=True, logits_to_keep=keep)
        return out.logits[0].float()

    def _inputs(self, qb: int):
        t = self.inputs.get(qb)
        if t is None:
            dev = self.runner.device
            t = (
                torch.zeros(1, qb, dtype=torch.long, device=dev),
                torch.zeros(1, qb, dtype=torch.long, device=dev),
                torch.zeros(qb, dtype=torch.long, device=dev),
                torch.arange(qb, dtype=torch.long, device=dev),
            )
            self.inputs[qb] = t
        return t

    def _local_block(self, sk, qb: int, local_add_QQ: torch.Tensor) -> torch.Tensor:
        key = (sk, qb)
        block = self._local.get(key)
        if block is None:
            r = self.runner
            q = sk.num_rows
            block = torch.full((qb, qb), torch.finfo(r.dtype).min, dtype=r.dtype, device=r.device)
            block[:q, :q] = local_add_QQ
            idx = torch.arange(q, qb, device=r.device)
            block[idx, idx] = 0  # a padding row sees the prefix and itself
            if len(self._local) > 4096:
                self._local.clear()
            self._local[key] = block
        return block

    def _replay(self, qb, ids_1Qb, pos_1Qb, arange_Qb) -> torch.Tensor:
        entry = self.graphs.get(qb)
        if entry is None:
            mask = self.mask[:, :, :qb]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, cuBLAS)
                for _ in range(2):
                    self._model(ids_1Qb, pos_1Qb, mask, self.cache, arange_Qb)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._model(ids_1Qb, pos_1Qb, mask, self.cache, arange_Qb)
            entry = self.graphs[qb] = (graph, logits)
        graph, logits = entry
        graph.replay()
        return logits
