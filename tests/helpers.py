"""Helpers shared by the tests: tiny random causal LMs, reference generation, lookahead runs."""

from __future__ import annotations

import torch

from lp.config import DecodingConfig
from lp.engine.decoder import LookaheadDecoder
from lp.model.runner import ModelRunner

TINY_VOCAB = 128
SMALL_VOCAB = 12  # the sampling-distribution tests' model (conftest small_vocab)

# A prompt that repeats itself, so that prompt n-grams become accepted candidates.
REPETITIVE_PROMPT = [5, 17, 33, 9, 5, 17, 33, 9, 5, 17, 33, 9, 5, 17, 40, 3, 5, 17, 33, 9, 5, 17]


def _family_config(family: str, vocab: int, attn: str, max_positions: int, **overrides):
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        attn_implementation=attn,
        initializer_range=0.1,  # a peakier random model: fewer near-ties, more repetition
    )
    if family == "llama":
        cfg = dict(common)
        cls = LlamaConfig
    elif family == "qwen2":
        cfg = dict(common)
        cls = Qwen2Config
    elif family == "mistral":
        # Mistral applies one sliding window to every layer.
        cfg = dict(common, sliding_window=8, head_dim=16)
        cls = MistralConfig
    elif family == "gemma3":
        # Mixed sliding/full layers: the runner must hand a dict of masks to the model.
        cfg = dict(
            common,
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            initializer_range=0.02,  # gemma scales embeddings up: 0.1 makes it repeat one token
        )
        cls = Gemma3TextConfig
    else:
        raise KeyError(family)
    cfg.update(overrides)
    return cls(**cfg)


