"""lp: exact lookahead decoding and Lookahead Parallelism for transformers causal LMs.

Python API::

    from lp import DecodingConfig, ModelRunner, LookaheadDecoder
    runner = ModelRunner(model)                      # any sdpa/eager decoder-only LM
    result = LookaheadDecoder(runner, DecodingConfig(W=5, N=4, G=5)).generate(prompt_ids)
    result.output_ids, result.stats.compression_ratio
    results = generate_batch(decoder, [ids_a, ids_b])   # several prompts in batched steps
    engine = BatchEngine(runner, kv_tokens=16384)       # the continuous-batching engine lp.serve drives

The layers under it, lowest first (each folder's ``__init__`` states its contract):
``lookahead`` (the algorithm over token ids) < ``drafts`` < ``model`` (transformers) <
``parallel`` (torch.distributed) < ``engine`` (the loops) < ``server``; ``config`` is a leaf
every layer reads; this module, ``cli``, ``generate`` and ``serve`` sit on top.
"""

from lp.config import DecodingConfig, GenerateConfig, ModelConfig, ParallelConfig
from lp.engine.batch import BatchEngine, generate_batch
from lp.engine.decoder import GenerationResult, GenerationStats, LookaheadDecoder
from lp.model.runner import ModelRunner
from lp.model.loader import load_model, resolve_model_path

__all__ = [
    "BatchEngine",
    "DecodingConfig",
    "GenerateConfig",
    "GenerationResult",
    "GenerationStats",
    "LookaheadDecoder",
    "ModelConfig",
    "ModelRunner",
    "ParallelConfig",
    "generate_batch",
    "load_model",
    "resolve_model_path",
]
