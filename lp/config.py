"""Typed configuration: one dataclass per Hydra group, validated with clear errors.

Contract: these are plain dataclasses. ``lp.generate`` registers them in Hydra's
ConfigStore and converts the composed config back to these objects, so library
code never sees a DictConfig. ``validate()`` raises ValueError naming the field
and the allowed values.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field, replace

from omegaconf import MISSING  # noqa: F401  (re-exported for schemas)


@dataclass
class DecodingConfig:
    # lookahead | ar: lp's own step (the same kernels, packed or compiled), one token per step, no
    # drafts or window: the fair plain baseline | hf: transformers generate, the reference
    mode: str = "lookahead"
    # W/N/G/window_policy left None are filled for the hardware: see hardware_defaults()
    W: int | None = None  # window columns
    N: int | None = None  # n-gram size: N-1 trajectory levels, candidates of N-1 tokens
    G: int | None = None  # verification candidates per step (0: lookahead branch only)
    max_new_tokens: int = 256
    prompt_pool: bool = True  # seed the pool from the prompt and the generated output
    # always: the window runs every step (the paper). with_candidates: only on steps that
    # verify candidates anyway, plain one-row steps otherwise (for hardware where Q=2 rows
    # already cost much more than one). off: no window (drafts only).
    window_policy: str | None = None
    # suffix: suffix-matched drafts of adaptive length (prompt + output, lp.drafts.suffix) and the
    #   window's n-grams, merged into a token tree and cut to the draft budget (lp.drafts.select);
    # pool: the paper's verification branch, up to G pooled n-grams of N-1 tokens keyed by x.
    # None: suffix under the hardware defaults, pool when W, N or G is set explicitly.
    drafts: str | None = None
    max_draft_len: int = 16  # longest suffix draft (tokens)
    max_draft_rows: int | None = None  # cap on the draft tree's rows per step (None: hardware)
    draft_alpha: float = 2.0  # suffix drafts: length = min(max_draft_len, alpha * match length)
    # auto: rows per step maximize expected tokens per second under the measured t(Q)
    # (lp.model.calibrate, cached per machine and model); all: every draft node up to the cap
    draft_budget: str = "auto"
    # the budget's predicted acceptance scaled by realized / predicted draft tokens over recent
    # drafting steps, across requests (lp.drafts.budget.GainCalibration): drafts that keep
    # missing stop being paid for
    draft_calibration: bool = True
    draft_store: bool = False  # also draft from earlier outputs (a cross-request DraftStore)
    draft_store_tokens: int = 65536  # tokens the store holds; oldest outputs evicted first
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    # sampling seed. lp.generate and the Python API use it as given: the default 0 is fixed, so an
    # offline run is reproducible (set another to draw other samples). lp.serve ignores it for
    # requests: a request's own ``seed`` is used, and a sampled request without one draws a fresh
    # seed (lp.server.protocol.draw_seed, reported as lookahead.seed), as OpenAI's API does
    seed: int = 0
    stop_strings: list[str] = field(default_factory=list)
    # logits processors (lp.lookahead.processors), applied to every verified row with that row's own
    # history (committed tokens + its ancestors in the draft tree), in transformers' order:
    # logit_bias, repetition_penalty, then OpenAI's frequency/presence penalties
    repetition_penalty: float = 1.0  # 1.0: off; prompt + output tokens (transformers' formula)
    frequency_penalty: float = 0.0  # in [-2, 2]: logit -= f * count (output tokens)
    presence_penalty: float = 0.0  # in [-2, 2]: logit -= p * [count > 0] (output tokens)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    min_p: float = 0.0  # sampling: drop tokens below min_p x the top probability (0: off)
    # logprobs of each emitted token (raw: log-softmax of the model's logits, before any
    # processor), and the top_logprobs most likely tokens of its position (0..20)
    logprobs: bool = False
    top_logprobs: int = 0
    # structured output (lp.grammar): every verified row is masked by the grammar, and the grammar's
    # forced continuation is a draft. json_schema: a path to a JSON schema file (or its JSON text);
    # grammar: llguidance grammar text (lp.grammar.matcher.compile_grammar; lp.serve fills it from
    # response_format / structured_outputs). Needs the tokenizer.
    json_schema: str | None = None
    grammar: str | None = None

    def with_hardware_defaults(self, device_type: str, dtype_name: str, amx: bool) -> "DecodingConfig":
        """A copy with every unset W/N/G/window_policy taken from ``hardware_defaults``."""
        auto = hardware_defaults(device_type, dtype_name, amx)
        if not (self.W is None and self.N is None and self.G is None):
            auto["window_policy"] = "always"  # an explicit shape gets the paper's always-on window
            auto["drafts"] = "pool"  # ... and its verification branch
        return replace(self, **{k: v for k, v in auto.items() if getattr(self, k) is None})

    def plain(self) -> "DecodingConfig":
        """``mode=ar``: a copy that decodes one token per step (no window, no drafts); the decoder
        (lp.engine.decoder.LookaheadDecoder) applies it wherever the config comes from."""
        return replace(self, W=1, N=2, G=0, window_policy="off", drafts="pool")

    def validate(self) -> "DecodingConfig":
        need = field_check("decoding")

        need(self.mode in ("lookahead", "ar", "hf"), "mode", "'lookahead', 'ar' or 'hf'", self.mode)
        need(self.drafts in (None, "suffix", "pool"), "drafts", "'suffix' or 'pool'", self.drafts)
        need(_is_int(self.max_draft_len) and self.max_draft_len >= 1, "max_draft_len", "an integer >= 1",
             self.max_draft_len)
        need(self.max_draft_rows is None or (_is_int(self.max_draft_rows) and self.max_draft_rows >= 0),
             "max_draft_rows", "an integer >= 0", self.max_draft_rows)
        need(self.draft_alpha > 0, "draft_alpha", "> 0", self.draft_alpha)
        need(self.draft_budget in ("auto", "all"), "draft_budget", "'auto' or 'all'", self.draft_budget)
        need(isinstance(self.draft_store, bool), "draft_store", "true or false", self.draft_store)
        need(isinstance(self.draft_calibration, bool), "draft_calibration", "true or false", self.draft_calibration)
        need(_is_int(self.draft_store_tokens) and self.draft_store_tokens >= 0, "draft_store_tokens",
             "an integer >= 0", self.draft_store_tokens)
        need(
            self.window_policy in (None, "always", "with_candidates", "off"),
            "window_policy",
            "'always', 'with_candidates' or 'off'",
            self.window_policy,
        )
        # None: chosen for the hardware by with_hardware_defaults()
        need(self.W is None or (_is_int(self.W) and self.W >= 1), "W", "an integer >= 1", self.W)
        need(self.N is None or (_is_int(self.N) and self.N >= 2), "N", "an integer >= 2", self.N)
        need(self.G is None or (_is_int(self.G) and self.G >= 0), "G", "an integer >= 0", self.G)
        need(
            _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
            "max_new_tokens",
            "an integer >= 1",
            self.max_new_tokens,
        )
        need(self.temperature > 0, "temperature", "> 0", self.temperature)
        need(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0: off)", self.top_k)
        need(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        need(_is_int(self.seed), "seed", "an integer", self.seed)
        for s in self.stop_strings:
            need(isinstance(s, str) and len(s) > 0, "stop_strings", "a list of non-empty strings", self.stop_strings)
        need(_is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             "a number > 0 (1.0: off)", self.repetition_penalty)
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            need(_is_num(v) and -2 <= v <= 2, name, "a number in [-2, 2] (0: off)", v)
        need(isinstance(self.logit_bias, dict), "logit_bias", "a mapping of token id -> bias", self.logit_bias)
        for t, b in self.logit_bias.items():
            need(_is_int(t) and t >= 0, "logit_bias", "token ids (integers >= 0) as keys", t)
            need(_is_num(b) and -100 <= b <= 100, "logit_bias", "biases in [-100, 100]", b)
        need(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1] (0: off)", self.min_p)
        need(isinstance(self.logprobs, bool), "logprobs", "true or false", self.logprobs)
        need(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= 20, "top_logprobs", "an integer in [0, 20]",
             self.top_logprobs)
        for name in ("json_schema", "grammar"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, str) and v != ""), name, "a non-empty string or null", v)
        need(self.top_logprobs == 0 or self.logprobs, "top_logprobs", "0 unless logprobs is true", self.top_logprobs)
        return self


def chat_template_text(value: str | None) -> str | None:
    """``model.chat_template``'s template: None for None, the file's text for the path of a file, the
    value itself for an inline Jinja template; ValueError naming the field otherwise."""
    import os

    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"model.chat_template must be a Jinja template or the path of a file holding one, got {value!r}")
    path = os.path.expanduser(value)
    if "{%" not in value and "{{" not in value:
        if not os.path.isfile(path):
            raise ValueError(f"model.chat_template names no file ({path}) and is not a Jinja template "
                             "(no {{ or {%)")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if "{%" not in text and "{{" not in text:
            raise ValueError(f"model.chat_template file {path} holds no Jinja template " "(no {{ or {%)")
        return text
    return value


@dataclass
class ModelConfig:
    name: str = "smollm2"  # the embedded default model; ignored when path is set
    path: str | None = None  # any local transformers folder, or a GGUF file (or a folder holding one): lp.model.gguf
    # the chat template for /v1/chat/completions and chat prompts, replacing the model's own (a base
    # model or a GGUF file without one): a Jinja template, or the path of a file holding one; null: the model's
    chat_template: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda (LP workers use cuda:LOCAL_RANK)
    cache_dir: str | None = None  # where lp keeps GGUF metadata, t(Q) curves and converted folders (default ~/.cache/lp)
    threads: int = 0  # torch intra-op threads per worker; 0: leave torch's default
    # cores each worker computes on (lp.parallel.cpus): auto (co-located torchrun workers each take
    # their own slice) | off | a list such as 0-3
    cpus: str = "auto"
    # attention kernel of the packed step: auto (flash/flex on CUDA, sdpa on CPU) | sdpa |
    # eager | flex (FlexAttention BlockMask) | flash (cascade: unmasked prefix + tree-masked block)
    attention: str = "auto"
    cuda_graphs: bool = False  # capture the decode forward per row bucket (CUDA only)
    # small-row matmuls W @ x.T for steps of 2+ rows (lp.kernels.linears): auto (CPU: the row counts
    # the t(Q) calibration measured faster) | on | off (torch's x @ W.T everywhere)
    small_rows: str = "auto"
    # linear kernels of lp's forwards (lp.kernels.linears): auto (CPU: oneDNN-prepacked weights when
    # the packed copy fits in half the free memory) | packed | plain (torch's F.linear)
    linears: str = "auto"
    # the LM head (lp.kernels.head, lp.kernels.exact4.head8): auto (under model.quant=exact4 a head whose
    # weights are exact 8-bit blocks, a GGUF Q8_0's, runs on them, up to 16 rows; else, for greedy
    # steps, a bf16 screen proving each row's argmax, exact fp32 logits for the tokens it keeps, where
    # the bf16 head measures faster) | screen | exact (the fp32 head's 49k logits every row)
    head: str = "auto"
    # lp's packed forward under torch.compile/inductor (lp.model.runner), one sequence's steps and the
    # batched step of lp.serve: auto (eager: every new process would pay the compile) | on | off
    compile: str = "auto"
    # the decoder stack (lp.kernels.fused): auto (an exact4 Llama-style model runs its layers as two C++
    # calls each; other Llama, Qwen2/3, Gemma 3 and Phi-3 layers lp's loop over their modules; each kept where
    # its logits equal transformers' forward bit for bit; elsewhere the model's own modules) | on (lp's
    # stack or an error saying why not) | off (the model's modules)
    fused: str = "auto"
    # quantized weights (lp.model.quant), applied identically on every LP worker: none | int8 (CPU:
    # int8 weights x per-row int8 activations over fbgemm; CUDA: torchao int8 weight-only) |
    # int4 (torchao int4 weight-only, bf16 activations) | exact4 (CPU float32: linears whose weights
    # are exact 4-bit blocks, e.g. a GGUF Q4_1 model, run on those blocks, lossless) | auto (exact4
    # where it applies and its AVX-512 kernel builds, none otherwise; never lossy; under parallel.tp > 1
    # each rank converts its own shards: lp.parallel.tp)
    quant: str = "auto"

    def validate(self) -> "ModelConfig":
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"model.dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"model.device must be auto, cpu or cuda, got {self.device!r}")
        if self.attention not in ("auto", "sdpa", "eager", "flex", "flash", "rowexact"):
            raise ValueError(
                f"model.attention must be one of auto, sdpa, eager, flex, flash, rowexact, got {self.attention!r}"
            )
        if self.small_rows not in ("auto", "on", "off"):
            raise ValueError(f"model.small_rows must be auto, on or off, got {self.small_rows!r}")
        if self.linears not in ("auto", "packed", "plain"):
            raise ValueError(f"model.linears must be auto, packed or plain, got {self.linears!r}")
        if self.head not in ("auto", "screen", "exact"):
            raise ValueError(f"model.head must be auto, screen or exact, got {self.head!r}")
        if self.cpus not in ("auto", "off") and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", str(self.cpus)):
            raise ValueError(f"model.cpus must be auto, off or a core list such as 0-3 or 0,2; got {self.cpus!r}")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"model.compile must be auto, on or off, got {self.compile!r}")
        if self.fused not in ("auto", "on", "off"):
            raise ValueError(f"model.fused must be auto, on or off, got {self.fused!r}")
        chat_template_text(self.chat_template)
        if self.quant not in ("none", "int8", "int4", "exact4", "auto"):
            raise ValueError(f"model.quant must be one of none, int8, int4, exact4, auto, got {self.quant!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"model.cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if not _is_int(self.threads) or self.threads < 0:
            raise ValueError(f"model.threads must be an integer >= 0, got {self.threads!r}")
        return self


@dataclass
class ParallelConfig:
    workers: int | None = None  # LP workers; workers x tp must equal torchrun's WORLD_SIZE when set
    tp: int = 1  # tensor-parallel degree: each LP worker's replica sharded over tp processes (lp.parallel.tp)
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    timeout_s: float = 60.0  # a stuck or dead worker ends the job within this time
    check_divergence: bool = False  # compare a hash of pool/window/output across ranks each step

    def validate(self) -> "ParallelConfig":
        if self.workers is not None and (not _is_int(self.workers) or self.workers < 1):
            raise ValueError(f"parallel.workers must be an integer >= 1, got {self.workers!r}")
        if not _is_int(self.tp) or self.tp < 1:
            raise ValueError(f"parallel.tp must be an integer >= 1, got {self.tp!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"parallel.backend must be auto, gloo or nccl, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"parallel.timeout_s must be > 0, got {self.timeout_s!r}")
        return self


@dataclass
class GenerateConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    prompt: str | None = None
    prompt_file: str | None = None
    raw_prompt: bool = False  # true: no chat template
    output: str | None = None  # write one JSON object here (rank 0 only)
    stream: bool = True
    log_steps: bool = False  # per-step stats lines on rank 0

    def validate(self) -> "GenerateConfig":
        self.model.validate()
        self.decoding.validate()
        self.parallel.validate()
        check_model_parallel(self.model, self.parallel)
        if self.prompt is not None and self.prompt_file is not None:
            raise ValueError("set only one of prompt and prompt_file")
        return self


def check_model_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Settings of ``model`` and ``parallel`` that are each valid but not together: none today.
    ``model.compile=on`` with ``parallel.tp > 1`` compiles each rank's sharded step, its
    all-reduces traced into the graph (tests/test_tp.py: equal to one process on gloo CPU)."""


