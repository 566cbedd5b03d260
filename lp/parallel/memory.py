"""The memory plan of one rank, made before any weights load.

Contract: ``plan_memory(path, ...)`` reads the checkpoint's config and its safetensors
headers (shapes only, no tensor data) and returns a ``MemoryPlan``: this rank's weights
(tensor-parallel ones divided by ``parallel.tp`` as lp.parallel.tp shards them, the rest
replicated; tied embeddings replicated), the K/V one longest request needs and the pool a
server reserves (keys and values of this rank's heads), the working set of the step's
largest packed rows (its float32 logits, hidden states and mask), the CUDA-graph buffers
(one more such working set), against what the device has free: ``torch.cuda.mem_get_info``
on a GPU, the host's MemAvailable divided among the processes torchrun started on it on
the CPU. ``plan.check()`` raises ValueError naming the setting to change when the weights,
the weights' peak while loading, or the weights plus the K/V of one longest request (the pool,
for a server) cannot fit;
``plan.lines()`` is what lp.generate and lp.serve print at start-up and lp.serve shows on
/health. A checkpoint without safetensors is planned from nothing (``weights`` None) and
never refused.

Weights are planned twice (``weights_bytes``): ``weights``, what the loaded model holds from then
on, and ``load_peak``, the most it holds while lp.model.loader.load_model runs. That loader
reads the whole checkpoint in ``model.dtype`` onto the device and only then quantizes
(lp.model.quant), so with ``model.quant`` int8 / int4 the peak is the full-precision model plus a
tied head's untied copy plus the working copies of one linear being quantized, well above the
quantized steady state (int8 on the CPU first casts the whole model to float32). Without a
quantization the two are equal. Under ``parallel.tp > 1`` each rank reads only its shards and
quantizes them (lp.parallel.tp.quantize_shards): the same counts with the sharded tensors divided
by tp (tests/test_tp.py holds int8 on TP 2 to the bytes each rank holds). Loading comes before
the K/V pool and the steps exist, so the peak is checked alone and the steady state together
with them.

The estimates are upper-bound-ish and simple; measured peaks (bench/results/tp_memory) are
what to trust.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

GiB = 1024**3
# what the plan leaves for the allocator, the framework and everything it does not count
HEADROOM = 0.9


@dataclass
class MemoryPlan:
    device: str
    tp: int
    dtype: str
    weights: int | None  # bytes on this rank
    replicated: int | None  # of which replicated on every tp rank
    kv_per_token: int  # bytes of one K/V slot on this rank (all layers, keys and values)
    kv_request: int  # one longest request (max_len slots)
    kv_pool: int | None  # a server's paged pool (server.kv_tokens slots), None offline
    step_rows: int
    step: int  # working set of the largest packed step
    graphs: int  # CUDA-graph static buffers
    free: int | None  # device memory this rank may use (None: unknown)
    max_len: int
    source: str  # where `free` comes from
    load_peak: int | None = None  # bytes on this rank while loading (the full-precision model before
    #                               model.quant shrinks it; == weights without a quantization)
    quant: str = "none"

    @property
    def needed(self) -> int:
        kv = self.kv_pool if self.kv_pool is not None else self.kv_request
        return (self.weights or 0) + kv + self.step + self.graphs

    def lines(self) -> list[str]:
        def gb(b):
            return "?" if b is None else f"{b / GiB:.2f} GiB"

        quant = f", quant={self.quant}" if self.quant not in ("none", "auto") else ""
        peak = (f", {gb(self.load_peak)} at the load peak" if self.load_peak is not None
                and self.load_peak != self.weights else "")
        out = [f"memory plan per rank ({self.device}, tp={self.tp}, {self.dtype}{quant}): weights {gb(self.weights)}"
               f" ({gb(self.replicated)} replicated){peak}",
               f"  K/V {self.kv_per_token / 1024:.1f} KiB/token: one {self.max_len}-token request {gb(self.kv_request)}"
               + (f", pool {gb(self.kv_pool)}" if self.kv_pool is not None else ""),
               f"  largest step {self.step_rows} rows ~{gb(self.step)}, CUDA-graph buffers {gb(self.graphs)}",
               f"  total ~{gb(self.needed)} of {gb(self.free)} free ({self.source})"]
        return out

    def as_dict(self) -> dict:
        return dict(asdict(self), needed=self.needed)

    def check(self) -> None:
        """ValueError naming the setting to change when this plan cannot fit."""
        if self.free is None or self.weights is None:
            return
        room = HEADROOM * self.free
        if self.weights > room:
            raise ValueError(
                f"the model's weights need {self.weights / GiB:.2f} GiB per rank at parallel.tp={self.tp} "
                f"({self.dtype}) but this rank has {self.free / GiB:.2f} GiB free ({self.source}): raise parallel.tp, "
                "or lower model.dtype (bfloat16) or use model.quant=int8")
        if self.load_peak is not None and self.load_peak > room:
            raise ValueError(
                f"loading the model peaks at {self.load_peak / GiB:.2f} GiB per rank (model.quant={self.quant} "
                f"loads the {self.dtype} weights whole and quantizes them after; "
                f"{self.weights / GiB:.2f} GiB once quantized) but this rank has {self.free / GiB:.2f} GiB free "
                f"({self.source}): lower model.dtype (bfloat16), or use a smaller model")
        if self.kv_pool is not None and self.needed > room:
            raise ValueError(
                f"server.kv_tokens reserves {self.kv_pool / GiB:.2f} GiB of K/V per rank; with the weights "
                f"({self.weights / GiB:.2f} GiB) and the step ({self.step / GiB:.2f} GiB) that is "
                f"{self.needed / GiB:.2f} GiB of {self.free / GiB:.2f} GiB free: lower server.kv_tokens "
                f"(at most ~{max(int((room - self.weights - self.step - self.graphs) / self.kv_per_token), 0)} "
                "here) or raise parallel.tp")
        if self.kv_pool is None and self.needed > room:
            raise ValueError(
                f"one {self.max_len}-token request needs {self.kv_request / GiB:.2f} GiB of K/V per rank beside the "
                f"weights ({self.weights / GiB:.2f} GiB): {self.needed / GiB:.2f} GiB of {self.free / GiB:.2f} GiB "
                "free: lower decoding.max_new_tokens (or the prompt), or raise parallel.tp")


def _free_bytes(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"{torch.cuda.get_device_name(device)} free now"
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    except (OSError, ValueError, IndexError):
        return None, "unknown"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return info["MemAvailable"] // local, f"host MemAvailable / {local} process(es) on it"


def _tensor_shapes(path: Path) -> dict[str, list[int]] | None:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shapes[k] = list(st.get_slice(k).get_shape())
    return shapes


def _meta_model(config):
    """The model built on the meta device (no memory)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=True):
        return AutoModelForCausalLM.from_config(config)


