"""Tensor parallelism for one LP worker: shard a loaded model over its tp ranks.

Contract: ``check_tp(config, tp)`` raises ValueError (naming ``parallel.tp`` and the values
that work) when the model's attention heads or key/value heads do not divide by ``tp``; it
needs only the config, so callers run it before loading any weights.
``apply_tp(model, tp_mesh)`` shards the model in place over the 1-D ``tp_mesh`` (lp.parallel.dist
builds it: the "tp" dimension of the (lp, tp) mesh) with the model's own transformers
``tp_plan`` (``base_model_tp_plan`` of its config plus the class's head plan: q/k/v and
gate/up column-wise, o/down row-wise with an all-reduce, a vocab-parallel embedding and a
column-wise LM head whose logits are all-gathered), applied by transformers'
``apply_tensor_parallelism``; no model class is patched. Models that tie the LM head to the
embedding keep both replicated (one parameter cannot be sharded two ways).

Every tp rank ends each layer with the same all-reduced (or all-gathered) tensor, so the
logits the verifier reads are the same on every tp rank of a worker: the collectives of gloo
and NCCL hand every rank one result (reduce-scatter then all-gather). lp.parallel.dist's exchange
reads every verdict from tp rank 0 of its worker anyway, so a difference could never split
a worker. The products differ from one process only by float rounding (the summation order
of the row-wise all-reduce).

Inference only: the sharded Linear layers run on their local shards (transformers' local
fast path when grad is off), so the forward costs plain matmuls plus 2 all-reduces per layer.
"""

from __future__ import annotations

import functools
import math

import torch


def _heads(config) -> tuple[int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    return heads, kv


def valid_tp(config) -> list[int]:
    """The tp degrees that divide both the attention heads and the key/value heads."""
    heads, kv = _heads(config)
    g = math.gcd(heads, kv)
    return [d for d in range(1, g + 1) if g % d == 0]


def check_tp(config, tp: int) -> None:
    """ValueError unless ``tp`` shards this model's heads evenly (and the model has a plan)."""
    if tp == 1:
        return
    heads, kv = _heads(config)
    if heads % tp or kv % tp:
        raise ValueError(
            f"parallel.tp={tp} does not divide this model's heads (num_attention_heads={heads}, "
            f"num_key_value_heads={kv}); use parallel.tp in {valid_tp(config)} "
            "(and parallel.workers = world size / tp)"
        )
    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(
            f"parallel.tp={tp}: model type {getattr(config, 'model_type', '?')!r} ships no tensor-parallel "
            "plan (config.base_model_tp_plan); use parallel.tp=1"
        )


def _tied(model) -> bool:
    return bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False) or getattr(
        model.config, "tie_word_embeddings", False))


def tp_plan(model) -> dict[str, str]:
    """The model's transformers plan, without the embedding and head when they are tied."""
    plan = dict(model.tp_plan)
    if _tied(model):
        embed = model.get_input_embeddings()
        names = {n for n, m in model.named_modules() if m is embed or m is model.get_output_embeddings()}
        plan = {k: v for k, v in plan.items() if k not in names}
    return plan


def _expand(model, plan: dict[str, str]) -> dict[str, str]:
    """One entry per parameter (to shard), then per module (to hook), layer numbers filled in."""
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    out: dict[str, str] = {}
    for name, module in model.named_modules():
        style = plan.get(replace_layer_number_by_wildcard(name))
        if style is None:
            continue
        for pname, _ in module.named_parameters(recurse=False):
            out[f"{name}.{pname}"] = style
        out[name] = style
    return out


def apply_tp(model, tp_mesh) -> None:
    """Shard ``model`` in place over ``tp_mesh`` (every rank holds the full weights on entry;
    ``load_sharded`` is the way that never holds them)."""
    _shard_modules(model, tp_mesh)
    _finish(model, tp_mesh)