def hardware_defaults(device_type: str, dtype_name: str, amx: bool) -> dict:
    """W/N/G/window_policy/drafts/max_draft_rows for the hardware.

    Draft rows per step are not in this table: the budget (lp.drafts.budget) picks them every
    step from the measured t(Q) curve and the drafts' expected acceptance, up to
    ``max_draft_rows``. What is left here is the window's shape and when it rides:

    * CUDA: extra rows are nearly free up to hundreds: the paper's W=15, N=5 window every
      step, up to 15 drafts per source, a tree of up to 64 rows.
    * CPU in bf16 with AMX: ~32 extra rows cost ~1.4x one row: W=5, N=4 every step.
    * CPU otherwise (fp32, or bf16 without AMX): a step of 2-16 rows costs 0.8-1.5x one row
      (with lp.kernels.linears' small-row matmuls; 1.3-1.8x without), so drafts pay and the window
      does not: no window (measured on 20 HumanEval prompts: suffix drafts alone 1.99x
      generate, with the W=1, N=5 window riding on draft steps 1.72x), up to 4 drafts per
      source, a tree of up to 24 rows.
    """
    if device_type == "cuda":
        return {"W": 15, "N": 5, "G": 15, "window_policy": "always", "drafts": "suffix", "max_draft_rows": 64}
    if dtype_name == "bfloat16" and amx:
        return {"W": 5, "N": 4, "G": 5, "window_policy": "always", "drafts": "suffix", "max_draft_rows": 32}
    return {"W": 1, "N": 5, "G": 4, "window_policy": "off", "drafts": "suffix", "max_draft_rows": 24}


def field_check(group: str):
    """``need(ok, name, allowed, value)`` for one config group: raises
    ``ValueError("<group>.<name> must be <allowed>, got <value>")`` unless ``ok``."""

    def need(ok: bool, name: str, allowed: str, value) -> None:
        if not ok:
            raise ValueError(f"{group}.{name} must be {allowed}, got {value!r}")

    return need


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    import math

    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
