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

``model.quant`` under TP (``load_sharded(..., quant)``, ``quantize_shards``): each rank
quantizes its own shards after the sharded load, int8 (CPU) with full-row scales on row-parallel
shards (2 more all-reduces per layer, of one float per row), exact4 / auto on the blocks its
shards hold; int4 is refused. ``model.compile=on`` compiles the sharded step (the all-reduces
traced into the graph).
"""

from __future__ import annotations

import functools
import logging
import math

import torch

log = logging.getLogger(__name__)


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


def apply_tp(model, tp_mesh, group=None) -> None:
    """Shard ``model`` in place over ``tp_mesh`` (every rank holds the full weights on entry;
    ``load_sharded`` is the way that never holds them). A quantized model is refused: shards are
    quantized after sharding (``quantize_shards``). ``group``: the lp.parallel.dist.WorkerGroup,
    whose bound the forward's collectives get (``_finish``)."""
    if getattr(model, "_lp_quant", None):
        raise ValueError(f"this model is already quantized ({model._lp_quant}): parallel.tp > 1 quantizes each "
                         "rank's shards after sharding (load it with lp.parallel.tp.load_for / load_sharded)")
    _shard_modules(model, tp_mesh)
    _finish(model, tp_mesh, group)


def _shard_modules(model, tp_mesh) -> None:
    """The plan's parameters become DTensors of this rank's shard (on whatever device they
    are: real weights are sliced, meta ones stay placeholders), its modules get the hooks."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from lp.kernels import linears

    check_tp(model.config, tp_mesh.size())
    # the small-row layers must exist before the TP hooks wrap their forward
    linears.install(model)
    expanded = _expand(model, tp_plan(model))
    assert expanded, "the model's tp_plan matched no module"
    with torch.no_grad():
        apply_tensor_parallelism(model, tp_mesh, expanded)


def _finish(model, tp_mesh, group=None) -> None:
    # read by lp.model.calibrate, which never imports torch.distributed: the degree (a TP step
    # is not a one-device step) and the agreement its tp ranks reach before timing forwards
    model._lp_tp = tp_mesh.size()
    device = next(model.parameters()).device
    model._lp_tp_all = functools.partial(_all_true, tp_mesh.get_group(), device)
    model.forward = _collective_failures(model.forward, _fence(group, tp_mesh.get_group(), device))


def load_sharded(path, dtype: str, device: str, tp_mesh, tokenizer: bool = True, quant: str = "none", group=None):
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
    + the runtime (bench/results/tp_memory measures it). ``quant``: each rank then quantizes
    its own shards (``quantize_shards``)."""
    from pathlib import Path

    from lp.model.loader import load_tokenizer, resolve_dtype

    path = Path(path)
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    # model.dtype=auto with model.quant=auto on an AMX CPU, as lp.model.loader.load_model: float32
    # first, kept where the linears hold exact 4-bit blocks (on any tp rank: all ranks agree)
    blocks_first = dtype == "auto" and quant == "auto" and dev.type == "cpu" and torch_dtype != torch.float32
    read_dtype = torch.float32 if blocks_first else torch_dtype
    model = _sharded_skeleton(path, read_dtype, tp_mesh)
    owner, by_file = _checkpoint_index(path, model)
    keep = _dtype_plan(model, read_dtype)
    with torch.no_grad():
        _read_parameters(model, by_file, dev, keep)
        _read_buffers(model, owner, dev, keep)
    model.tie_weights()
    for module in model.modules():  # buffers were built on the host
        for bname, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[bname] = buf.to(dev)
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    assert not meta, f"parameters left unloaded: {meta[:5]}"
    if blocks_first:
        from lp.kernels import exact4

        if _all_true(tp_mesh.get_group(), dev, not (exact4.has_blocks(model) or exact4.has_16bit(model))):
            model.to(torch_dtype)
        else:
            log.info("model.dtype=auto -> float32: its linears are exact 4-bit blocks (model.quant=auto runs them)")
    quantize_shards(model, quant, dev, tp_mesh)
    _finish(model, tp_mesh, group)
    model._lp_sharded_load = True
    return model, (load_tokenizer(path) if tokenizer else None)