def sharded_names(config, model=None) -> set[str]:
    """The parameters lp.parallel.tp shards for this config: its own plan (``tp_plan`` +
    ``_expand``) over the model built on the meta device (no memory), so the plan and the
    loading can never disagree."""
    from lp.parallel.tp import _expand, tp_plan

    model = _meta_model(config) if model is None else model
    params = {n for n, _ in model.named_parameters()}
    return {n for n in _expand(model, tp_plan(model)) if n in params}


def weight_bytes(path: Path, config, tp: int, element: int) -> tuple[int | None, int | None]:
    """(this rank's weight bytes, of which replicated) from the safetensors headers."""
    shapes = _tensor_shapes(path)
    if shapes is None:
        return None, None
    sharded = sharded_names(config) if tp > 1 else set()
    total = replicated = 0
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        if name in sharded:
            total += n * element // tp
        else:
            total += n * element
            replicated += n * element
    return total, replicated


# bytes a quantized linear weight holds: int8 one; int4 half, plus a bf16 scale and zero point
# per group of 32 weights (torchao's group size in lp.model.quant)
QUANT_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / 32}
# working bytes per weight of the one linear (group) being quantized, beside the model:
# RowInt8Linear (CPU int8) holds its fused float32 weights twice (stacked, then with the two
# pinning columns) and the int8 tensor twice (quantized, prepacked) while it builds;
# torchao (int4, CUDA int8) an estimate: a float32 working copy and its result
QUANT_WORK = {"row_int8": 4 + 4 + 1 + 1, "torchao": 4 + 1}


