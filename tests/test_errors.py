"""Bad input raises ValueError naming the offending field."""

from __future__ import annotations

import pytest
import torch

from lp.config import DecodingConfig, GenerateConfig, ModelConfig, ParallelConfig
from lp.engine.decoder import LookaheadDecoder
from lp.model.runner import ModelRunner
from lp.model.loader import resolve_dtype, resolve_model_path
from tests.helpers import hf_greedy, lookahead


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(W=0), "decoding.W"),
        (dict(W=-3), "decoding.W"),
        (dict(W=2.0), "decoding.W"),
        (dict(W=True), "decoding.W"),
        (dict(N=1), "decoding.N"),
        (dict(N=0), "decoding.N"),
        (dict(G=-1), "decoding.G"),
        (dict(max_new_tokens=0), "decoding.max_new_tokens"),
        (dict(max_new_tokens=-5), "decoding.max_new_tokens"),
        (dict(mode="beam"), "decoding.mode"),
        (dict(temperature=0.0), "decoding.temperature"),
        (dict(top_k=-1), "decoding.top_k"),
        (dict(top_p=0.0), "decoding.top_p"),
        (dict(top_p=1.5), "decoding.top_p"),
        (dict(seed=1.5), "decoding.seed"),
        (dict(stop_strings=[""]), "decoding.stop_strings"),
    ],
)
def test_decoding_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        DecodingConfig(**kwargs).validate()


def test_decoding_config_valid_edges():
    DecodingConfig(W=1, N=2, G=0, max_new_tokens=1).validate()
    DecodingConfig(top_p=1.0, top_k=0, temperature=0.1).validate()


def test_other_configs_validation():
    with pytest.raises(ValueError, match=r"model\.dtype"):
        ModelConfig(dtype="int8").validate()
    with pytest.raises(ValueError, match=r"model\.device"):
        ModelConfig(device="tpu").validate()
    with pytest.raises(ValueError, match=r"model\.threads"):
        ModelConfig(threads=-1).validate()
    with pytest.raises(ValueError, match=r"parallel\.workers"):
        ParallelConfig(workers=0).validate()
    with pytest.raises(ValueError, match=r"parallel\.backend"):
        ParallelConfig(backend="mpi").validate()
    with pytest.raises(ValueError, match=r"parallel\.timeout_s"):
        ParallelConfig(timeout_s=0).validate()
    with pytest.raises(ValueError, match=r"decoding\.N"):
        GenerateConfig(decoding=DecodingConfig(N=1)).validate()
    with pytest.raises(ValueError, match="prompt"):
        GenerateConfig(prompt="a", prompt_file="b").validate()
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", torch.device("cpu"))
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_decoder_validates_config(tiny_factory):
    runner = ModelRunner(tiny_factory("llama"))
    with pytest.raises(ValueError, match=r"decoding\.W"):
        LookaheadDecoder(runner, DecodingConfig(W=0))
    with pytest.raises(ValueError, match=r"decoding\.N"):
        LookaheadDecoder(runner, DecodingConfig(N=1))


def test_empty_prompt(tiny_factory):
    runner = ModelRunner(tiny_factory("llama"))
    with pytest.raises(ValueError, match="prompt"):
        LookaheadDecoder(runner, DecodingConfig()).generate([])


def test_prompt_ids_out_of_vocabulary(tiny_factory):
    runner = ModelRunner(tiny_factory("llama"))
    with pytest.raises(ValueError, match="prompt"):
        LookaheadDecoder(runner, DecodingConfig()).generate([1, 2, 128])
    with pytest.raises(ValueError, match="prompt"):
        LookaheadDecoder(runner, DecodingConfig()).generate([1, -1])


def test_prompt_plus_max_new_tokens_beyond_context(tiny_factory):
    model = tiny_factory("llama", max_positions=32)
    runner = ModelRunner(model)
    assert runner.max_positions == 32
    prompt = [5, 17, 33, 9] * 5  # 20 tokens
    with pytest.raises(ValueError, match="max_new_tokens"):
        LookaheadDecoder(runner, DecodingConfig(max_new_tokens=13)).generate(prompt)
    with pytest.raises(ValueError, match="max_new_tokens"):
        LookaheadDecoder(runner, DecodingConfig(max_new_tokens=1)).generate(list(range(32)))
    # exactly filling the context is fine, and still exact
    res = lookahead(runner, prompt, max_new_tokens=12, W=5, N=4, G=5)
    assert res.output_ids == hf_greedy(model, prompt, 12)


def test_stop_strings_need_a_tokenizer(tiny_factory):
    runner = ModelRunner(tiny_factory("llama"))
    with pytest.raises(ValueError, match="stop_strings"):
        LookaheadDecoder(runner, DecodingConfig(stop_strings=["x"])).generate([1, 2, 3])


def test_unknown_model_path():
    with pytest.raises(ValueError, match=r"model\.path"):
        resolve_model_path("x", "/nonexistent")
    with pytest.raises(ValueError, match=r"model\.name"):
        resolve_model_path("not-a-model", None)


def test_model_path_without_config(tmp_path):
    with pytest.raises(ValueError, match=r"model\.path"):
        resolve_model_path("smollm2", str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path("smollm2", str(tmp_path)) == tmp_path


def test_refuses_encoder_decoder():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    model = T5ForConditionalGeneration(cfg)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="decoder-only"):
        ModelRunner(model)
