"""Typed configuration of ``lp.serve``: the ``server`` Hydra group and the root config.

Contract: plain dataclasses, registered in Hydra's ConfigStore by ``lp.serve`` (like
``lp.generate``); ``validate()`` raises ValueError naming the field and what is allowed.
The ``decoding`` group gives the defaults of every request (W/N/G, window policy, prompt
pool, max_new_tokens when a request sets no max_tokens, sampling when it sets no
temperature); the limits below bound what a single request may ask for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lp.config import DecodingConfig, ModelConfig, ParallelConfig, _is_int, check_model_parallel, field_check


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64  # requests waiting to start; more get 429
    retry_after_s: int = 1  # Retry-After of a 429
    model_id: str | None = None  # the id served by /v1/models (default: model.name, the folder's name or the GGUF file's stem)
    # per-request limits
    max_tokens: int = 2048  # largest max_tokens / max_completion_tokens
    max_W: int = 32
    max_N: int = 8
    max_G: int = 32
    max_stop: int = 4  # stop strings per request (OpenAI's limit)
    max_n: int = 8  # choices per request (n), each decoded as its own sequence
    # LP: rank 0 sends an idle header this often when no request is queued (kept below
    # parallel.timeout_s / 3, so the other ranks' bounded wait doubles as a liveness check)
    heartbeat_s: float = 5.0
    log_level: str = "info"  # uvicorn's
    access_log: bool = False
    # drafts also from earlier requests' outputs: one lp.drafts.suffix.DraftStore per rank (identical
    # on every LP rank), holding decoding.draft_store_tokens tokens, oldest evicted first
    draft_store: bool = False
    # continuous batching (one process and LP, every rank holding the same batch): sequences
    # decoded together, slots of the paged K/V cache (per layer; a request reserves prompt +
    # max_tokens + its largest step, waits while that does not fit, 400 if it never can),
    # prompt rows fed per step (longer prompts are fed in chunks beside the others' decode rows)
    max_batch: int = 32
    kv_tokens: int = 16384
    # on a GPU instead of kv_tokens: the pool fills this fraction of the memory free after
    # loading (the smallest across LP ranks); refused on the CPU
    kv_memory_fraction: float | None = None
    max_prefill_tokens: int = 512
    # slots a K/V block holds: the pool's unit and the granularity of prefix reuse (a prompt
    # reuses whole blocks only). 8 rather than vLLM's 16: SmolLM2's chat template opens every
    # conversation with the same 24 tokens (its default system prompt), of which blocks of 16
    # reuse 16 and blocks of 8 all 24 (docs/serving.md, prefix caching)
    kv_block: int = 8
    # automatic prefix caching: a request reuses the K/V blocks of the longest block-aligned
    # prefix of its prompt that an earlier request committed (a chat's system prompt and
    # earlier turns); cached blocks no request holds are evicted LRU when the pool is full.
    # usage.prompt_tokens_details.cached_tokens says how many were reused. On by default, under
    # LP and LP x TP too (every rank the same block tables, rank 0's hits ride with the step);
    # false to compare.
    prefix_cache: bool = True
    # when set (or env LP_API_KEY), /v1 routes need "Authorization: Bearer <key>", else 401
    api_key: str | None = None

    def validate(self) -> "ServerConfig":
        need = field_check("server")

        need(isinstance(self.host, str) and bool(self.host), "host", "a host name or address", self.host)
        need(_is_int(self.port) and 0 <= self.port <= 65535, "port", "an integer in [0, 65535]", self.port)
        need(_is_int(self.max_queue) and self.max_queue >= 0, "max_queue", "an integer >= 0", self.max_queue)
        need(_is_int(self.retry_after_s) and self.retry_after_s >= 0, "retry_after_s", "an integer >= 0", self.retry_after_s)
        need(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        need(_is_int(self.max_W) and self.max_W >= 1, "max_W", "an integer >= 1", self.max_W)
        need(_is_int(self.max_N) and self.max_N >= 2, "max_N", "an integer >= 2", self.max_N)
        need(_is_int(self.max_G) and self.max_G >= 0, "max_G", "an integer >= 0", self.max_G)
        need(_is_int(self.max_stop) and self.max_stop >= 0, "max_stop", "an integer >= 0", self.max_stop)
        need(_is_int(self.max_n) and self.max_n >= 1, "max_n", "an integer >= 1", self.max_n)
        need(self.heartbeat_s > 0, "heartbeat_s", "> 0", self.heartbeat_s)
        need(
            self.log_level in ("critical", "error", "warning", "info", "debug", "trace"),
            "log_level",
            "critical, error, warning, info, debug or trace",
            self.log_level,
        )
        need(isinstance(self.draft_store, bool), "draft_store", "true or false", self.draft_store)
        need(_is_int(self.max_batch) and self.max_batch >= 1, "max_batch", "an integer >= 1", self.max_batch)
        need(_is_int(self.kv_block) and 1 <= self.kv_block <= 1024, "kv_block", "an integer in [1, 1024]",
             self.kv_block)
        need(_is_int(self.kv_tokens) and self.kv_tokens >= self.kv_block, "kv_tokens",
             f"an integer >= server.kv_block ({self.kv_block}: one block)", self.kv_tokens)
        frac = self.kv_memory_fraction
        need(frac is None or (isinstance(frac, (int, float)) and not isinstance(frac, bool) and 0 < frac <= 1),
             "kv_memory_fraction", "a number in (0, 1] or null", frac)
        need(_is_int(self.max_prefill_tokens) and self.max_prefill_tokens >= 1, "max_prefill_tokens",
             "an integer >= 1", self.max_prefill_tokens)
        need(isinstance(self.prefix_cache, bool), "prefix_cache", "true or false", self.prefix_cache)
        need(self.api_key is None or (isinstance(self.api_key, str) and bool(self.api_key)), "api_key",
             "a non-empty string or null", self.api_key)
        return self


@dataclass
class ServeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def validate(self) -> "ServeConfig":
        self.model.validate()
        self.decoding.validate()
        self.parallel.validate()
        self.server.validate()
        check_model_parallel(self.model, self.parallel)
        if self.decoding.mode not in ("lookahead", "ar"):
            raise ValueError("lp.serve decodes with lp's own steps; decoding.mode must be 'lookahead' or 'ar' "
                             f"(one token a step, no drafts), got {self.decoding.mode!r}")
        return self