def _sharded_skeleton(path, torch_dtype: torch.dtype, tp_mesh):
    """The model built on the meta device and sharded by the plan (DTensor placeholders)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    check_tp(config, tp_mesh.size())
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    model.eval()
    _shard_modules(model, tp_mesh)
    return model


def _checkpoint_index(path, model) -> tuple[dict, dict]:
    """(checkpoint key -> file, file -> [(name, parameter)] to read from it): every parameter
    once, a tied head's alias left to the embedding; a ValueError for one the files lack."""
    from safetensors import safe_open

    owner = {}  # checkpoint key -> file
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as st:
            owner.update({k: f for k in st.keys()})
    head = model.get_output_embeddings()
    tied_head = {f"{n}.weight" for n, m in model.named_modules() if m is head} if _tied(model) else set()
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
    return owner, by_file


def _read_parameters(model, by_file: dict, dev: torch.device, keep) -> None:
    """Each parameter from its file: a DTensor as only this rank's slice, the rest whole."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from transformers.distributed.sharding_utils import DtensorShardOperation

    modules = dict(model.named_modules())
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


def _read_buffers(model, owner: dict, dev: torch.device, keep) -> None:
    """Persistent buffers the checkpoint holds (state_dict saves them), read whole."""
    from safetensors import safe_open

    for module_name, module in model.named_modules():
        for bname, buf in list(module._buffers.items()):
            name = f"{module_name}.{bname}" if module_name else bname
            if buf is None or bname in module._non_persistent_buffers_set or name not in owner:
                continue
            with safe_open(str(owner[name]), framework="pt") as st:
                source = st.get_slice(name)
                module._buffers[bname] = _owned(source[...], dev, keep(name, buf.dtype))
                del source


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


# ---------------------------------------------------------------------------
# quantized shards: each rank quantizes its own slices after the sharded load


def quantize_shards(model, quant: str, device: torch.device, tp_mesh) -> str:
    """Quantize this rank's shards in place (lp.model.quant's schemes); returns the scheme.

    ``auto`` resolves as in one process (lp.model.quant.resolve_auto reads the local shards).
    Before a scheme swaps the linears, the plan's linears become plain modules of their local
    shards with their collectives explicit (``_localize``: a row-parallel one in ``RowParallel``,
    the gathered head in ``GatheredColumns``). Then:

    * ``int8`` (CPU): a column-parallel shard holds whole output rows and reads the whole
      (replicated) input, so its per-row weight scales and per-row activation scales are one
      process's: its columns are one process's bits. A row-parallel shard holds a slice of K:
      its weights are scaled by the full row's maximum (one all-reduce MAX at load) and each
      activation row by the full row's maximum (one all-reduce MAX of M floats per call), so
      the int8 weights, int8 activations and integer products are the one-process ones
      restricted to the slice and the ranks' integer sums add up to one process's exactly;
      the float outputs differ only in rounding order (each rank's partial scaled to float,
      then summed by the all-reduce), as a dense TP model differs from one process.
    * ``exact4``: blocks run along K, so a column shard encodes as in one process; a row shard
      encodes where its slice starts on a 32-block boundary (K / tp a multiple of 32), else
      that linear stays float32 (one log line), as a linear that does not encode does in one
      process. Nothing is approximated either way (``encode`` checks every weight).
    * ``int4`` and CUDA ``int8`` (torchao) are refused: their scales are torchao's, per K slice
      on a row shard, i.e. another quantization than one process's."""
    from lp.model import quant as q

    scheme = q.resolve_quant(quant, device)
    tp = tp_mesh.size()
    if scheme in ("int4",) or (scheme == "int8" and device.type != "cpu"):
        raise ValueError(f"model.quant={quant} on {device.type} cannot be combined with parallel.tp={tp} (torchao's "
                         "scales of a row-parallel shard would cover only its slice of K); use model.quant=int8 on "
                         "the CPU, exact4, auto or none, or parallel.tp=1")
    if scheme == "auto":
        scheme, why = q.resolve_auto(model, device)
        if not _all_true(tp_mesh.get_group(), device, scheme == "exact4"):
            scheme, why = "none", "not every tp rank's shards hold exact 4-bit blocks"
        q.log.info("model.quant=auto -> %s on parallel.tp=%d: %s", scheme, tp, why)
    if scheme == "none":
        return scheme
    _localize(model, tp_mesh)
    rows = [m for m in model.modules() if isinstance(m, RowParallel)]
    if scheme == "int8":
        torch.backends.quantized.engine = "fbgemm"
        for m in rows:
            m.linear = _row_int8(m.linear, tp_mesh.get_group())
    else:
        from lp.kernels.exact4 import BLOCK

        for m in rows:
            if m.linear.in_features % BLOCK:
                log.info("model.quant=exact4 on parallel.tp=%d: a row-parallel shard holds %d of K, not a multiple "
                         "of %d: its blocks are split, it stays float32", tp, m.linear.in_features, BLOCK)
    return q.quantize(model, scheme, device)


