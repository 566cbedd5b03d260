"""Structured output: grammar masks over token ids, from llguidance (the field's engine).

Knows: a grammar as llguidance's grammar text (compiled from a JSON schema, a regex, a choice
list or a Lark grammar, cached by its source), the tokenizer as llguidance's LLTokenizer
(built once per tokenizer), a matcher per generation that is advanced along each draft row's
tokens, masked and rolled back, and advanced for real on commit; the [rows, V] masks as torch
tensors on any device; the grammar's forced continuation (a draft whose acceptance is certain).
Never imports: any lp folder above lp.lookahead (lp.config is the one other lp module it may
read), torch.distributed; transformers only through llguidance's tokenizer adapter.

Modules: ``matcher`` (compile, RowGrammar, the ``generate`` reference processor).
"""
