"""The paper's algorithm over token ids: what one lookahead step proposes, packs and accepts.

Knows: token ids, the 2-D Jacobi window, the n-gram pool, the packed row layout (tokens,
positions, parent forest), the draft trie, greedy and sampling verification, the shard plan
that splits a step's rows over LP workers, and the per-row logits processors (bias and
penalties over each row's own history, torch tensors on any device).
Never imports: transformers, torch.distributed, or any other lp folder (lp.config is the
one lp module it may read); everything here is tested with literal lists.

Modules: ``window`` (Jacobi window), ``pool`` (n-gram pool, prompt context index),
``tree`` (draft trie), ``layout`` (packed rows and masks), ``verify`` (greedy walk),
``sampling`` (warpers, the lossless multi-candidate verifier), ``shard`` (rows per worker),
``processors`` (logit_bias / penalties per row).
"""