def _row_int8(linear, group):
    """lp.model.quant's RowInt8Linear of a row-parallel shard: scales of its full rows."""
    from lp.model.quant import RowInt8Linear

    import torch.distributed as dist

    amax_O = linear.weight.detach().float().abs().amax(dim=1)
    dist.all_reduce(amax_O, op=dist.ReduceOp.MAX, group=group)
    return RowInt8Linear(linear, row_amax_O=amax_O,
                         amax_max=lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group))


class RowParallel(torch.nn.Module):
    """A row-parallel linear's local part: ``linear`` (this rank's slice of K, any module lp.model.quant
    makes of it) on this rank's slice of the input, the ranks' partial products summed (one
    all-reduce), the bias added once after."""

    def __init__(self, linear, group, bias):
        super().__init__()
        self.linear, self.group, self.bias = linear, group, bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class GatheredColumns(torch.nn.Module):
    """A column-parallel linear whose full output every rank needs (the LM head): ``linear`` on
    this rank's columns, then the columns of every rank gathered (uneven splits included)."""

    def __init__(self, linear, tp_mesh, out_features: int):
        super().__init__()
        self.linear, self.mesh = linear, tp_mesh
        self.in_features, self.out_features = linear.in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        y = self.linear(x)
        shape = (*y.shape[:-1], self.out_features)
        full = DTensor.from_local(y, self.mesh, [Shard(y.dim() - 1)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())
        return full.redistribute(self.mesh, [Replicate()]).to_local()


def _localize(model, tp_mesh) -> None:
    """The plan's linears as plain modules of this rank's shards (their DTensor parameters
    replaced by the local tensors, in/out features the local ones, transformers' TP forward
    dropped): column-parallel ones as they are (the input is replicated, the output this rank's
    columns, as transformers' own inference path runs them), row-parallel ones in
    ``RowParallel``, the gathered head in ``GatheredColumns``."""
    from torch.distributed.tensor import DTensor

    group = tp_mesh.get_group()
    modules = dict(model.named_modules())
    for name, style in _expand(model, tp_plan(model)).items():
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear):
            continue  # a parameter's entry, or the vocab-parallel embedding (not quantized)
        assert style in ("colwise", "rowwise", "colwise_gather_output"), (name, style)
        full_out = module.out_features
        for pname, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                module._parameters[pname] = torch.nn.Parameter(p.to_local(), requires_grad=False)
        module.__dict__.pop("forward", None)  # transformers' TP forward: the collectives move to the wrappers
        module.out_features, module.in_features = module.weight.shape
        if style == "colwise":
            continue
        if style == "rowwise":
            bias = module._parameters.get("bias")
            module._parameters["bias"] = None  # added once, after the sum
            wrapper = RowParallel(module, group, bias)
        else:
            wrapper = GatheredColumns(module, tp_mesh, full_out)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, wrapper)


