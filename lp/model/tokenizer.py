"""A kept tokenizer folder loaded straight from its ``tokenizer.json`` (issue 50, item 5: a restart
in <= 10 s).

Contract: ``load_kept(folder)`` returns a tokenizer that behaves as ``AutoTokenizer.from_pretrained(folder)``
does: either that one, or a plain ``TokenizersBackend`` built from the folder's ``tokenizer.json`` with
the attributes kept in ``folder/lp_tokenizer.json`` (``MARKER``), once ``difference`` found the two the
same tokenizer. ``keep(tok, folder)`` makes that check for a tokenizer just saved to ``folder`` and
writes the marker (a negative one, with the reason, where they differ or the class is not eligible:
later loads then go through the class without checking again). The marker names the transformers
version and the ``tokenizer.json`` it was checked against (size and mtime); any change re-checks.

Why: transformers 5's tokenizer classes (GemmaTokenizer, LlamaTokenizer, Qwen2Tokenizer,
GPT2Tokenizer, ...) re-read the whole ``tokenizer.json`` in Python, vocabulary and merges as Python
objects, to rebuild the Rust tokenizer that file already describes: Gemma-3's 262,144 tokens and
514,906 merges take 3.1-3.8 s, and their ~1M objects are walked by every later ``gc.collect``
(~0.23 s each). Those classes define nothing but ``__init__`` (and the model class), so their
behaviour is the Rust pipeline plus a few attributes (``ELIGIBLE``); loading the file as it is takes
1.2-1.5 s on Gemma-3, 0.1 s on SmolLM2 (1.3 s through its class).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

MARKER = "lp_tokenizer.json"
# what the check encodes and decodes (with and without special tokens): plain and spaced text, code,
# special tokens written out, several scripts and emoji (byte fallback), whitespace runs, empty
TEXTS = ("Hello world", " leading space", "def f(x):\n    return x * 2\n", "trailing space ",
         "<s>a</s><bos>b<eos><|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "日本語のテキスト 😀 naïve café",
         "  two  spaces\t\ttabs\n\n\nnewlines", "", "1234567890 3.14159 -x_y+z", "ÅΩ∑ \u200b zero-width")
# attributes a tokenizer class may set that the direct load must carry (besides the special tokens)
ATTRS = ("padding_side", "truncation_side", "model_max_length", "clean_up_tokenization_spaces",
         "model_input_names", "chat_template")


def load_kept(folder: Path):
    """The tokenizer kept in ``folder`` (module doc): straight from its ``tokenizer.json`` where the
    marker says that load is the same tokenizer, else through ``AutoTokenizer`` (checked and marked
    the first time)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    spec = _read_marker(folder)
    if spec is not None and spec.get("kwargs") is not None:
        try:
            return _direct(folder, spec["kwargs"])
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file: the class's load, re-checked
            log.warning("%s: loading %s as it is failed (%s); through its tokenizer class", folder, MARKER, e)
            spec = None
    tok = AutoTokenizer.from_pretrained(folder)
    if spec is None:
        keep(tok, folder)
    return tok


def keep(tok, folder: Path) -> str | None:
    """Check that ``folder``'s ``tokenizer.json`` loaded as it is (with ``tok``'s attributes) is ``tok``,
    and write the marker saying so (or why not, returned). ``tok`` None: the class's load of ``folder``,
    what a restart would otherwise load (a tokenizer just saved there may differ from its reload: a GGUF
    file's, read by transformers, says ``add_bos_token`` True and its reload False, the same encodings)."""
    folder = Path(folder)
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
    why = _ineligible(tok)
    kwargs = None
    if why is None:
        kwargs = _kwargs(tok)
        try:
            why = difference(tok, _direct(folder, kwargs))
        except Exception as e:  # noqa: BLE001 - any failure of the direct load: not the same tokenizer
            why = f"the direct load failed: {type(e).__name__}: {e}"
    if why is not None:
        log.info("%s: the tokenizer loads through %s (%s)", folder.name, type(tok).__name__, why)
        kwargs = None
    key = _key(folder)
    if key is None:
        return why
    tmp = folder / f"{MARKER}.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"key": key, "kwargs": kwargs, "why": why}))
    os.replace(tmp, folder / MARKER)
    return why


