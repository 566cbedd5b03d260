"""The defaults are the fast path (``model.quant=auto``): a model whose linears are exact 4-bit
blocks (a GGUF Q4 model dequantized, like lp's default SmolLM2) runs exact4 with no flag, on the
loaded model's own weights; any other model stays as it was, without building a kernel; the
CLI's output equals transformers ``generate`` on the model it actually ran."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import nn

from lp.config import DecodingConfig, GenerateConfig, ModelConfig
from lp.model import loader
from lp.kernels import exact4, idot
from lp.model.loader import load_model, load_tokenizer, resolve_model_path
from lp.model.quant import quantize
from tests.helpers import hf_greedy, make_tiny_model
from tests.test_exact4 import to_q4_blocks

pytestmark = [pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="x86 CPU kernels"),
              pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ninja") is None,
                                 reason="the exact4 kernel is built with g++ and ninja")]


def _fast_kernel() -> bool:
    """auto's exact4 on q4_dir's Q4_1 blocks: exact4's AVX-512 kernels, or idot's AVX2 ones."""
    return _avx512() or idot.available()


def _avx512() -> bool:
    """exact4's float kernels (the 16-bit ones too) run only with AVX-512; elsewhere 16-bit
    checkpoints stay float32 on torch's linears."""
    return bool(exact4.extension().avx512())


def _save(model: nn.Module, path, with_tokenizer: bool = False):
    model.save_pretrained(path)
    if with_tokenizer:
        load_tokenizer(resolve_model_path("smollm2", None)).save_pretrained(path)  # SmolLM2's tokenizer files
    return path


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    """A tiny Llama with SmolLM2's vocabulary and tokenizer, its linears rounded to Q4_1 blocks."""
    return _save(to_q4_blocks(make_tiny_model(vocab=49152)), tmp_path_factory.mktemp("q4"), with_tokenizer=True)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return _save(make_tiny_model(), tmp_path_factory.mktemp("dense"))


def _n_exact4(model) -> int:
    return sum(isinstance(m, exact4.Exact4Linear) for m in model.modules())


def test_auto_is_the_default_of_every_entry_point():
    from lp.server.config import ServeConfig

    assert ModelConfig().quant == "auto" and GenerateConfig().model.quant == "auto"
    assert ServeConfig().model.quant == "auto"


def test_auto_runs_exact4_on_blocks_and_leaves_other_models_alone(q4_dir, dense_dir, monkeypatch):
    model, _ = load_model(q4_dir, "float32", quant="auto", tokenizer=False)
    want = "exact4" if _fast_kernel() else None
    assert getattr(model, "_lp_quant", None) == want
    assert (_n_exact4(model) > 0) == (want == "exact4")

    # a model without blocks never asks for the kernel
    def no_kernel():
        raise AssertionError("auto built exact4's kernel for a model without 4-bit blocks")

    monkeypatch.setattr(exact4, "extension", no_kernel)
    model, _ = load_model(dense_dir, "float32", quant="auto", tokenizer=False)
    assert getattr(model, "_lp_quant", None) is None and _n_exact4(model) == 0


def test_auto_falls_back_to_none_when_the_kernel_cannot_be_built(q4_dir, monkeypatch):
    def missing():
        raise ValueError("model.quant=exact4 needs a C++ compiler (g++) and ninja to build its kernel")

    monkeypatch.setattr(exact4, "extension", missing)
    model, _ = load_model(q4_dir, "float32", quant="auto", tokenizer=False)
    assert getattr(model, "_lp_quant", None) is None and _n_exact4(model) == 0
    with pytest.raises(ValueError, match="needs a C.. compiler"):  # asked for by name: the user's error
        quantize(copy.deepcopy(model), "exact4")


def test_auto_dtype_on_an_amx_cpu_keeps_float32_only_for_blocks(q4_dir, dense_dir, monkeypatch):
    monkeypatch.setattr(loader, "cpu_has_amx_bf16", lambda: True)
    model, _ = load_model(dense_dir, "auto", quant="auto", tokenizer=False)
    assert next(model.parameters()).dtype == torch.bfloat16
    model, _ = load_model(q4_dir, "auto", quant="auto", tokenizer=False)
    assert next(model.parameters()).dtype == torch.float32
    assert getattr(model, "_lp_quant", None) == ("exact4" if _fast_kernel() else None)


def test_generate_cli_defaults_equal_generate_on_the_model_it_ran(q4_dir):
    from lp.generate import run

    res = run(GenerateConfig(model=ModelConfig(path=str(q4_dir)), decoding=DecodingConfig(max_new_tokens=24),
                             prompt="Count: one two three one two three", stream=False))
    assert res["quant"] == ("exact4" if _fast_kernel() else "none")
    ref_model, _ = load_model(q4_dir, "float32", quant=res["quant"], tokenizer=False)
    assert res["output_ids"] == hf_greedy(ref_model, res["prompt_ids"], 24)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def half_dir(request, tmp_path_factory):
    """A tiny Llama saved as a bf16 / fp16 checkpoint (the dtype most published models ship in)."""
    return _save(make_tiny_model(seed=5).to(request.param), tmp_path_factory.mktemp("half")), request.param


def test_a_16_bit_checkpoint_runs_its_2_byte_weights_exactly_by_default(half_dir, monkeypatch):
    """The defaults (model.dtype=auto, model.quant=auto) on a bf16 / fp16 checkpoint: every decoder
    linear keeps its weights in 2 bytes on lp's exact 16-bit kernel (widened in the kernel), and
    greedy lookahead, one sequence and batched, equals float32 ``generate`` on the checkpoint,
    token for token, on this CPU and on an AMX one (whose auto dtype would be bf16: not exact)."""
    from transformers import AutoModelForCausalLM

    from lp.config import DecodingConfig as DC
    from lp.engine.decoder import LookaheadDecoder
    from lp.model.runner import ModelRunner
    from tests.helpers import BATCH_PROMPTS, REPETITIVE_PROMPT, batch_outputs, hf_greedy

    path, dtype = half_dir
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    for amx in (False, True):
        monkeypatch.setattr(loader, "cpu_has_amx_bf16", lambda: amx)
        model, _ = load_model(path, "auto", quant="auto", tokenizer=False)
        assert next(model.parameters()).dtype == torch.float32
        half = idot.half_kinds()  # AVX2 without AVX-512: idot's kinds 32 / 33
        if not _avx512() and not half:
            assert getattr(model, "_lp_quant", None) is None
            continue
        kernels = [m for m in model.modules() if isinstance(m, idot.IDotLinear if half else exact4.Exact16Linear)]
        linears = [m for m in ref.model.layers.modules() if isinstance(m, nn.Linear)]
        assert sum(len(m.splits) for m in kernels) == len(linears) and model._lp_quant == "exact4"
        if half:
            assert all(m.ikind == (33 if dtype == torch.bfloat16 else 32) for m in kernels)
        else:
            assert all(m.bf16 == (dtype == torch.bfloat16) for m in kernels)
        assert not [n for n, p in model.model.layers.named_parameters() if p.dim() == 2]  # no float32 copy
        runner = ModelRunner(model)
        got = LookaheadDecoder(runner, DC(max_new_tokens=40)).generate(REPETITIVE_PROMPT).output_ids
        assert got == hf_greedy(ref, REPETITIVE_PROMPT, 40)
        for prompt, out in zip(BATCH_PROMPTS, batch_outputs(runner, DC(max_new_tokens=16))):
            assert out == hf_greedy(ref, prompt, 16)