def make_tiny_model(
    family: str = "llama",
    attn: str = "sdpa",
    vocab: int = TINY_VOCAB,
    seed: int = 0,
    max_positions: int = 512,
    **overrides,
):
    """A small random float32 causal LM in eval mode, generation config without eos."""
    from transformers import AutoModelForCausalLM

    config = _family_config(family, vocab, attn, max_positions, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    assert model.config._attn_implementation == attn
    return model


def hf_greedy(model, prompt_ids, max_new_tokens, **kwargs) -> list[int]:
    """Reference: plain transformers greedy generation, new tokens only."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            **kwargs,
        )
    return out[0, ids.shape[1] :].tolist()


def lookahead(model_or_runner, prompt_ids, **cfg_kwargs):
    """Run LookaheadDecoder once; returns the GenerationResult."""
    gen_kwargs = {k: cfg_kwargs.pop(k) for k in ("eos_token_ids", "streamer", "tokenizer") if k in cfg_kwargs}
    runner = model_or_runner if isinstance(model_or_runner, ModelRunner) else ModelRunner(model_or_runner)
    cfg = DecodingConfig(**cfg_kwargs)
    return LookaheadDecoder(runner, cfg).generate(list(prompt_ids), **gen_kwargs)


BATCH_PROMPTS = [REPETITIVE_PROMPT, REPETITIVE_PROMPT[4:], [7, 8, 9, 10] * 5]


def batch_outputs(runner, cfg, prompts=BATCH_PROMPTS, eos=None) -> list[list[int]]:
    """Every prompt decoded together in one BatchEngine (a small paged pool, 3 at a time): the
    output ids, in the prompts' order (ending at an ``eos`` id where given)."""
    from lp.engine.batch import BatchEngine

    engine = BatchEngine(runner, kv_tokens=1024, block_size=8, max_batch=3)
    ids = [engine.add(p, cfg, eos) for p in prompts]
    while engine.has_work:
        engine.step()
    return [engine.result(i).output_ids for i in ids]


def step_spans(result) -> list[tuple[int, int]]:
    """[start, stop) of the output tokens each step published."""
    spans, pos = [], 0
    for rec in result.stats.records:
        spans.append((pos, pos + rec.emitted))
        pos += rec.emitted
    assert pos == len(result.output_ids)
    return spans


# ---------------------------------------------------------------------------
# The paged K/V pool's block table (lp.model.paged.BlockTable)


def assert_block_invariants(blocks) -> None:
    """What must hold after every step of a batch: the sequences' reserved runs are
    pairwise disjoint (except registered prefix-cache blocks, held by exactly as many runs as
    their reference count) and disjoint from the free list, free + reserved + evictable ==
    all blocks (none leaked, none invented), and each table is a prefix of its sequence's run
    covering its committed rows."""
    from collections import Counter

    owned = [b for run in blocks.owned.values() for b in run]
    held = Counter(owned)
    for b, n in held.items():
        assert n == 1 or b in blocks.digest_of, f"block {b} is reserved {n} times: {blocks.owned}"
    for b, d in blocks.digest_of.items():
        assert blocks.by_digest[d] == b and held[b] == blocks.refs[b], (b, held[b], blocks.refs[b])
        assert (blocks.refs[b] == 0) == (b in blocks.evictable), (b, blocks.refs[b])
    assert len(blocks.by_digest) == len(blocks.digest_of)
    assert not set(owned) & blocks.free, f"reserved blocks on the free list: {sorted(set(owned) & blocks.free)}"
    assert not set(blocks.evictable) & blocks.free, sorted(set(blocks.evictable) & blocks.free)
    assert len(blocks.free) + len(held) + len(blocks.evictable) == blocks.num_blocks, \
        f"free {len(blocks.free)} + reserved {len(held)} + evictable {len(blocks.evictable)} != {blocks.num_blocks} blocks"
    assert blocks.free <= set(range(blocks.num_blocks)), sorted(blocks.free)
    assert set(blocks.tables) == set(blocks.owned) == set(blocks.lengths)
    for seq, table in blocks.tables.items():
        assert table == blocks.owned[seq][: len(table)], (seq, table, blocks.owned[seq])
        assert blocks.lengths[seq] <= len(table) * blocks.block_size, (seq, blocks.lengths[seq], table)




# ---------------------------------------------------------------------------
# Sampling against exact probabilities (tiny vocabularies)


def exact_next_probs(model, prompt_ids, depth: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                     processors=None) -> dict:
    """{prefix: float64 probs [V]} of the warped next-token distribution after prompt + prefix,
    for every prefix of 0 .. depth-1 new tokens (V ** d prefixes at length d, one batched plain
    forward per length). Warping is transformers' own Temperature -> TopK -> TopP chain, the
    order ``generate(do_sample=True)`` applies (then MinP), after ``processors`` (a transformers
    LogitsProcessorList: penalties, bias) on each prefix's own ids; nothing of lp is used."""
    import itertools

    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    from transformers.generation.logits_process import MinPLogitsWarper

    warpers = LogitsProcessorList(processors or [])
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    vocab = model.config.vocab_size
    out = {}
    for d in range(depth):
        prefixes = list(itertools.product(range(vocab), repeat=d))
        ids_BT = torch.tensor([list(prompt_ids) + list(p) for p in prefixes], dtype=torch.long)
        with torch.inference_mode():
            logits_BV = model(ids_BT, attention_mask=torch.ones_like(ids_BT)).logits[:, -1].float()
        scores_BV = warpers(ids_BT, logits_BV)
        probs_BV = torch.softmax(scores_BV.double(), dim=-1)
        out.update({p: probs_BV[i] for i, p in enumerate(prefixes)})
    return out


def conditional_fit(draws, exact: dict, min_draws: int = 40, min_expected: float = 5.0) -> list[dict]:
    """Goodness of fit of every draw's token at position d given its first d tokens.

    ``draws``: equal-length token lists; ``exact``: ``exact_next_probs``. For every prefix
    that at least ``min_draws`` draws share, the counts of the next token are tested against
    the exact conditional distribution (Pearson chi-square; cells with expected count below
    ``min_expected`` pooled, smallest first, exactly as the expectation says). A token drawn
    where the exact probability is 0 gives p = 0. Returns one row per tested prefix."""
    from collections import Counter

    import numpy as np
    from scipy import stats

    depth = len(draws[0])
    rows = []
    for d in range(depth):
        by_prefix: dict = {}
        for t in draws:
            by_prefix.setdefault(tuple(t[:d]), Counter())[t[d]] += 1
        for prefix, counts in sorted(by_prefix.items()):
            n = sum(counts.values())
            if n < min_draws:
                continue
            probs = exact[prefix].numpy()
            obs = np.array([counts[v] for v in range(len(probs))], dtype=np.float64)
            exp = probs * n
            impossible = int(obs[probs < 1e-12].sum())
            keep = probs >= 1e-12
            obs, exp = obs[keep], exp[keep]
            order = np.argsort(exp)
            obs, exp = obs[order], exp[order]
            cut = 0  # pool the smallest cells until the pool expects >= min_expected
            while cut < len(exp) and exp[:cut].sum() < min_expected and exp[cut] < min_expected:
                cut += 1
            if 0 < exp[:cut].sum() < min_expected and cut < len(exp):
                cut += 1  # a pool still too small joins the next cell
            if cut > 1:
                obs = np.concatenate([[obs[:cut].sum()], obs[cut:]])
                exp = np.concatenate([[exp[:cut].sum()], exp[cut:]])
            if impossible:
                p = 0.0
            elif len(exp) < 2:
                continue  # one cell: nothing to test
            else:
                p = float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
            rows.append({"prefix": prefix, "n": n, "p": p, "impossible": impossible,
                         "tv": 0.5 * float(np.abs(obs / n - exp / exp.sum()).sum())})
    return rows


def fit_verdict(rows: list[dict], alpha: float = 1e-3) -> tuple[bool, str]:
    """(every conditional fits at family-wise level alpha (Bonferroni), a readable report)."""
    assert rows, "no prefix had enough draws to test"
    worst = sorted(rows, key=lambda r: r["p"])[:4]
    ok = worst[0]["p"] > alpha / len(rows)
    report = f"{len(rows)} conditionals, threshold p > {alpha / len(rows):.2g}; worst: " + "; ".join(
        f"prefix {r['prefix']} n={r['n']} p={r['p']:.3g} tv={r['tv']:.3f}"
        + (f" impossible={r['impossible']}" if r["impossible"] else "") for r in worst)
    return ok, report


# Planted sampling bugs for the negative controls: the signature of LookaheadDecoder._draw
# (self, run, probs_V, position, kids), planted with ``plant_draw``.


def step_keyed_draw(self, run, probs_V, position, kids):
    """BUG: randomness keyed by (seed, step, depth), as lp drew before issue 51: each token is still
    an exact sample, but the text depends on the step boundaries, so on the drafts."""
    from lp.lookahead.sampling import sample_at

    return sample_at(probs_V, self.cfg.seed, run.step * 1_009 + position - len(run.out))


def probability_accept_draw(self, run, probs_V, position, kids):
    """BUG: a draft accepted with its probability (u < p(draft), u the position's own uniform)
    instead of by equality with the position's token; the position's token otherwise."""
    from lp.lookahead.sampling import sample_at, uniform

    u = uniform(self.cfg.seed, position)
    for token in dict.fromkeys(kids):
        if u < float(probs_V[token]):
            return token
    return sample_at(probs_V, self.cfg.seed, position)


def other_seed_draw(self, run, probs_V, position, kids):
    """BUG (planted on one LP rank): that worker samples with another seed."""
    from lp.lookahead.sampling import sample_at

    return sample_at(probs_V, self.cfg.seed + 1, position)


def plant_draw(fake, setattr=setattr) -> None:
    """Swap LookaheadDecoder._draw (every sampled node's token, one sequence, batched and LP) for
    ``fake`` (``setattr``: pytest's ``monkeypatch.setattr`` in a test, to undo it afterwards)."""
    setattr(LookaheadDecoder, "_draw", fake)


def finish_worker(group, result, out_path: str) -> None:
    """End a test worker script: rank 0 (or the lone process) writes ``result`` as JSON to
    ``out_path``; under torchrun every rank then leaves the group and exits at once
    (lp.parallel.dist.exit_process: no interpreter teardown that could abort a clean run)."""
    import json

    if group is None or group.rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    if group is not None:
        from lp.parallel.dist import exit_process

        group.close()
        exit_process(0)


def randomize_biases(model, std: float, seed: int = 0):
    """Give every bias of ``model`` (Qwen2's q/k/v) N(0, std^2) values in place, seeded:
    transformers initializes biases to zero, which would hide any bug in how a bias is applied.
    Returns the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
    return model