def difference(ref, tok) -> str | None:
    """None where ``tok`` behaves as ``ref`` on what lp and its users call (the pipeline, vocabulary,
    added and special tokens, ``ATTRS``, ``TEXTS`` encoded and decoded one by one and as a batch, a
    chat rendered), else what differs first."""
    if ref.backend_tokenizer.to_str() != tok.backend_tokenizer.to_str():
        return "the Rust pipelines differ"
    if ref.get_vocab() != tok.get_vocab():
        return "the vocabularies differ"
    if {i: str(t) for i, t in ref.added_tokens_decoder.items()} != {i: str(t) for i, t in tok.added_tokens_decoder.items()}:
        return "the added tokens differ"
    for name in ("special_tokens_map", "all_special_ids", "bos_token_id", "eos_token_id", "pad_token_id",
                 "unk_token_id", "add_bos_token", "add_eos_token", *ATTRS):
        if getattr(ref, name, None) != getattr(tok, name, None):
            return f"{name} differs"
    for text in TEXTS:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            if ids != tok.encode(text, add_special_tokens=special):
                return f"encoding {text!r} (special tokens {special}) differs"
            for skip in (True, False):
                if ref.decode(ids, skip_special_tokens=skip) != tok.decode(ids, skip_special_tokens=skip):
                    return f"decoding {text!r} (skip special {skip}) differs"
        if ref.convert_ids_to_tokens(ref.encode(text)) != tok.convert_ids_to_tokens(ref.encode(text)):
            return f"the tokens of {text!r} differ"
    if dict(ref(list(TEXTS))) != dict(tok(list(TEXTS))):
        return "batch encodings differ"
    if ref.chat_template:
        chat = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Write def f(x):"}]
        try:
            a = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that rejects this chat: the direct load must reject it too
            a = None
        try:
            b = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001
            b = None
        if a != b:
            return "the chat template renders differently"
    return None


def _ineligible(tok) -> str | None:
    """Why ``tok``'s class may do more than its Rust pipeline and attributes (None: it may not)."""
    from transformers import TokenizersBackend

    if not isinstance(tok, TokenizersBackend):
        return f"{type(tok).__name__} is not a tokenizers backend"
    for cls in type(tok).__mro__:
        if cls is TokenizersBackend:
            return None
        own = sorted(k for k, v in vars(cls).items() if k not in ("__init__", "model", "__module__", "__doc__",
                                                                 "__qualname__")
                     and (callable(v) or isinstance(v, (property, classmethod, staticmethod))))
        if own:
            return f"{cls.__name__} defines {', '.join(own[:3])}"
    return "no TokenizersBackend base"


def _kwargs(tok) -> dict:
    """The attributes a plain ``TokenizersBackend`` needs to be ``tok`` (JSON)."""
    kwargs = {k: (v if isinstance(v, list) else str(v)) for k, v in tok.special_tokens_map.items()}
    for name in ATTRS:
        value = getattr(tok, name, None)
        if value is not None:
            kwargs[name] = value
    return kwargs


def _direct(folder: Path, kwargs: dict):
    """The plain ``TokenizersBackend`` of ``folder``'s tokenizer.json, tagged ``_lp_fingerprint``: the
    sha256 of the file it was built from (lp.grammar.matcher keys its kept token bytes by it, instead
    of serializing the pipeline again: 0.66 s for Gemma-3's)."""
    import hashlib

    from transformers import TokenizersBackend

    file = folder / "tokenizer.json"
    data = file.read_bytes()
    tok = TokenizersBackend(tokenizer_file=str(file), name_or_path=str(folder), **kwargs)
    tok._lp_fingerprint = "tokenizer.json " + hashlib.sha256(data).hexdigest()
    return tok


def _key(folder: Path) -> str | None:
    import transformers

    try:
        st = (folder / "tokenizer.json").stat()
        cfg = (folder / "tokenizer_config.json").stat()
    except OSError:
        return None
    return f"transformers {transformers.__version__}; tokenizer.json {st.st_size} {st.st_mtime_ns}; config {cfg.st_mtime_ns}"


def _read_marker(folder: Path) -> dict | None:
    try:
        spec = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(spec, dict) or spec.get("key") != _key(folder):
        return None
    return spec
