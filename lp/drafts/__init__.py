"""Where candidates come from and how many are verified.

Knows: the suffix index over the prompt and output and the cross-request draft store
(``suffix``), selecting one draft tree per sequence or per batch (``select``), and the
draft budget that prices rows on a measured t(Q) curve given as a plain list (``budget``).
Imports only lp.lookahead (the trie); never transformers, torch.distributed, a model or a
cache: timing reaches it as an argument.
"""
