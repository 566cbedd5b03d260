"""The loops: one sequence (``decoder``: LookaheadDecoder) and a batch of them (``batch``: BatchEngine).

Knows: how one step is assembled from the lower layers (drafts and window -> layout ->
forward -> processors -> verification -> exchange -> commit) and how a batch of sequences
shares one forward over the paged pool.
Imports: lp.parallel, lp.model, lp.drafts, lp.lookahead, lp.config; ``batch`` imports
``decoder``, never the reverse. Never imports lp.server or the entry points.
"""
