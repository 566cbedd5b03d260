"""Prometheus metrics of the server (``GET /metrics``), through prometheus_client.

Contract: one ``ServerMetrics`` per server, on its own CollectorRegistry (several servers
in one process, e.g. tests, do not collide). The engine records per-request decode
figures (``observe_result``, from the request's lp.engine.decoder.GenerationStats: prefix-cache
queries and hits in prompt tokens, vLLM's speculative-decoding counters with lp's prefix);
the app records HTTP outcomes. ``render()`` returns (body, content type).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, workers: int = 1, prefix_cache: bool = False):
        self.prefix_cache = prefix_cache
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lp_requests", "Requests by endpoint and outcome "
                                "(stop, length, cancelled, rejected_queue_full, invalid, error)",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("lp_prompt_tokens", "Prompt tokens of decoded requests", registry=r)
        self.completion_tokens = Counter("lp_completion_tokens", "Completion tokens produced", registry=r)
        self.steps = Counter("lp_decode_steps", "Lookahead decoding steps (forwards)", registry=r)
        self.compression = Histogram("lp_compression_ratio", "Tokens per step of each request",
                                     buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0), registry=r)
        self.ttft = Histogram("lp_time_to_first_token_seconds", "Arrival to first verified token (queue included)",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r)
        self.tps = Histogram("lp_tokens_per_second", "Decode speed of each request",
                             buckets=(1, 2, 5, 10, 20, 30, 50, 75, 100, 200, 500), registry=r)
        self.decode_time = Histogram("lp_decode_seconds", "Decode time of each request",
                                     buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r)
        self.queue_depth = Gauge("lp_queue_depth", "Requests waiting for the decoder", registry=r)
        self.running = Gauge("lp_running_requests", "Requests being decoded", registry=r)
        self.batch_running = Gauge("lp_batch_running", "Sequences in the running batch (continuous batching)",
                                   registry=r)
        self.step_rows = Histogram("lp_step_rows", "Packed rows of each batched step (all sequences)",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.kv_blocks = Gauge("lp_kv_blocks_in_use", "Blocks of the paged K/V cache the running sequences use "
                               "(a shared prefix-cache block once)", registry=r)
        self.kv_blocks_total = Gauge("lp_kv_blocks_total", "Blocks of the paged K/V cache", registry=r)
        self.prefix_hit_tokens = Counter("lp_prefix_cache_hit_tokens", "Prompt tokens whose K/V came from the "
                                         "prefix cache (server.prefix_cache)", registry=r)
        self.prefix_cached_blocks = Gauge("lp_prefix_cache_blocks", "Registered blocks of the prefix cache "
                                          "(held by a running request or evictable)", registry=r)
        self.prefix_evictions = Counter("lp_prefix_cache_evicted_blocks", "Cached blocks evicted to make room "
                                        "(server.prefix_cache)", registry=r)
        self.prefix_queries = Counter("lp_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(vLLM's prefix_cache_queries; server.prefix_cache)", registry=r)
        self.prefix_hits = Counter("lp_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                   "(vLLM's prefix_cache_hits; server.prefix_cache)", registry=r)
        # speculative decoding as vLLM names it (lp.engine.decoder.GenerationStats): a draft is a
        # step verifying candidates, its draft tokens the longest candidate's length
        self.spec_drafts = Counter("lp_spec_decode_num_drafts", "Decode steps that verified draft candidates",
                                   registry=r)
        self.spec_draft_tokens = Counter("lp_spec_decode_num_draft_tokens", "Draft tokens proposed (per step: "
                                         "the longest candidate's length)", registry=r)
        self.spec_accepted = Counter("lp_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_accepted_pos = Counter("lp_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at "
                                         "each position of the draft (0: the first)", ["position"], registry=r)
        self._evicted = 0
        self.workers = Gauge("lp_workers", "LP workers decoding each request", registry=r)
        self.workers.set(workers)

    def observe_result(self, endpoint: str, result, prompt_len: int, ttft_s: float | None) -> None:
        st = result.stats
        self.requests.labels(endpoint, result.finish_reason).inc()
        self.prompt_tokens.inc(prompt_len)
        self.prefix_hit_tokens.inc(st.cached_tokens)
        if self.prefix_cache:
            self.prefix_queries.inc(prompt_len)
            self.prefix_hits.inc(st.cached_tokens)
        self.spec_drafts.inc(st.num_drafts)
        self.spec_draft_tokens.inc(st.num_draft_tokens)
        self.spec_accepted.inc(st.num_accepted_tokens)
        for pos, n in enumerate(st.accepted_per_pos):
            self.spec_accepted_pos.labels(str(pos)).inc(n)
        self.completion_tokens.inc(len(result.output_ids))
        self.steps.inc(st.steps)
        if st.steps:
            self.compression.observe(st.compression_ratio)
        if st.decode_time_s > 0 and result.output_ids:
            self.tps.observe(st.tokens_per_second)
        self.decode_time.observe(st.decode_time_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)

    def observe_evictions(self, total: int) -> None:
        """The pool's running count of evicted cached blocks (the counter moves by the difference)."""
        if total > self._evicted:
            self.prefix_evictions.inc(total - self._evicted)
            self._evicted = total

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
