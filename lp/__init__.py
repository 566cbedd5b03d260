"""lp: exact lookahead decoding and Lookahead Parallelism for transformers causal LMs.

Python API::

    from lp import DecodingConfig, ModelRunner, LookaheadDecoder
    runner = ModelRunner(model)                      # any sdpa/eager decoder-only LM
    result = LookaheadDecoder(runner, DecodingConfig(W=5, N=4, G=5)).generate(prompt_ids)
    result.output_ids, result.stats.compression_ratio
"""

from lp.config import DecodingConfig, GenerateConfig, ModelConfig, ParallelConfig
from lp.engine.decoder import GenerationResult, GenerationStats, LookaheadDecoder
from lp.model.runner import ModelRunner
from lp.model.loader import load_model, resolve_model_path

__all__ = [
    "DecodingConfig",
    "GenerateConfig",
    "GenerationResult",
    "GenerationStats",
    "LookaheadDecoder",
    "ModelConfig",
    "ModelRunner",
    "ParallelConfig",
    "load_model",
    "resolve_model_path",
]
