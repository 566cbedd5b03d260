"""The one folder that owns torch.distributed.

Knows: torchrun's environment, the (lp, tp) device mesh and its process groups, the per-step
exchange of verdicts between LP workers (one fixed-shape all_gather), the request channel
from rank 0 to the other ranks under lp.serve (``dist``), tensor parallelism over a worker's
tp ranks: a loaded model sharded in memory, or each rank loading only its shards from the
checkpoint (``tp``), and each rank's memory plan made before loading (``memory``).
Imports: lp.model, lp.drafts, lp.lookahead, lp.config. Never imports lp.engine or lp.server:
the loops call into it, it never calls them.
"""
