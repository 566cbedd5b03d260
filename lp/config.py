"""Typed configuration: one dataclass per Hydra group, validated with clear errors.

Contract: these are plain dataclasses. ``lp.generate`` registers them in Hydra's
ConfigStore and converts the composed config back to these objects, so library
code never sees a DictConfig. ``validate()`` raises ValueError naming the field
and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING  # noqa: F401  (re-exported for schemas)


@dataclass
class DecodingConfig:
    mode: str = "lookahead"  # lookahead | ar (plain transformers generate)
    # W/N/G/window_policy left None are filled for the hardware: see hardware_defaults()
    W: int | None = None  # window columns
    N: int | None = None  # n-gram size: N-1 trajectory levels, candidates of N-1 tokens
    G: int | None = None  # verification candidates per step (0: lookahead branch only)
    max_new_tokens: int = 256
    prompt_pool: bool = True  # seed the pool from the prompt and the generated output
    # always: the window runs every step (the paper). with_candidates: only on steps that
    # verify candidates anyway, plain one-row steps otherwise (for hardware where Q=2 rows
    # already cost much more than one).
    window_policy: str | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 0
    stop_strings: list[str] = field(default_factory=list)

    def with_hardware_defaults(self, device_type: str, dtype_name: str, amx: bool) -> "DecodingConfig":
        """A copy with every unset W/N/G/window_policy taken from ``hardware_defaults``."""
        import dataclasses

        auto = hardware_defaults(device_type, dtype_name, amx)
        if self.window_policy is None and not (self.W is None and self.N is None and self.G is None):
            auto["window_policy"] = "always"  # an explicit shape gets the paper's always-on window
        return dataclasses.replace(self, **{k: v for k, v in auto.items() if getattr(self, k) is None})

    def validate(self) -> "DecodingConfig":
        def need(ok: bool, name: str, allowed: str, value) -> None:
            if not ok:
                raise ValueError(f"decoding.{name} must be {allowed}, got {value!r}")

        need(self.mode in ("lookahead", "ar"), "mode", "'lookahead' or 'ar'", self.mode)
        need(
            self.window_policy in (None, "always", "with_candidates"),
            "window_policy",
            "'always' or 'with_candidates'",
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
        return self


@dataclass
class ModelConfig:
    name: str = "smollm2"  # the embedded default model; ignored when path is set
    path: str | None = None  # any local transformers folder
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda (LP workers use cuda:LOCAL_RANK)
    cache_dir: str | None = None  # where converted GGUF models live (default ~/.cache/lp)
    threads: int = 0  # torch intra-op threads per worker; 0: leave torch's default
    # attention kernel of the packed step: auto (flash/flex on CUDA, sdpa on CPU) | sdpa |
    # eager | flex (FlexAttention BlockMask) | flash (cascade: unmasked prefix + tree-masked block)
    attention: str = "auto"
    cuda_graphs: bool = False  # capture the decode forward per row bucket (CUDA only)

    def validate(self) -> "ModelConfig":
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"model.dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"model.device must be auto, cpu or cuda, got {self.device!r}")
        if self.attention not in ("auto", "sdpa", "eager", "flex", "flash"):
            raise ValueError(
                f"model.attention must be one of auto, sdpa, eager, flex, flash, got {self.attention!r}"
            )
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"model.cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if not _is_int(self.threads) or self.threads < 0:
            raise ValueError(f"model.threads must be an integer >= 0, got {self.threads!r}")
        return self


@dataclass
class ParallelConfig:
    workers: int | None = None  # must equal torchrun's WORLD_SIZE when set
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    timeout_s: float = 60.0  # a stuck or dead worker ends the job within this time
    check_divergence: bool = False  # compare a hash of pool/window/output across ranks each step

    def validate(self) -> "ParallelConfig":
        if self.workers is not None and (not _is_int(self.workers) or self.workers < 1):
            raise ValueError(f"parallel.workers must be an integer >= 1, got {self.workers!r}")
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
        if self.prompt is not None and self.prompt_file is not None:
            raise ValueError("set only one of prompt and prompt_file")
        return self


def hardware_defaults(device_type: str, dtype_name: str, amx: bool) -> dict:
    """W/N/G/window_policy for the hardware, from measured forward-time curves t(Q).

    * CUDA: extra rows are nearly free up to hundreds: the paper's W=15, N=5, G=15.
    * CPU in bf16 with AMX: ~32 extra rows cost ~1.4x one row: W=5, N=4, G=5 (~30 rows).
    * CPU otherwise (fp32, or bf16 without AMX): two rows already cost ~1.4x one and 16
      rows ~2x, so the step is kept small (W=1, N=5, G=2, ~12 rows) and the window rows
      ride only on steps that verify candidates anyway.
    """
    if device_type == "cuda":
        return {"W": 15, "N": 5, "G": 15, "window_policy": "always"}
    if dtype_name == "bfloat16" and amx:
        return {"W": 5, "N": 4, "G": 5, "window_policy": "always"}
    return {"W": 1, "N": 5, "G": 2, "window_policy": "with_candidates"}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