def _shard_modules(model, tp_mesh) -> None:
    """The plan's parameters become DTensors of this rank's shard (on whatever device they
    are: real weights are sliced, meta ones stay placeholders), its modules get the hooks."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from lp.model import kernels

    check_tp(model.config, tp_mesh.size())
    # the small-row layers must exist before the TP hooks wrap their forward
    kernels.install(model)
    expanded = _expand(model, tp_plan(model))
    assert expanded, "the model's tp_plan matched no module"
    with torch.no_grad():
        apply_tensor_parallelism(model, tp_mesh, expanded)


def _finish(model, tp_mesh) -> None:
    # read by lp.model.calibrate, which never imports torch.distributed: the degree (a TP step
    # is not a one-device step) and the agreement its tp ranks reach before timing forwards
    model._lp_tp = tp_mesh.size()
    model._lp_tp_all = functools.partial(_all_true, tp_mesh.get_group(), next(model.parameters()).device)
    model.forward = _collective_failures(model.forward)


def load_sharded(path, dtype: str, device: str, tp_mesh, tokenizer: bool = True):
    """(model, tokenizer or None) holding only this rank's shards, read from the checkpoint.

    The model is built with its parameters on the meta device (accelerate's
    ``init_empty_weights``; buffers such as rotary frequencies are real), sharded by the same
    plan as ``apply_tp`` (the parameters become DTensor placeholders of the local shard
    shape), then every parameter is read from the folder's safetensors files: a sharded one
    as only its local slice (``safe_open(...).get_slice`` indexed by transformers'
    ``DtensorShardOperation``: the other ranks' bytes are never read), a replicated one
    whole, each cast to the model dtype on the way (a bf16 checkpoint read as bf16 is never
    widened). Tied parameters (SmolLM2's embedding and LM head) are replicated, read once
    and tied again. Every slice is copied out of the file's memory map into this rank's own
    memory (a view would keep the map, and every page a column slice touched, resident), one
    map per tensor closed right after. Persistent buffers the checkpoint holds are read from
    it too (whole, in the buffer's dtype), as ``from_pretrained`` reads them; those it lacks
    keep the values the model class computes. Dtypes follow ``from_pretrained``: the model
    class's ``_keep_in_fp32_modules`` (under float16) and ``_keep_in_fp32_modules_strict``
    (under float16 and bfloat16) keep their parameters and buffers float32 (transformers'
    own ``_get_dtype_plan``). Peak memory per rank: the replicated parameters + weights / tp
    + the runtime (bench/results/tp_memory measures it)."""
    from pathlib import Path

    from accelerate import init_empty_weights
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed.sharding_utils import DtensorShardOperation

    from lp.model.loader import load_tokenizer, resolve_dtype

    path = Path(path)
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    config = AutoConfig.from_pretrained(path)
    check_tp(config, tp_mesh.size())
    files = _weight_files(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    model.eval()
    _shard_modules(model, tp_mesh)
    owner = {}  # checkpoint key -> file
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            owner.update({k: f for k in st.keys()})
    head = model.get_output_embeddings()
    tied_head = {f"{n}.weight" for n, m in model.named_modules() if m is head} if _tied(model) else set()
    keep = _dtype_plan(model, torch_dtype)
    seen: set[int] = set()
    by_file: dict = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen or (name in tied_head and name not in owner):
            continue  # a tied alias: filled through the embedding, tied again below
        seen.add(id(param))
        if name not in owner:
            raise ValueError(f"model.path={str(path)!r}: the checkpoint has no tensor {name!r} "
                             "(parallel.tp > 1 reads transformers-named safetensors; re-save the model "
                             "with save_pretrained or use parallel.tp=1)")
        by_file.setdefault(owner[name], []).append((name, param))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for f, params in by_file.items():
            for name, param in params:
                # one memory map per tensor, closed once its slice is copied out: the pages a
                # slice touches (all of them for a column slice of a row-major weight) leave
                # this process's resident set with it instead of piling up for the whole file
                dtype = keep(name, param.dtype)
                with safe_open(str(f), framework="pt") as st:
                    source = st.get_slice(name)
                    if isinstance(param, DTensor):
                        local = _owned(DtensorShardOperation(param).shard_tensor(source), dev, dtype)
                        value = DTensor.from_local(local, param.device_mesh, param.placements,
                                                   run_check=False, shape=param.shape, stride=param.stride())
                    else:
                        value = _owned(source[...], dev, dtype)
                    del source
                module_name, _, pname = name.rpartition(".")
                modules[module_name]._parameters[pname] = torch.nn.Parameter(value, requires_grad=False)
        # persistent buffers are in the checkpoint (state_dict saves them): read them whole
        for module_name, module in modules.items():
            for bname, buf in list(module._buffers.items()):
                name = f"{module_name}.{bname}" if module_name else bname
                if buf is None or bname in module._non_persistent_buffers_set or name not in owner:
                    continue
                with safe_open(str(owner[name]), framework="pt") as st:
                    source = st.get_slice(name)
                    module._buffers[bname] = _owned(source[...], dev, keep(name, buf.dtype))
                    del source
    model.tie_weights()
    for module in model.modules():  # buffers were built on the host
        for bname, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[bname] = buf.to(dev)
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    assert not meta, f"parameters left unloaded: {meta[:5]}"
    _finish(model, tp_mesh)
    model._lp_sharded_load = True
    return model, (load_tokenizer(path) if tokenizer else None)


def _dtype_plan(model, dtype: torch.dtype):
    """``keep(name, dtype_as_built)``: the dtype ``from_pretrained`` gives a checkpoint tensor of
    this model loaded as ``dtype``: float32 where the class's keep-in-float32 modules match the
    name (transformers' ``_get_dtype_plan``: ``_keep_in_fp32_modules`` under float16,
    ``_keep_in_fp32_modules_strict`` under float16 and bfloat16; a pattern matches anywhere in
    the name, ``*`` any run), else the dtype the model built it in (an integer buffer stays
    integer)."""
    import re

    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    patterns = [(re.compile(k.replace("*", ".*")), v) for k, v in plan.items()]

    def keep(name: str, built: torch.dtype) -> torch.dtype:
        if not built.is_floating_point:
            return built
        for pattern, forced in patterns:
            if pattern.search(name):
                return forced
        return built

    return keep


def _owned(view: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The slice copied once into a new contiguous tensor of this rank (the model dtype, on
    its device). safetensors hands out slices as views of the file's memory map, strided
    for a column slice: keeping one would keep the mapping and every page it touched
    resident for the process's life; copying through intermediates (``contiguous`` then a
    cast) would leave freed blocks behind in the allocator."""
    out = torch.empty(view.shape, dtype=dtype, device=device)
    out.copy_(view)
    return out


def _weight_files(path) -> list:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.path={str(path)!r} has no *.safetensors files: parallel.tp > 1 loads each rank's "
                         "shards from safetensors (convert the checkpoint with save_pretrained(safe_serialization=True) "
                         "or use parallel.tp=1)")
    return files


def load_for(path, dtype: str, device: str, quant: str, group, tokenizer: bool = True):
    """This rank's model: the whole replica without TP (lp.model.loader.load_model), only its
    shards with it (``load_sharded``); ``tokenizer=False``: (model, None)."""
    from lp.model.loader import load_model

    if group is None or group.tp_size == 1:
        return load_model(path, dtype, device, quant, tokenizer)
    check_tp_path(path, group.tp_size, quant)
    return load_sharded(path, dtype, device, group.tp_mesh, tokenizer)


def local_shapes(model) -> dict[str, list[int]]:
    """Each parameter's shape on this rank (a DTensor's local shard; the rest as they are)."""
    from torch.distributed.tensor import DTensor

    return {n: list(p.to_local().shape if isinstance(p, DTensor) else p.shape) for n, p in model.named_parameters()}


def _collective_failures(forward):
    """The instance's forward, with a failed all-reduce inside it (a dead or stuck tp peer:
    gloo/NCCL raise after parallel.timeout_s) raised as lp.parallel.dist.WorkerFailure, which the
    entry points report with this rank and exit on."""
    import functools

    import torch.distributed as dist

    from lp.parallel.dist import WorkerFailure

    @functools.wraps(forward)
    def tp_forward(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except (dist.DistError, RuntimeError) as e:
            text = str(e)
            if isinstance(e, dist.DistError) or any(k in text for k in ("gloo", "NCCL", "Connection", "Timed out")):
                raise WorkerFailure(f"tensor-parallel forward failed ({type(e).__name__}: {text[:300]})") from e
            raise

    return tp_forward


def _all_true(group, device, flag: bool) -> bool:
    """True on every rank of ``group`` iff ``flag`` is true on all of them (one all-reduce).
    Ranks that run forwards together must take the same branch (e.g. measure t(Q) or read
    it from the cache)."""
    import torch.distributed as dist

    t = torch.tensor([int(flag)], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def check_tp_path(path, tp: int, quant: str = "none") -> None:
    """``check_tp`` from a model folder's config.json alone (before any weights load)."""
    if tp == 1:
        return
    if quant not in ("none", "auto"):
        raise ValueError(f"model.quant={quant} cannot be combined with parallel.tp={tp} (quantized linears are not "
                         "sharded); use model.quant=none or parallel.tp=1")
    from transformers import AutoConfig

    check_tp(AutoConfig.from_pretrained(path), tp)


def shard_for(model, group):
    """Shard ``model`` over ``group``'s tp ranks (lp.parallel.dist.WorkerGroup); unchanged without TP."""
    if group is not None and group.tp_size > 1:
        apply_tp(model, group.tp_mesh)
    return model