def load_for(path, dtype: str, device: str, quant: str, group, tokenizer: bool = True):
    """This rank's model: the whole replica without TP (lp.model.loader.load_model), only its
    shards with it (``load_sharded``); ``tokenizer=False``: (model, None)."""
    from lp.model.loader import load_model

    if group is None or group.tp_size == 1:
        return load_model(path, dtype, device, quant, tokenizer)
    from lp.model.gguf import gguf_file

    check_tp_path(path, group.tp_size, quant)
    if gguf_file(path) is not None:
        return load_gguf_sharded(path, dtype, device, group, tokenizer, quant)
    return load_sharded(path, dtype, device, group.tp_mesh, tokenizer, quant, group)


def load_gguf_sharded(path, dtype: str, device: str, group, tokenizer: bool = True, quant: str = "none"):
    """(model, tokenizer or None) of a GGUF file under parallel.tp > 1: every rank reads the file
    whole as the float32 weights transformers' GGUF loader makes (lp.model.gguf with quant=none),
    keeps its shards by the plan ``load_sharded`` uses, then quantizes them (``quantize_shards``:
    exact4 finds Q4_0 / Q4_1 / Q8_0 blocks in the float32 shards; other formats stay float32). Peak
    memory per rank: the whole float32 model once, while it loads."""
    from lp.model.loader import load_model

    dev = torch.device(device)
    model, tok = load_model(path, dtype, device, "none", tokenizer)
    with torch.no_grad():
        _shard_modules(model, group.tp_mesh)
    quantize_shards(model, quant, dev, group.tp_mesh)
    _finish(model, group.tp_mesh, group)
    return model, tok


def local_shapes(model) -> dict[str, list[int]]:
    """Each parameter's shape on this rank (a DTensor's local shard; the rest as they are)."""
    from torch.distributed.tensor import DTensor

    return {n: list(p.to_local().shape if isinstance(p, DTensor) else p.shape) for n, p in model.named_parameters()}


def _fence(group, pg, device):
    """NCCL only (a WorkerGroup whose ``wait_s`` is set): one bounded all-reduce of one number after
    each forward. NCCL enqueues the forward's all-reduces and all-gathers and returns, so a dead or
    stuck peer would leave the host blocked in its next device read until NCCL's watchdog aborts
    the process; the fence queues behind them and the host waits for it at most
    ``parallel.timeout_s`` (lp.parallel.dist.bounded), so every collective of the forward is
    bounded. gloo raises in the call within the process group's timeout: None (no fence)."""
    if group is None or group.wait_s is None:
        return None
    import torch.distributed as dist

    one = torch.zeros(1, device=device)
    return lambda: group.collective("tensor-parallel forward", dist.all_reduce, one, group=pg)


def _collective_failures(forward, fence=None):
    """The instance's forward, with a failed collective inside it (a dead or stuck tp peer: gloo
    raises after parallel.timeout_s; NCCL's are bounded by ``fence``) raised as
    lp.parallel.dist.WorkerFailure ("tensor-parallel forward failed (...)"), which the entry points
    report with this rank and exit on. A compiled step (``model.compile=on``) runs the class's
    forward, not this wrapper: under NCCL its collectives are bounded by the next step's exchange."""
    import functools

    import torch.distributed as dist

    from lp.parallel.dist import WorkerFailure

    @functools.wraps(forward)
    def tp_forward(*args, **kwargs):
        try:
            out = forward(*args, **kwargs)
            if fence is not None:
                fence()
            return out
        except WorkerFailure:
            raise
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
    """``check_tp`` from a model folder's config.json (a GGUF file's header) alone, before any weights load."""
    if tp == 1:
        return
    if quant == "int4":
        raise ValueError(f"model.quant={quant} cannot be combined with parallel.tp={tp} (torchao's int4 scales of a "
                         "row-parallel shard would cover only its slice of K); use model.quant=int8, exact4, auto or "
                         "none, or parallel.tp=1")
    from lp.model.gguf import model_config
    from lp.model.loader import default_cache_dir

    check_tp(model_config(path, default_cache_dir()), tp)


def shard_for(model, group):
    """Shard ``model`` over ``group``'s tp ranks (lp.parallel.dist.WorkerGroup); unchanged without TP."""
    if group is not None and group.tp_size > 1:
        apply_tp(model, group.tp_mesh, group)
    return model
