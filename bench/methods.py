"""Decoding engines of the benchmark: one function per method, each returning a ``Run``.

Contract: an engine takes a loaded transformers causal LM, prompt ids, a token
budget and eos ids, decodes greedily and times the whole call (prefill included,
as transformers ``generate`` does). Multi-worker engines (``lp``, ``tp``, ``pp``)
run the same call on every rank of the default process group and every rank
returns the same ids. Model code is never patched: TP and PP are passes over an
unchanged model (``apply_tp``, ``PipelineStage``), in the manner of gpt-fast's tp.py.

    ar             transformers generate, greedy
    prompt_lookup  transformers generate(prompt_lookup_num_tokens=k), greedy
    lookahead/lp   lp.engine.decoder.LookaheadDecoder (lp: with a WorkerGroup)
    tp             greedy loop over a tensor-parallel model (DTensor plan or manual shards)
    pp             greedy loop over consecutive layer groups, hidden states sent over gloo

Legend: Q rows this forward, D hidden size, V vocabulary.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Run:
    output_ids: list[int]
    steps: int  # forward passes (the prefill counts as one)
    decode_time_s: float
    exchange_time_s: float | None = None  # time in collectives / send-recv (None: not measured)
    rows_per_step: float | None = None  # packed rows per forward (this worker)
    rows_per_rank_per_step: list[float] | None = None
    accept_hist: list[int] | None = None  # accept_hist[k]: steps that published k tokens
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------
# single process: transformers generate


class ForwardCounter:
    """Counts the model's forward calls (= decoding steps of generate)."""

    def __init__(self, model: nn.Module):
        self.calls = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def _generate(model, prompt_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int], **kwargs) -> Run:
    input_ids = torch.tensor([list(prompt_ids)], device=model.device)
    counter = ForwardCounter(model)
    try:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=list(eos),
                pad_token_id=eos[0] if eos else None,
                **kwargs,
            )
        if out.is_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    finally:
        counter.close()
    ids = out[0, len(prompt_ids) :].tolist()
    return Run(ids, counter.calls, dt)


def run_ar(model, prompt_ids, max_new_tokens, eos) -> Run:
    return _generate(model, prompt_ids, max_new_tokens, eos)


def run_prompt_lookup(model, prompt_ids, max_new_tokens, eos, num_tokens: int = 10) -> Run:
    return _generate(model, prompt_ids, max_new_tokens, eos, prompt_lookup_num_tokens=num_tokens)


# ---------------------------------------------------------------------------
# lookahead decoding (one process) and Lookahead Parallelism (a WorkerGroup)


def run_lookahead(
    model, prompt_ids, max_new_tokens, eos, W: int, N: int, G: int, prompt_pool: bool, group=None,
    window_policy: str = "always", decoding: dict | None = None, runner_kw: dict | None = None,
) -> Run:
    """``decoding`` given: DecodingConfig(max_new_tokens, **decoding) (the hardware defaults
    fill the rest) instead of the explicit W/N/G. ``runner_kw``: ModelRunner options."""
    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.model.runner import ModelRunner

    if decoding is not None:
        cfg = DecodingConfig(max_new_tokens=max_new_tokens, **decoding)
    else:
        cfg = DecodingConfig(
            W=W, N=N, G=G, max_new_tokens=max_new_tokens, prompt_pool=prompt_pool, window_policy=window_policy
        )
    runner = ModelRunner(model, **(runner_kw or {}))
    res = LookaheadDecoder(runner, cfg, group).generate(list(prompt_ids), eos_token_ids=list(eos))
    s = res.stats
    return Run(
        output_ids=list(res.output_ids),
        steps=s.steps,
        decode_time_s=s.decode_time_s,
        exchange_time_s=s.exchange_time_s if group is not None else None,
        rows_per_step=s.mean_rows,
        rows_per_rank_per_step=list(s.mean_rows_per_rank),
        accept_hist=list(s.accept_hist),
        extra={"forward_time_s": s.forward_time_s, "host_time_s": s.host_time_s},
    )


# ---------------------------------------------------------------------------
# a plain greedy loop with a DynamicCache (tp, pp)