def weights_bytes(path: Path, config, tp: int, dtype: torch.dtype, device: torch.device,
                  quant: str = "none") -> tuple[int | None, int | None, int | None]:
    """(this rank's weight bytes once loaded, of which replicated, its peak while loading) from
    the safetensors headers, for lp.model.loader.load_model's order of work: the checkpoint
    whole in ``dtype`` on the device, then lp.model.quant.quantize (see the module docstring)."""
    from lp.kernels.linears import FUSED

    shapes = _tensor_shapes(path)
    if shapes is None:
        return None, None, None
    element = torch.empty((), dtype=dtype).element_size()
    if quant not in QUANT_BYTES:  # none, auto, exact4: planned as the float32 weights (exact4's blocks are less)
        total, replicated = weight_bytes(path, config, tp, element)
        return total, replicated, total
    model = _meta_model(config)
    sharded = sharded_names(config, model) if tp > 1 else set()

    def numel(shape) -> int:
        n = 1
        for d in shape:
            n *= d
        return n

    def share(name: str, n: int) -> int:  # this rank's part of n weights
        return n // tp if name in sharded else n

    linear = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    head_name = next((f"{m}.weight" for m, mod in model.named_modules() if mod is head), None)
    # a tied head: lp.model.quant unties it (a copy of the embedding, then quantized with the linears)
    tied_head = (share(head_name, head.weight.numel()) if head is not None and emb is not None
                 and head.weight is emb.weight and head_name not in shapes else 0)
    mats = {n: share(n, numel(s)) for n, s in shapes.items()}
    lin = sum(n for k, n in mats.items() if k in linear) + tied_head
    rest = sum(n for k, n in mats.items() if k not in linear)
    row_int8 = quant == "int8" and device.type == "cpu"
    # the steady state: quantized linears; the rest float32 on the CPU's int8 (it casts the
    # model to float32 first), bfloat16 under int4 (cast first), model.dtype under CUDA int8
    rest_element = 4 if row_int8 else (2 if quant == "int4" else element)
    weights = int(lin * QUANT_BYTES[quant] + rest * rest_element)
    replicated = int(sum(n * (QUANT_BYTES[quant] if k in linear else rest_element)
                         for k, n in mats.items() if k not in sharded)
                     + (0 if head_name in sharded else tied_head * QUANT_BYTES[quant]))
    # the peak: every tensor (and the untied head) in the widest float dtype it passes through
    # (model.dtype as loaded; float32 after the CPU int8's cast), plus one linear's working set
    load_element = 4 if row_int8 else max(element, 2 if quant == "int4" else element)
    if row_int8:  # q/k/v and gate/up are fused (lp.kernels.linears.fuse_siblings), the rest one by one
        groups = [sum(mats.get(f"{m}.{p}.weight", 0) for p in names) for m, _ in model.named_modules()
                  for names in FUSED]
        work = QUANT_WORK["row_int8"]
    else:
        groups = []
        work = QUANT_WORK["torchao"]
    groups += [n for k, n in mats.items() if k in linear] + [tied_head]
    peak = (lin + rest) * load_element + work * max(groups)
    return weights, replicated, peak


def plan_memory(path, dtype: torch.dtype, device: torch.device, tp: int = 1, *, max_len: int, step_rows: int,
                kv_tokens: int | None = None, cuda_graphs: bool = False, quant: str = "none") -> MemoryPlan:
    """The plan for one rank (see the module docstring); nothing is loaded."""
    from lp.model.gguf import model_config
    from lp.model.loader import default_cache_dir
    from lp.model.paged import kv_slot_bytes

    config = model_config(path, default_cache_dir())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    weights, replicated, load_peak = weights_bytes(Path(path), config, tp, dtype, device, quant)
    kv_per_token = kv_slot_bytes(config, dtype) // tp  # this rank's key/value heads
    hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    act = torch.empty((), dtype=dtype).element_size()
    # float32 logits of the kept rows + a dozen hidden-sized activations per row + the mask row
    step = step_rows * (vocab * 4 + 12 * hidden * act + 4 * (max_len + step_rows))
    free, source = _free_bytes(device)
    return MemoryPlan(device=str(device), tp=tp, dtype=str(dtype).replace("torch.", ""), weights=weights,
                      replicated=replicated, kv_per_token=kv_per_token, kv_request=kv_per_token * max_len,
                      kv_pool=None if kv_tokens is None else kv_per_token * kv_tokens, step_rows=step_rows, step=step,
                      graphs=step if (cuda_graphs and device.type == "cuda") else 0, free=free, max_len=max_len,
                      source=source, load_peak=load_peak, quant=quant)


def decode_rows(d) -> int:
    """An upper bound on one sequence's rows in a decode step (window, pool candidates, draft
    tree, re-fed tokens) for a validated DecodingConfig."""
    W, N, G = d.W or 1, max(d.N or 2, 2), d.G or 0
    drafts = 64 if d.max_draft_rows is None else d.max_draft_rows  # None: the hardware cap, at most this
    return 2 + (W + N) * (N - 1) + G * (N - 1) + drafts + N


def held_bytes(model) -> int:
    """The bytes this rank's loaded model holds (measured, against the plan's estimate): every
    parameter and buffer once (a DTensor by the parameter, counted as its local shard; a tied one
    once; exact4's packed blocks are buffers) and lp.model.quant's RowInt8Linear int8 weights and
    float32 bias (prepacked for fbgemm: read back by unpacking)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:  # by the tensor's id (a local shard is a new object each call)
        if id(t) not in seen:
            seen.add(id(t))
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    for m in model.modules():
        if type(m).__name__ == "RowInt8Linear":
            total += torch.ops.quantized.linear_unpack(m._packed)[0].numel()
            total += 0 if m._bias_O is None else m._bias_O.numel() * 4
    return total
