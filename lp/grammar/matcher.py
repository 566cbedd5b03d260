"""Grammar masks for every verified row (llguidance), the real matcher advanced on commit.

Contract: ``compile_grammar(kind, spec)`` returns llguidance grammar text for ``kind`` in
``json_schema`` (a schema dict or JSON text), ``json_object`` (any JSON object), ``regex``,
``choice`` (a list of strings), ``lark`` / ``grammar`` (Lark or GBNF); a ValueError names what does
not compile. Compiled grammars are cached by (kind, source). JSON is compiled with compact
separators (``", "`` and ``": "``, no free whitespace), so keys, separators and closing braces are
forced: the grammar's forced continuation is a real draft.

``RowGrammar(grammar, tokenizer, vocab_size, device, eos)`` holds one generation's matcher. It
has a logits processor's interface (lp.lookahead.processors ``RowProcessor``):
``apply(logits_KV, extra)`` returns the logits of K kept rows with every token the grammar does
not allow after (committed + ``extra[k]``) at -inf: the matcher consumes each row's extra tokens
(rows sorted so siblings share their common prefix: roll back to it, consume the rest), fills
the row's bitmask, and is rolled back to the committed state at the end. A row whose extra
tokens the grammar rejects cannot be reached by verification (its parent's mask forbids its
token), so it is left unmasked. ``extend(tokens)`` advances the real matcher along committed
tokens; ``forced()`` is the grammar's forced continuation from the committed state (llguidance
``compute_ff_tokens``); ``dead`` says the matcher is in error (no valid continuation).

``GenerateGrammarProcessor`` is the same library's mask for transformers ``generate`` (batch 1),
the tests' and the bench's reference.

``warm(tokenizer, vocab_size, eos)`` pays the one-time set-up a server's first grammar request
would (llguidance's tokenizer for this tokenizer, ~0.6 s on SmolLM2's 49152 tokens; a first
matcher and mask) and returns its seconds; ``is_warm`` says whether the tokenizer for those
arguments is built (the key a request's RowGrammar looks up). lp.serve warms at start-up, before
it serves; a tokenizer is built once under a lock, so two threads asking at once build one. The first
build keeps every token's bytes under ``$LP_CACHE/grammar`` (keyed by the tokenizer's JSON, the vocabulary
size and eos); a restart builds from those instead of the JSON (``_build``: Gemma-3's 262,144 tokens
3.7 s -> ~0.5 s).
Masks are filled through llguidance's numpy helpers (a view of the torch bitmask): its torch
helpers import torch._dynamo for a compiled kernel lp does not use (~2 s, under the GIL).

Legend: K kept rows, V vocabulary (the model's), W = ceil(V / 32) mask words.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
import zipfile
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np
import torch

log = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compile_grammar(kind: str, spec) -> str:
    """llguidance grammar text for a spec (ValueError naming what is wrong)."""
    if kind not in KINDS:
        raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "json_object":
        spec = {"type": "object"}
    if kind in ("json_schema", "json_object"):
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(spec, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(spec).__name__}")
        key = json.dumps(spec)  # property order matters: the grammar emits keys in schema order
    elif kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(s, str) for s in spec):
            raise ValueError("a choice must be a non-empty list of strings")
        key = json.dumps(list(spec))
    else:
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"a {kind} must be a non-empty string")
        key = spec
    return _compiled(kind, key)


@functools.lru_cache(maxsize=256)
def _compiled(kind: str, key: str) -> str:
    try:
        if kind in ("json_schema", "json_object"):
            text = llguidance.LLMatcher.grammar_from_json_schema(key, overrides=JSON_OPTIONS)
        elif kind == "choice":
            text = llguidance.grammar_from("choice", key)
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(key)
        else:
            text = llguidance.grammar_from(kind, key)
    except Exception as e:  # the library's own message (an unsupported keyword, a bad regex)
        raise ValueError(f"the {kind} does not compile: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise ValueError(f"the {kind} does not compile: {messages[0] if messages else 'invalid grammar'}")
    return text


_TOKENIZERS: dict = {}  # (transformers tokenizer, vocab size, sorted eos) -> llguidance.LLTokenizer
_BUILDING = threading.Lock()  # one build at a time: a second asker waits for it (``ll_tokenizer``)


def _key(hf_tokenizer, vocab_size: int, eos: Sequence[int]) -> tuple:
    return hf_tokenizer, int(vocab_size), tuple(sorted(int(e) for e in eos))


def ll_tokenizer(hf_tokenizer, vocab_size: int, eos: Sequence[int] = ()):
    """llguidance's tokenizer for a transformers tokenizer, the mask sized to the model's vocabulary,
    built once per (tokenizer, vocab_size, eos) (an ``llguidance.LLTokenizer`` is used as it is:
    the tests' toy vocabularies)."""
    if isinstance(hf_tokenizer, llguidance.LLTokenizer):
        return hf_tokenizer
    key = _key(hf_tokenizer, vocab_size, eos)
    built = _TOKENIZERS.get(key)
    if built is None:
        with _BUILDING:
            built = _TOKENIZERS.get(key)  # another thread's build, finished while this one waited
            if built is None:
                if len(_TOKENIZERS) >= 16:
                    _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
                built = _build(hf_tokenizer, key[1], list(key[2]) or None)
                _TOKENIZERS[key] = built
    return built


def _tokens_file(hf_tokenizer, vocab_size: int, eos) -> Path | None:
    """Where the token bytes of this tokenizer are kept: ``$LP_CACHE/grammar/<sha256 of its JSON (or of the
    file lp.model.tokenizer built it from, as it is), the vocabulary size and eos>.npz`` (None for a tokenizer
    without a Rust backend)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    fingerprint = getattr(hf_tokenizer, "_lp_fingerprint", None)  # lp.model.tokenizer: the file it was built from
    h = hashlib.sha256(fingerprint.encode() if fingerprint else backend.to_str().encode())
    h.update(f"|{vocab_size}|{eos}|llguidance {getattr(llguidance, '__version__', '')}".encode())
    root = Path(os.environ.get("LP_CACHE", Path.home() / ".cache" / "lp"))
    return root / "grammar" / f"{h.hexdigest()[:32]}.npz"


class _KeptTokens:
    """llguidance's ``TokenizerWrapper`` input from kept token bytes: ``tokens`` (bytes a token, as the first
    build decoded them), ``special_token_ids``, and encoding through the transformers tokenizer (str only)."""

    def __init__(self, hf_tokenizer, tokens: list[bytes], special: list[int], eos: int):
        self.eos_token_id = eos
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.tokens = tokens
        self.special_token_ids = special
        self._hf = hf_tokenizer

    def __call__(self, text):
        if not isinstance(text, str):  # llguidance then hands str (its wrapper probes with bytes once)
            raise TypeError("text must be str")
        return self._hf.encode(text, add_special_tokens=False)


def _build(hf_tokenizer, vocab_size: int, eos):
    """llguidance's tokenizer. The first build goes through ``llguidance.hf.from_tokenizer`` (its Rust reading of
    the tokenizer's JSON: ~3.7 s for Gemma-3's 262,144 tokens, 0.9 for SmolLM2's 49,152) and keeps every token's
    bytes and the special tokens in ``_tokens_file``; later builds (a restart) read them and build from those
    (~0.5 s for Gemma-3, 0.3 for SmolLM2): the same tokens, so the same masks (tests/test_structured.py)."""
    from llguidance.hf import from_tokenizer

    path = _tokens_file(hf_tokenizer, vocab_size, eos)
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as kept:
                data, ends, special = kept["data"].tobytes(), kept["ends"].tolist(), kept["special"].tolist()
            starts = [0] + ends[:-1]
            tokens = [data[a:b] for a, b in zip(starts, ends)]
            from llguidance._tokenizer import TokenizerWrapper

            wrapper = TokenizerWrapper(_KeptTokens(hf_tokenizer, tokens, special, (eos or [None])[0]))
            return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:  # damaged: built again below, kept anew
            log.warning("the grammar matcher's kept tokens %s do not read (%s): building them again", path, e)
    built = from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
    if path is not None:
        try:
            tokens = [built.decode_bytes([i]) for i in range(built.vocab_size)]
            special = [i for i in range(built.vocab_size) if built.is_special_token(i)]
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
            np.savez(tmp, data=np.frombuffer(b"".join(tokens), dtype=np.uint8),
                     ends=np.cumsum([len(t) for t in tokens], dtype=np.int64), special=np.asarray(special, dtype=np.int64))
            os.replace(tmp, path)
        except OSError as e:  # a read-only cache: every start builds from the JSON
            log.warning("the grammar matcher's tokens could not be kept in %s (%s)", path.parent, e)
    return built


def is_warm(hf_tokenizer, vocab_size: int, eos: Sequence[int] = ()) -> bool:
    """Whether llguidance's tokenizer for these arguments is built and its torch helpers are
    imported: a grammar request then pays neither."""
    import sys

    return _key(hf_tokenizer, vocab_size, eos) in _TOKENIZERS and "llguidance.numpy" in sys.modules


def warm(hf_tokenizer, vocab_size: int, eos: Sequence[int] = ()) -> float:
    """Build llguidance's tokenizer, run one matcher and fill one mask (a server's start-up, so its
    first grammar request does not pay them). -> seconds spent."""
    import time

    t0 = time.perf_counter()
    g = RowGrammar(compile_grammar("json_object", None), hf_tokenizer, vocab_size, "cpu", eos)
    g.masks([[]])
    return time.perf_counter() - t0


def new_matcher(grammar: str, hf_tokenizer, vocab_size: int, eos: Sequence[int] = ()):
    m = llguidance.LLMatcher(ll_tokenizer(hf_tokenizer, vocab_size, eos), grammar, log_level=0)
    if m.is_error():
        raise ValueError(f"the grammar does not compile: {m.get_error()}")
    return m


_BITS = None


def unpack(bitmask_KW: torch.Tensor, vocab: int, device) -> torch.Tensor:
    """[K, W] int32 bitmask -> [K, V] bool allowed (bit j of word w is token 32 w + j)."""
    global _BITS
    if _BITS is None:
        _BITS = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask_KW[:, :, None] >> _BITS) & 1).bool().reshape(bitmask_KW.shape[0], -1)[:, :vocab]
    return allowed.to(device, non_blocking=True)


class RowGrammar:
    def __init__(self, grammar: str, hf_tokenizer, vocab_size: int, device, eos: Sequence[int] = ()):
        self.matcher = new_matcher(grammar, hf_tokenizer, vocab_size, eos)
        self.vocab = int(vocab_size)
        self.words = (self.vocab + 31) // 32
        self.device = device
        self.committed = 0  # tokens the real matcher consumed
        self.mask_rows = 0  # rows masked so far (bench: rows per step)

    @property
    def dead(self) -> bool:
        return self.matcher.is_error()

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

    def masks(self, extra: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[bool]]:
        """[K, W] int32 bitmasks on the host and whether each row is reachable under the grammar."""
        import llguidance.numpy as lgn

        K = len(extra)
        bm = torch.full((K, self.words), -1, dtype=torch.int32)
        bm_np = bm.numpy()  # the same memory
        ok = [False] * K
        m = self.matcher
        stack: list[int] = []
        for k in sorted(range(K), key=lambda k: tuple(extra[k])):
            e = list(extra[k])
            c = 0
            while c < len(stack) and c < len(e) and stack[c] == e[c]:
                c += 1
            if c < len(stack):
                m.rollback(len(stack) - c)
                del stack[c:]
            rest = e[c:]
            n = m.try_consume_tokens(rest) if rest and not m.is_stopped() else 0
            stack += rest[:n]
            if n < len(rest):
                continue  # the grammar rejects this row's path: verification never reaches it
            lgn.fill_next_token_bitmask(m, bm_np, k)  # a completed grammar (stopped): eos only
            ok[k] = True
        if stack:
            m.rollback(len(stack))
        assert not m.is_error(), m.get_error()
        self.mask_rows += sum(ok)
        return bm, ok

    def apply(self, logits_KV: torch.Tensor, extra: Sequence[Sequence[int]]) -> torch.Tensor:
        K, V = logits_KV.shape
        assert len(extra) == K and V == self.vocab
        bm, _ = self.masks(extra)
        out = logits_KV.float().clone()
        return out.masked_fill_(~unpack(bm, V, out.device), float("-inf"))

    def extend(self, tokens: Sequence[int]) -> None:
        """Committed tokens (an eos the grammar allows ends the matcher; nothing after it is consumed)."""
        for t in tokens:
            if self.matcher.is_stopped():
                break
            self.matcher.consume_token(int(t))
            self.committed += 1

    def forced(self, limit: int) -> tuple[int, ...]:
        """The grammar's forced continuation after the committed tokens (at most ``limit``)."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            return ()
        return tuple(self.matcher.compute_ff_tokens()[:limit])