StepFn = Callable[[list[int], int], int]  # (new token ids, their first position) -> next token


@torch.inference_mode()
def greedy_loop(
    step: StepFn, prompt_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int]
) -> tuple[list[int], int, float]:
    """prefill, then one token per forward until eos or the budget; returns (ids, steps, seconds)."""
    eos_set = set(eos)
    out: list[int] = []
    feed, pos = list(prompt_ids), 0
    t = time.perf_counter()
    while True:
        token = step(feed, pos)
        out.append(token)
        pos += len(feed)
        if token in eos_set or len(out) >= max_new_tokens:
            break
        feed = [token]
    return out, len(out), time.perf_counter() - t


def _cache_kw(module: nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _positions(pos: int, q: int, device) -> torch.Tensor:
    return torch.arange(pos, pos + q, device=device)[None]  # [1, Q]


# ---------------------------------------------------------------------------
# tensor parallelism


class CommTimer:
    seconds = 0.0


def tp_shards_attention(config, world: int) -> bool:
    """Whether attention heads split evenly over ``world`` ranks (else only the MLP is sharded).

    SmolLM2-135M has 9 query and 3 key/value heads: 3-way TP shards attention,
    2-way cannot (4.5 heads per rank) and shards only the MLP."""
    return config.num_attention_heads % world == 0 and config.num_key_value_heads % world == 0


def apply_tp(model, world: int, rank: int, engine: str = "dtensor") -> tuple[str, CommTimer | None]:
    """Shard a Llama-style model's linears over the default process group, in place.

    Column-parallel q/k/v and gate/up, row-parallel o and down (one all-reduce per
    attention and per MLP block); embeddings, norms and the LM head stay replicated.
    ``dtensor``: torch.distributed.tensor.parallel.parallelize_module on a 1-D DeviceMesh.
    ``manual``: the same split with plain nn.Linear shards and an all_reduce forward hook.
    Returns (what was sharded, a timer of the manual engine's all-reduces)."""
    config = model.config
    if config.intermediate_size % world:
        raise ValueError(f"tp needs intermediate_size ({config.intermediate_size}) divisible by workers={world}")
    attn = tp_shards_attention(config, world)
    sharded = "attn+mlp" if attn else "mlp"
    if world == 1:
        return "none", None
    cols = ["mlp.gate_proj", "mlp.up_proj"]
    cols += ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] if attn else []
    rows = ["mlp.down_proj"] + (["self_attn.o_proj"] if attn else [])
    if engine == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(model.device.type, (world,))
        plan = {name: ColwiseParallel() for name in cols} | {name: RowwiseParallel() for name in rows}
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
        return sharded, None
    if engine != "manual":
        raise ValueError(f"tp_engine must be 'dtensor' or 'manual', got {engine!r}")
    timer = CommTimer()

    def all_reduce(module, args, out_1QD):
        t = time.perf_counter()
        dist.all_reduce(out_1QD)
        timer.seconds += time.perf_counter() - t
        return out_1QD

    for layer in model.model.layers:
        for name in cols:
            _replace(layer, name, _shard_linear(layer.get_submodule(name), 0, world, rank))
        for name in rows:
            shard = _shard_linear(layer.get_submodule(name), 1, world, rank)
            shard.register_forward_hook(all_reduce)
            _replace(layer, name, shard)
    return sharded, timer


def _shard_linear(linear: nn.Linear, dim: int, world: int, rank: int) -> nn.Linear:
    """Rows (dim 0, column-parallel) or input columns (dim 1, row-parallel) of rank's shard.
    A row-parallel bias would be added once per rank: keep it on rank 0 only."""
    w = linear.weight.detach()
    n = w.shape[dim] // world
    shard = nn.Linear(w.shape[1] if dim == 0 else n, n if dim == 0 else w.shape[0], bias=linear.bias is not None)
    shard.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        shard.weight.copy_(w.narrow(dim, rank * n, n))
        if linear.bias is not None:
            b = linear.bias.detach()
            shard.bias.copy_(b.narrow(0, rank * n, n) if dim == 0 else (b if rank == 0 else torch.zeros_like(b)))
    return shard.requires_grad_(False)


