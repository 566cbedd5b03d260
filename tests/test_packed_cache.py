"""A GGUF file's loaded model is kept as it runs and read back by memory map (lp.model.packed;
issue 50, item 5: restarts).

The first load packs the file's blocks for the kernels, keeps the model beside the file's metadata
and serves from that kept file; a restart reads it without parsing or packing anything. Both compute
the same logits bit for bit and the same greedy lookahead as the file's plain loads; a changed
fingerprint (here the ``LP_IDOT`` switch, which changes the kernels chosen) or a damaged file builds
the model from the GGUF file again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gguf_tiny import Q4_K_M, write_tiny_gguf

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"


def _kept(file: Path) -> list[Path]:
    from lp.model.gguf import metadata_dir
    from lp.model.loader import default_cache_dir

    return sorted(metadata_dir(file, default_cache_dir()).glob("packed-*.pt"))


def _mapped_from(model, path: Path) -> bool:
    """Whether the model's packed tensors live in ``path``'s pages (a memory map), not on the heap."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            spans.append((lo, hi))
    big = [b for b in model.buffers() if b.numel() > 1024]
    return bool(big) and all(any(lo <= b.data_ptr() < hi for lo, hi in spans) for b in big)


def _greedy(model, tok, ids: list[int]) -> list[int]:
    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.model.runner import ModelRunner

    out = LookaheadDecoder(ModelRunner(model), DecodingConfig(max_new_tokens=24)).generate(
        ids, eos_token_ids=[tok.eos_token_id])
    return out.output_ids


def test_a_restart_reads_the_kept_model_and_computes_the_same(tokenizer, tmp_path, monkeypatch):
    from lp.kernels import idot
    from lp.kernels.exact4 import Exact4Linear, extension
    from lp.model import gguf
    from lp.model.loader import load_model

    if not (extension().avx512() or idot.available()):
        pytest.skip("no exact kernel runs the file's blocks on this CPU")
    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    file = write_tiny_gguf(tmp_path / "qwen2-Q4_K_M.gguf", "qwen2", Q4_K_M, tokenizer, seed=3)
    first, tok = load_model(file, "auto", quant="auto")
    [kept] = _kept(file)
    assert _mapped_from(first, kept)  # the first start serves from the kept file too
    ids = tok(PROMPT)["input_ids"]
    x = torch.tensor([ids])

    def no_parse(*a, **k):
        raise AssertionError("the restart read the GGUF file's tensors")

    monkeypatch.setattr(gguf, "_read_tensors", no_parse)
    again, _ = load_model(file, "auto", quant="auto")
    assert _mapped_from(again, kept)
    assert str(again) == str(first)  # the same modules, kernels among them
    assert any(isinstance(m, Exact4Linear) for m in again.modules())
    with torch.no_grad():
        assert torch.equal(first(x).logits, again(x).logits)
    assert _greedy(again, tok, ids) == _greedy(first, tok, ids)

    monkeypatch.undo()
    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    plain, _ = gguf.load_gguf(file, tokenizer=False)  # no cache: built from the file, nothing kept or mapped
    assert not _mapped_from(plain, kept)
    with torch.no_grad():
        assert torch.equal(plain(x).logits, again(x).logits)


def test_a_changed_fingerprint_or_a_damaged_file_builds_again(tokenizer, tmp_path, monkeypatch, caplog):
    import logging

    from lp.kernels import idot
    from lp.model.loader import load_model

    if not idot.available():
        pytest.skip("idot does not run here: LP_IDOT changes nothing")
    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    file = write_tiny_gguf(tmp_path / "llama-Q4_K_M.gguf", "llama", Q4_K_M, tokenizer, seed=5, tie=False)
    with_idot, _ = load_model(file, "auto", quant="auto", tokenizer=False)
    assert any(isinstance(m, idot.IDotLinear) for m in with_idot.modules())
    [kept] = _kept(file)

    monkeypatch.setenv("LP_IDOT", "0")  # the float kernels instead: another fingerprint, built again
    without, _ = load_model(file, "auto", quant="auto", tokenizer=False)
    assert not any(isinstance(m, idot.IDotLinear) for m in without.modules())
    [other] = _kept(file)
    assert other != kept  # the older fingerprint's file is gone

    # damaged (a new file under the name: rewriting the one mapped in place would pull its pages from under
    # ``without``; lp itself only ever renames a finished file over it): the read fails, built again
    half = other.with_name("half")
    half.write_bytes(other.read_bytes()[: other.stat().st_size // 2])
    half.replace(other)
    with caplog.at_level(logging.WARNING, logger="lp.model.packed"):
        rebuilt, tok = load_model(file, "auto", quant="auto")
    assert any("does not read" in r.getMessage() for r in caplog.records)
    [fresh] = _kept(file)
    assert _mapped_from(rebuilt, fresh)
    x = torch.tensor([tok(PROMPT)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(rebuilt(x).logits, without(x).logits)
