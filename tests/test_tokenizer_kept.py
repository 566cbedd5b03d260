"""A kept tokenizer loads straight from its tokenizer.json, and only where that is the same tokenizer
(lp.model.tokenizer; issue 50, item 5: restarts).

A GGUF file's first read keeps its tokenizer (lp.model.gguf.metadata_dir) and checks that a plain
TokenizersBackend over the kept tokenizer.json, given the class's attributes, is the same tokenizer;
a restart then loads that and never runs the class's Python rebuild of the vocabulary. A class that
does more than its Rust pipeline, or any difference the check finds, keeps the class's load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gguf_tiny import Q4_K_M, write_tiny_gguf



def _texts(tok) -> list:
    chat = [{"role": "user", "content": "Write def f(x): in Python."}]
    prompts = ["def f(x):\n    return x", " spaced  out ", "<|im_start|>hi<|im_end|>", "naïve 😀"]
    return ([tok.encode(p) for p in prompts] + [tok.decode(tok.encode(p)) for p in prompts]
            + [tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)])


def test_a_restart_loads_the_kept_tokenizer_json_as_it_is(tokenizer, tmp_path, monkeypatch):
    """First read: the class's tokenizer kept with a positive marker; restart: a plain
    TokenizersBackend from the file (the class never runs), the same encodings, decodings, chat
    rendering and attributes as the class's load."""
    import transformers
    from transformers import AutoTokenizer, TokenizersBackend

    from lp.model import tokenizer as kept
    from lp.model.gguf import metadata_dir
    from lp.model.loader import default_cache_dir, load_model, load_tokenizer

    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    file = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", Q4_K_M, tokenizer, seed=3, tie=False)
    first = load_model(file, "auto", quant="none")[1]  # the first read keeps the metadata, the tokenizer among it
    meta = metadata_dir(file, default_cache_dir())
    marker = json.loads((meta / kept.MARKER).read_text())
    assert marker["kwargs"] is not None and marker["why"] is None, marker
    ref = AutoTokenizer.from_pretrained(meta)

    def no_class(*a, **k):
        raise AssertionError("the restart ran the tokenizer class's load")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_class)
    again = load_tokenizer(file)
    assert type(again) is TokenizersBackend
    assert kept.difference(ref, again) is None
    assert _texts(again) == _texts(ref) == _texts(first)
    assert again.chat_template == ref.chat_template and again.eos_token_id == ref.eos_token_id


def test_the_first_read_checks_against_what_a_restart_would_load(tokenizer, tmp_path, monkeypatch):
    """The first read holds the direct load against the class's reload of the kept folder (what a
    restart would otherwise load), not against the tokenizer transformers' GGUF reader built: those
    differ (Gemma-3's file: ``add_bos_token`` True from the reader, False reloaded, the same
    encodings), and the marker then said no for a tokenizer the restart loads the same."""
    from lp.model import tokenizer as kept
    from lp.model.gguf import metadata_dir
    from lp.model.loader import default_cache_dir, load_model

    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    file = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", Q4_K_M, tokenizer, seed=3, tie=False)
    refs, real = [], kept.difference

    def spy(ref, tok):
        refs.append(ref.name_or_path)
        return real(ref, tok)

    monkeypatch.setattr(kept, "difference", spy)
    load_model(file, "auto", quant="none")
    meta = metadata_dir(file, default_cache_dir())
    assert len(refs) == 1 and Path(refs[0]).parent == meta.parent, refs  # the kept folder's reload (a temporary name)
    assert json.loads((meta / kept.MARKER).read_text())["why"] is None


def test_a_tokenizer_that_differs_keeps_its_class(tokenizer, tmp_path, monkeypatch):
    """Attributes the class set (a left padding side here) travel in the marker; a class that
    overrides a method, or a changed tokenizer.json, is loaded through the class (checked again)."""
    from transformers import AutoTokenizer, TokenizersBackend

    from lp.model import tokenizer as kept
    from lp.model.gguf import metadata_dir
    from lp.model.loader import default_cache_dir, load_model

    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    file = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", Q4_K_M, tokenizer, seed=3, tie=False)
    load_model(file, "auto", quant="none")
    meta = metadata_dir(file, default_cache_dir())
    ref = AutoTokenizer.from_pretrained(meta)

    ref.padding_side = "left"  # as GemmaTokenizer's class attribute sets it
    assert kept.keep(ref, meta) is None
    direct = kept.load_kept(meta)
    assert type(direct) is TokenizersBackend and direct.padding_side == "left"
    direct.padding_side = "right"
    assert kept.difference(ref, direct) == "padding_side differs"

    class Decorated(TokenizersBackend):  # more than a pipeline: a decode of its own
        def decode(self, *a, **k):
            return "!" + super().decode(*a, **k)

    odd = Decorated(tokenizer_file=str(meta / "tokenizer.json"))
    why = kept.keep(odd, meta)
    assert why is not None and "Decorated defines decode" in why
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: odd)
    assert kept.load_kept(meta) is odd  # the negative marker: the class's load, not the file's

    kept.keep(ref, meta)
    (meta / "tokenizer.json").write_text((meta / "tokenizer.json").read_text())  # touched: a new key
    assert kept._read_marker(meta) is None
    assert kept.load_kept(meta) is odd  # re-checked through the class (and marked again)
    assert json.loads((meta / kept.MARKER).read_text())["why"] is not None