def _replace(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def run_tp(model, prompt_ids, max_new_tokens, eos, timer: CommTimer | None = None) -> Run:
    """Greedy decoding through the (already sharded) model; every rank computes the same logits."""
    from transformers import DynamicCache

    cache, kw = DynamicCache(), _cache_kw(model)
    if timer is not None:
        timer.seconds = 0.0

    def step(feed: list[int], pos: int) -> int:
        ids_1Q = torch.tensor([feed], device=model.device)
        out = model(input_ids=ids_1Q, position_ids=_positions(pos, len(feed), model.device), use_cache=True,
                    logits_to_keep=1, **{kw: cache})
        return int(out.logits[0, -1].argmax())

    ids, steps, dt = greedy_loop(step, prompt_ids, max_new_tokens, eos)
    return Run(ids, steps, dt, exchange_time_s=timer.seconds if timer is not None else None)


# ---------------------------------------------------------------------------
# pipeline parallelism


def stage_bounds(num_layers: int, world: int) -> list[tuple[int, int]]:
    """Consecutive layer groups, sizes differing by at most one (earlier stages take the extra)."""
    if world > num_layers:
        raise ValueError(f"pp needs at most num_hidden_layers={num_layers} workers, got {world}")
    base, extra = divmod(num_layers, world)
    bounds, lo = [], 0
    for k in range(world):
        hi = lo + base + (1 if k < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class PipelineStage:
    """Layers [lo, hi) of a Llama-style model on this rank, run through the model's own forward.

    Stage 0 embeds the tokens; the others take the previous stage's hidden states
    as ``inputs_embeds``; only the last stage keeps the final norm and the LM head.
    Each stage's DynamicCache holds its own layers (re-indexed from 0). One step:
    recv hidden [1, Q, D] from rank-1, run the layers, send to rank+1; the last
    rank picks the greedy token and broadcasts it, so every rank knows when to stop.
    No micro-batches: at batch 1 the stages simply run one after the other."""

    def __init__(self, model, rank: int, world: int):
        self.model, self.rank, self.world = model, rank, world
        body = model.model
        self.bounds = stage_bounds(len(body.layers), world)
        self.lo, self.hi = self.bounds[rank]
        mine = list(body.layers)[self.lo : self.hi]
        for i, layer in enumerate(mine):
            layer.self_attn.layer_idx = i  # this stage's cache holds only its layers
        body.layers = nn.ModuleList(mine)
        body.config.num_hidden_layers = len(mine)
        if rank != world - 1:
            body.norm = nn.Identity()
        self.hidden_size = body.config.hidden_size
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self._kw = _cache_kw(body)
        self.comm_s = 0.0

    def run(self, prompt_ids, max_new_tokens, eos) -> Run:
        from transformers import DynamicCache

        cache = DynamicCache()
        self.comm_s = 0.0
        body, last = self.model.model, self.rank == self.world - 1

        def step(feed: list[int], pos: int) -> int:
            q = len(feed)
            kwargs = {"position_ids": _positions(pos, q, self.device), "use_cache": True, self._kw: cache}
            t = time.perf_counter()
            if self.rank == 0:
                kwargs["input_ids"] = torch.tensor([feed], device=self.device)
            else:
                h_1QD = torch.empty(1, q, self.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(h_1QD, src=self.rank - 1)
                kwargs["inputs_embeds"] = h_1QD
            self.comm_s += time.perf_counter() - t
            h_1QD = body(**kwargs).last_hidden_state
            t = time.perf_counter()
            token = torch.zeros(1, dtype=torch.long, device=self.device)
            if not last:
                dist.send(h_1QD.contiguous(), dst=self.rank + 1)
            else:
                token[0] = self.model.lm_head(h_1QD[:, -1]).argmax(-1)[0]
            dist.broadcast(token, src=self.world - 1)
            self.comm_s += time.perf_counter() - t
            return int(token[0])

        if self.world == 1:
            return run_tp(self.model, prompt_ids, max_new_tokens, eos)
        ids, steps, dt = greedy_loop(step, prompt_ids, max_new_tokens, eos)
        return Run(ids, steps, dt, exchange_time_s=self.comm_s, extra={"layers": [self.lo, self.hi]})