class Chain:
    """Several row processors in order (each ``apply(logits, extra)`` / ``extend(tokens)``)."""

    def __init__(self, procs):
        self.procs = list(procs)

    def apply(self, logits_KV, extra):
        for p in self.procs:
            logits_KV = p.apply(logits_KV, extra)
        return logits_KV

    def extend(self, tokens):
        for p in self.procs:
            p.extend(tokens)


class GenerateGrammarProcessor:
    """transformers ``generate`` logits processor (batch 1): the same matcher, the same mask."""

    def __init__(self, grammar: str, hf_tokenizer, vocab_size: int, prompt_len: int, eos: Sequence[int] = ()):
        self.g = RowGrammar(grammar, hf_tokenizer, vocab_size, "cpu", eos)
        self.prompt_len = prompt_len

    def __call__(self, input_ids, scores):
        assert input_ids.shape[0] == 1, "batch 1"
        new = input_ids[0, self.prompt_len:].tolist()
        self.g.extend(new[self.g.committed:])
        bm, _ = self.g.masks([[]])
        allowed = unpack(bm, scores.shape[-1], scores.device)
        return scores.masked_fill(~allowed, float("-inf"))


def grammar_of(cfg) -> str | None:
    """The grammar text a DecodingConfig asks for: ``grammar`` (llguidance text), else ``json_schema``
    (a path to a schema file, or the schema's JSON text)."""
    if getattr(cfg, "grammar", None):
        return cfg.grammar
    js = getattr(cfg, "json_schema", None)
    if not js:
        return None
    text = js
    if not js.lstrip().startswith(("{", "[")) and js not in ("true", "false"):
        try:
            with open(js) as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"decoding.json_schema: cannot read {js!r} ({e})") from None
    try:
        return compile_grammar("json_schema", text)
    except ValueError as e:
        raise ValueError(f"decoding.json_schema: {e}") from None
