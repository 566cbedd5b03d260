"""lp's kernels: what computes a step's products, attention and head, and how it is built.

Knows: building and registering C++ kernels (``build``: one build per CPU, ``opaque_op``), the
linears' small-row and oneDNN-packed matmuls and the fused sibling products (``linears``), linears
on exact 4-bit and 8-bit blocks with their C++ kernel (``exact4``, ``csrc/lp_exact4.cpp``), the
fused decoder stack of an exact4 Llama layer (``fused``), the LM head's greedy screens (``head``),
the packed step's attention functions registered through transformers' ``AttentionInterface``
with the batched step's C++ paged attention (``attention``, ``csrc/lp_attention.cpp``) and the
row-exact one (``exact_attention``), and ``python -m lp.kernels.prebuild``.
Imports: torch and transformers' public interfaces; lp.config at most. Never lp.model (which
imports this folder: the model's loading, runner and caches use these kernels, not the other way;
a cache is recognised by what it holds, e.g. ``PAGED_POOL``), lp.engine, lp.parallel or lp.server.
"""
