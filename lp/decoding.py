"""The lookahead decoding loop, in one process or as one worker of Lookahead Parallelism.

Contract: ``LookaheadDecoder(runner, cfg, group).generate(prompt_ids)`` returns the
new token ids and the stats. It knows token ids only (no tokenizer, except to
check stop strings). Each step is one packed forward (lp.layout) followed by the
paper's four stages:

    verify:   walk the candidate trie (lp.verify; greedy argmax or lp.sampling)
    publish:  commit the emitted run, truncated by max_new_tokens / eos / stop strings
    collect:  harvest the window's n-grams into the pool (lp.window, lp.pool)
    advance:  shift the window one column

K/V publication: in one process the accepted candidate rows are moved next to the
prefix (``compact``) and the last emitted token is the next step's only pending
row. Under LP (``group`` set) no K/V crosses workers: every worker cuts its cache
back to the committed prefix and re-feeds the emitted tokens as the next step's
pending rows. Window columns and candidates are sharded by ``lp.shard``; one
fixed-shape int64 all_gather per step carries what the others need (lp.dist).

Legend: Q packed rows, V vocabulary, R = N - 1.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lp.config import DecodingConfig
from lp.layout import build_layout
from lp.model import ModelRunner
from lp.pool import ContextIndex, NGramPool
from lp.sampling import node_generator, verify_node, warp
from lp.shard import Shard, plan_shards
from lp.verify import Path, children, greedy_walk, sharing_prefix, walk
from lp.window import Window


@dataclass
class StepRecord:
    emitted: int  # tokens published this step (after truncation)
    rows: int  # packed rows this worker ran
    rows_per_rank: list[int]
    forward_s: float
    exchange_s: float
    host_s: float


@dataclass
class GenerationStats:
    steps: int = 0
    new_tokens: int = 0
    decode_time_s: float = 0.0
    forward_time_s: float = 0.0
    exchange_time_s: float = 0.0
    host_time_s: float = 0.0
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[k]: steps publishing k tokens
    mean_rows: float = 0.0
    mean_rows_per_rank: list[float] = field(default_factory=list)
    workers: int = 1
    records: list[StepRecord] = field(default_factory=list)

    @property
    def compression_ratio(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_time_s if self.decode_time_s > 0 else 0.0

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "compression_ratio": round(self.compression_ratio, 4),
            "decode_time_s": round(self.decode_time_s, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "forward_time_s": round(self.forward_time_s, 4),
            "exchange_time_s": round(self.exchange_time_s, 4),
            "host_time_s": round(self.host_time_s, 4),
            "accept_hist": self.accept_hist,
            "mean_rows": round(self.mean_rows, 2),
            "mean_rows_per_rank": [round(r, 2) for r in self.mean_rows_per_rank],
            "workers": self.workers,
        }


@dataclass
class GenerationResult:
    output_ids: list[int]
    stats: GenerationStats
    # "stop": an eos id or a stop string ended it; "length": max_new_tokens;
    # "cancelled": the caller's ``cancel()`` returned True (rank 0's decides under LP)
    finish_reason: str = "length"


class LookaheadDecoder:
    def __init__(self, runner: ModelRunner, cfg: DecodingConfig, group=None):
        self.runner = runner
        from lp.model import cpu_has_amx_bf16

        dtype_name = str(runner.dtype).replace("torch.", "")
        self.cfg = cfg.validate().with_hardware_defaults(runner.device.type, dtype_name, cpu_has_amx_bf16())
        self.group = group  # lp.dist.WorkerGroup or None
        self.workers = group.world_size if group is not None else 1
        self.rank = group.rank if group is not None else 0

    # -- validation ---------------------------------------------------------

    def _check_request(self, prompt_ids: Sequence[int]) -> None:
        if len(prompt_ids) == 0:
            raise ValueError("prompt must not be empty (got 0 token ids)")
        vocab = self.runner.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt ids must be integers in [0, {vocab})")
        limit = self.runner.max_positions
        need = len(prompt_ids) + self.cfg.max_new_tokens
        if limit is not None and need > limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + decoding.max_new_tokens "
                f"({self.cfg.max_new_tokens}) = {need} exceeds the model's context of {limit} positions"
            )

    # -- the loop -----------------------------------------------------------

    def generate(
        self,
        prompt_ids: Sequence[int],
        eos_token_ids: Sequence[int] | int | None = None,
        streamer=None,
        tokenizer=None,
        on_step=None,
        cancel=None,
    ) -> GenerationResult:
        """Decode up to ``cfg.max_new_tokens`` tokens after ``prompt_ids``.

        ``cancel``: a callable polled once per step; when it returns True the step's
        verified tokens are still published and generation ends (finish_reason
        "cancelled"). Under LP only rank 0's answer counts; it rides in the per-step
        exchange so every rank stops at the same step."""
        prompt_ids = [int(t) for t in prompt_ids]
        self._check_request(prompt_ids)
        cfg = self.cfg
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        eos = set(eos_token_ids or [])
        if cfg.stop_strings and tokenizer is None:
            raise ValueError("decoding.stop_strings needs a tokenizer to decode the output")
        R = cfg.N - 1
        rng = random.Random(cfg.seed)
        window = Window(cfg.W, cfg.N, [rng.choice(prompt_ids) for _ in range(Window.seed_size(cfg.W, cfg.N))])
        pool = NGramPool(cfg.N, cfg.G)
        context = ContextIndex(prompt_ids) if cfg.prompt_pool else None
        if cfg.prompt_pool:
            pool.add_sequence(prompt_ids)

        runner = self.runner
        cache = runner.new_cache()
        tokens = list(prompt_ids)  # committed sequence
        pending = list(prompt_ids)  # committed tokens not yet in the cache
        out: list[int] = []
        stats = GenerationStats(workers=self.workers)
        if streamer is not None:
            streamer.put(torch.tensor([prompt_ids]))
        t_start = time.perf_counter()
        step = 0
        done = False
        finish = "length"
        while not done:
            t0 = time.perf_counter()
            x = pending[-1]
            if self.group is not None:
                fp = (pool.fingerprint() ^ window.fingerprint() ^ hash(tuple(out))) if self.group.check_divergence else 0
                want_cancel = self.rank == 0 and cancel is not None and bool(cancel())
                self.group.set_state(fp & 0x7FFFFFFFFFFF, cfg.N, want_cancel)
            candidates = _select_candidates(pool, context, x, cfg.G, R)
            # window_policy=with_candidates: on hardware where any extra row is dear, the window
            # rows ride only on steps that already verify candidates (or prefill); other steps
            # are plain one-row decodes and leave the window as it is.
            use_window = cfg.window_policy == "always" or bool(candidates) or len(pending) > 1
            # near the end of the context, leave out rows whose positions would pass it
            # (models with learned position tables cannot embed them)
            cache_len = cache.get_seq_length()
            p = cache_len + len(pending) - 1
            limit = runner.max_positions
            if limit is not None and p + R >= limit:
                candidates = []
            if limit is not None and p + window.depth + window.num_columns - 1 >= limit:
                use_window = False
            num_columns = window.num_columns if use_window else 0
            plan = plan_shards(self.workers, len(pending), num_columns, window.depth, len(candidates), R)
            mine = plan[self.rank]
            layout = build_layout(pending, window.levels, mine.columns, [candidates[c] for c in mine.candidates])
            t1 = time.perf_counter()
            logits_KV = runner.forward(layout, cache)
            t2 = time.perf_counter()
            row_of = {row: i for i, row in enumerate(layout.keep)}
            z_local = logits_KV[[row_of[r] for r in layout.z_rows]].argmax(-1).tolist() if layout.z_rows else []
            if cfg.do_sample:
                path, z_all, ex_s = self._decide_sampled(step, layout, logits_KV, row_of, candidates, plan, z_local)
            else:
                path, z_all, ex_s = self._decide_greedy(layout, logits_KV, row_of, candidates, plan, z_local)
            t3 = time.perf_counter()

            # publish: truncate by max_new_tokens, eos, stop strings
            emitted = path.emitted[: cfg.max_new_tokens - len(out)]
            for i, t in enumerate(emitted):
                if t in eos:
                    emitted = emitted[: i + 1]
                    done = True
                    break
            if cfg.stop_strings:
                emitted, hit = _cut_at_stop_string(tokenizer, out, emitted, cfg.stop_strings)
                done = done or hit
            if done:
                finish = "stop"
            out.extend(emitted)
            tokens.extend(emitted)
            if len(out) >= cfg.max_new_tokens and not done:
                done, finish = True, "length"
            if not done:
                stop_now = self.group.cancelled if self.group is not None else (cancel is not None and bool(cancel()))
                if stop_now:
                    done, finish = True, "cancelled"
            if streamer is not None and emitted:
                streamer.put(torch.tensor(emitted))

            # collect + advance (identical on every worker: z_all and path are shared)
            if use_window:
                pool.add_ngrams(window.update(x, z_all))
            if cfg.prompt_pool:
                pool.add_sequence(tokens, start=len(tokens) - len(emitted) - (cfg.N - 1))
                context.extend(emitted)

            # K/V publication
            if not done:
                if self.group is None:
                    hits = path.hits if path.winner is not None else 0
                    src = [cache_len + r for r in layout.cand_rows[path.winner][:hits]] if hits else []
                    runner.compact(cache, cache_len + len(pending), src)
                    pending = [emitted[-1]]
                else:
                    runner.crop(cache, cache_len + len(pending))
                    pending = list(emitted)
            t4 = time.perf_counter()

            stats.steps += 1
            n = len(emitted)
            if len(stats.accept_hist) <= n:
                stats.accept_hist.extend([0] * (n + 1 - len(stats.accept_hist)))
            stats.accept_hist[n] += 1
            rec = StepRecord(n, layout.num_rows, [s.rows for s in plan], t2 - t1, ex_s, (t1 - t0) + (t4 - t2) - ex_s)
            stats.records.append(rec)
            if on_step is not None:
                on_step(step, rec)
            step += 1
            if self.group is not None and self.group.kill_at == (self.rank, step):
                self.group.die()

        stats.decode_time_s = time.perf_counter() - t_start
        if streamer is not None:
            streamer.end()
        stats.new_tokens = len(out)
        stats.forward_time_s = sum(r.forward_s for r in stats.records)
        stats.exchange_time_s = sum(r.exchange_s for r in stats.records)
        stats.host_time_s = sum(r.host_s for r in stats.records)
        decode_records = stats.records[1:] or stats.records  # the first step also prefills the prompt
        stats.mean_rows = sum(r.rows for r in decode_records) / len(decode_records)
        stats.mean_rows_per_rank = [
            sum(r.rows_per_rank[k] for r in decode_records) / len(decode_records) for k in range(self.workers)
        ]
        return GenerationResult(out, stats, finish)

    # -- greedy decision ----------------------------------------------------

    def _decide_greedy(self, layout, logits_KV, row_of, candidates, plan, z_local):
        argmax = logits_KV.argmax(-1).tolist()
        root = argmax[row_of[layout.ordinary_row]]
        mine = plan[self.rank]
        own = [candidates[c] for c in mine.candidates]
        cand_argmax = [[argmax[row_of[r]] for r in rows] for rows in layout.cand_rows]
        local = greedy_walk(own, root, cand_argmax)
        if self.group is None:
            return local, z_local, 0.0
        winner = mine.candidates[local.winner] if local.winner is not None else -1
        t = time.perf_counter()
        table = self.group.exchange_greedy(local.hits, winner, local.emitted, z_local, plan)
        ex_s = time.perf_counter() - t
        # longest hit wins, lowest rank on ties
        best = table[max(range(self.workers), key=lambda k: (table[k].hits, -k))]
        z_all = [t for k in range(self.workers) for t in table[k].z]
        return Path(best.emitted, best.winner if best.winner >= 0 else None, best.hits), z_all, ex_s

    # -- sampled decision ---------------------------------------------------

    def _decide_sampled(self, step, layout, logits_KV, row_of, candidates, plan, z_local):
        cfg = self.cfg
        mine = plan[self.rank]

        def probs(row: int) -> torch.Tensor:
            return warp(logits_KV[row_of[row]], cfg.temperature, cfg.top_k, cfg.top_p)

        root_children = children(candidates, range(len(candidates)), 0)
        root = verify_node(probs(layout.ordinary_row), root_children, node_generator(cfg.seed, step, 0))

        def outcome_of(local_c: int, depth: int) -> int:
            c = mine.candidates[local_c]
            kids = children(candidates, sharing_prefix(candidates, c, depth), depth)
            row = layout.cand_rows[local_c][depth - 1]
            return verify_node(probs(row), kids, node_generator(cfg.seed, step, depth))

        if self.group is None:
            path = walk(candidates, root, lambda depth, c: outcome_of(c, depth))
            return path, z_local, 0.0
        R = cfg.N - 1
        outcomes = [[outcome_of(i, d) for d in range(1, R + 1)] for i in range(len(mine.candidates))]
        t = time.perf_counter()
        roots, table, zs = self.group.exchange_sampled(root, outcomes, z_local, plan, R)
        ex_s = time.perf_counter() - t
        path = walk(candidates, roots[0], lambda depth, c: table[c][depth - 1])
        return path, [t for z in zs for t in z], ex_s


def _select_candidates(pool: NGramPool, context: ContextIndex | None, x: int, G: int, R: int) -> list:
    """Up to G suffixes keyed by ``x``: prompt/output n-grams ranked by shared left context
    first (when the prompt pool is on), then the pool's most recent entries."""
    if G == 0:
        return []
    if context is None:
        return pool.get(x, G)
    out = context.lookup(R, G)
    for suffix in pool.get(x):
        if len(out) == G:
            break
        if suffix not in out:
            out.append(suffix)
    return out


def _cut_at_stop_string(tokenizer, out: list[int], emitted: list[int], stop_strings) -> tuple[list[int], bool]:
    """Keep ``emitted`` up to (and including) the token that completes a stop string.

    Earlier output holds no stop string (generation would have ended), so any
    occurrence in the decoded tail was completed by one of the new tokens."""
    tail = out[-32:]
    for i in range(len(emitted)):
        text = tokenizer.decode(tail + emitted[: i + 1])
        if any(s in text for s in stop_strings):
            return emitted[: i + 1], True
    return emitted, False
