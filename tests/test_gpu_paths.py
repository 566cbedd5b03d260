"""The CUDA paths of issue 37, by their CPU-testable logic (no GPU here, none needed):

* ``model.attention=auto`` on CUDA with flash-attn resolves to the cascade (``flash``), which has
  no batched form: the batched engine runs what auto picks without flash-attn (flex on CUDA, sdpa
  on the CPU) instead of refusing; on the CPU a runner with ``attention=flash`` serves batches whose
  outputs equal transformers' greedy ``generate``;
* on that CUDA path (flex, compiled) a batched step of several sequences is one flex kernel call per
  decoder layer for the whole batch;
* ``python -m lp.kernels.prebuild`` builds lp's CPU kernels for a CPU target only, and a model on CUDA
  never builds lp's C++ attention (``lp.kernels.attention.register(device)``);
* NCCL's watchdog timeout is longer than ``parallel.timeout_s`` (lp's own bound), gloo's equal to it,
  and an NCCL collective whose peer is dead ends in lp's own WorkerFailure within that bound (a
  bounded wait on the async collective), with the message gloo's failure gives (fake collectives);
  so does a tensor-parallel forward whose peer died (lp.parallel.tp's fence after the forward).
"""

from __future__ import annotations

import datetime

import pytest
import torch

from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine
from lp.kernels import attention, prebuild
from lp.model.runner import ModelRunner, resolve_attention
from lp.config import ParallelConfig
from lp.parallel import dist as lp_dist
from lp.parallel.dist import NCCL_STARTUP_S, RequestChannel, WorkerFailure, WorkerGroup, pg_timeout
from tests.helpers import REPETITIVE_PROMPT, hf_greedy

CUDA = torch.device("cuda")  # a device object only: nothing runs on it
CPU = torch.device("cpu")


def test_auto_on_cuda_with_flash_attn_resolves_to_a_batched_kernel(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    assert resolve_attention("auto", CUDA, "sdpa") == "flash"  # the one-sequence decoder's cascade
    assert attention.batch_attention("flash", CUDA) == "flex"  # one call per layer for the whole batch
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    assert resolve_attention("auto", CUDA, "sdpa") == "flex"  # the same kernel without flash-attn
    assert attention.batch_attention("flash", CPU) == "sdpa"
    for name in ("sdpa", "eager", "flex", "rowexact"):
        assert attention.batch_attention(name, CUDA) == attention.batch_attention(name, CPU) == name


def test_batch_engine_takes_a_flash_runner_and_equals_generate(tiny_factory):
    """What ``lp.serve model.attention=flash`` builds on the CPU (it refused before issue 37)."""
    model = tiny_factory("llama")
    runner = ModelRunner(model, attention="flash")
    assert runner.attention == "flash"
    engine = BatchEngine(runner, kv_tokens=512, block_size=8, max_batch=4)
    assert (runner.attention, runner.attn_impl) == ("sdpa", "sdpa")
    prompts = [REPETITIVE_PROMPT, [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5]]
    cfg = DecodingConfig(max_new_tokens=20, W=3, N=3, G=3)
    ids = [engine.add(p, cfg) for p in prompts]
    outs: dict = {}
    for _ in range(200):
        if not engine.has_work:
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_tokens)
    for rid, p in zip(ids, prompts):
        assert outs[rid] == hf_greedy(model, p, 20)


def test_batched_step_on_the_cuda_path_is_one_flex_call_per_layer(tiny_factory, monkeypatch):
    """The batched step a CUDA server runs (a flash runner's batches on flex, compiled): ONE flex
    kernel call per decoder layer for the whole batch (every sequence's rows, prefill chunks and
    trees, in one packed call with one BlockMask), not one per sequence; tokens == ``generate``.
    On the CPU, with flex compiled by aot_eager (tests/test_flex_recompiles.py)."""
    import torch._dynamo

    real_batch_attention, real_compiled = attention.batch_attention, attention.compiled_flex
    monkeypatch.setattr(attention, "batch_attention", lambda name, device: real_batch_attention(name, CUDA))
    monkeypatch.setitem(attention.FLEX_COMPILE, "cpu", "aot_eager")
    calls = []  # rows of every flex kernel call

    def counted(backend):
        def call(query, *args, **kwargs):
            calls.append(query.shape[2])
            return real_compiled(backend)(query, *args, **kwargs)

        return call

    monkeypatch.setattr(attention, "compiled_flex", counted)
    model = tiny_factory("llama")
    layers = model.config.num_hidden_layers
    engine = BatchEngine(ModelRunner(model, attention="flash"), kv_tokens=1024, block_size=8, max_batch=4,
                         max_prefill_tokens=8)
    assert (engine.runner.attention, engine.runner.attn_impl) == ("flex", "lp_flex")
    prompts = [REPETITIVE_PROMPT, [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], list(range(20, 50)), [7, 7, 8, 7, 7, 8]]
    cfg = DecodingConfig(max_new_tokens=16, W=3, N=3, G=3)
    ids = [engine.add(p, cfg) for p in prompts]
    outs, steps = {rid: [] for rid in ids}, []
    try:
        while engine.has_work:
            n = len(calls)
            for o in engine.step():
                outs[o.request_id].extend(o.new_tokens)
            steps.append((len(engine.running), calls[n:]))
    finally:
        torch._dynamo.reset()
    for rid, p in zip(ids, prompts):
        assert outs[rid] == hf_greedy(model, p, 16)
    per_layer = {len(step_calls) / layers for _, step_calls in steps}
    assert per_layer == {1}, f"flex calls per layer in a batched step: {sorted(per_layer)}"
    assert all(len(set(step_calls)) == 1 for _, step_calls in steps)  # every layer the whole step's rows
    assert max(running for running, _ in steps) == 4


def test_batch_engine_still_refuses_static_shapes(tiny_factory):
    runner = ModelRunner(tiny_factory("llama"), attention="sdpa", static_shapes=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        BatchEngine(runner, kv_tokens=256, block_size=8)


def test_cpu_attention_extension_is_built_for_a_cpu_model_only(tiny_factory, monkeypatch):
    """lp's C++ paged attention (``-march=native -fopenmp``, 30-60 s on a fresh machine) runs only
    in a CPU model's batched steps: a batched engine over a model on CUDA, and a runner's flex or
    cascade kernels, register their attention without building it; a CPU model's engine builds it."""
    built = []
    monkeypatch.setattr(attention, "_NATIVE", None)
    monkeypatch.setattr(attention, "native_attention", lambda: built.append(1))
    runner = ModelRunner(tiny_factory("llama"), attention="sdpa")
    monkeypatch.setattr(runner, "device", CUDA)  # the model on CUDA, as far as the engine can tell
    BatchEngine(runner, kv_tokens=256, block_size=8)
    ModelRunner(tiny_factory("llama"), attention="flex")
    ModelRunner(tiny_factory("llama"), attention="flash")
    attention.register("cuda")
    assert built == []
    monkeypatch.setattr(runner, "device", CPU)
    BatchEngine(runner, kv_tokens=256, block_size=8)
    assert built == [1]


def test_prebuild_builds_cpu_kernels_for_a_cpu_target_only(monkeypatch, capsys):
    assert prebuild.cpu_kernels_wanted("auto", cuda=True, x86_cpu_torch=True) is not None
    assert prebuild.cpu_kernels_wanted("cuda", cuda=False, x86_cpu_torch=True) is not None
    assert prebuild.cpu_kernels_wanted("auto", cuda=False, x86_cpu_torch=True) is None
    assert prebuild.cpu_kernels_wanted("cpu", cuda=True, x86_cpu_torch=True) is None
    assert prebuild.cpu_kernels_wanted("cpu", cuda=False, x86_cpu_torch=False) is not None
    with pytest.raises(ValueError, match="--target must be one of auto, cpu, cuda"):
        prebuild.cpu_kernels_wanted("gpu", cuda=True, x86_cpu_torch=True)
    # main on a CUDA machine: no build is even attempted
    from lp.kernels import exact4

    def boom():
        raise AssertionError("a CPU kernel was built for a GPU target")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(exact4, "extension", boom)
    monkeypatch.setattr(attention, "native_op", boom)
    assert prebuild.main([]) == 0
    assert "nothing built: the target is a GPU" in capsys.readouterr().out


@pytest.mark.parametrize("lp_s", [0.5, 10, 60, 600, 3600])
def test_nccl_watchdog_outlives_lp_timeout(lp_s):
    nccl = pg_timeout("nccl", lp_s)
    assert nccl > datetime.timedelta(seconds=lp_s)  # lp's bound comes first, never NCCL's abort
    assert nccl >= datetime.timedelta(seconds=lp_s + NCCL_STARTUP_S)  # start-up skew of 8 ranks
    assert pg_timeout("gloo", lp_s) == datetime.timedelta(seconds=lp_s)  # gloo raises lp's own in time
    with pytest.raises(ValueError, match="parallel.timeout_s"):
        pg_timeout("nccl", 0)


class _DeadPeerWork:
    """An NCCL collective's Work whose peer is dead: ``wait(timeout)`` raises as NCCL's blocking wait
    does on a time-out (or returns False)."""

    def __init__(self, outcome):
        self.outcome, self.timeouts = outcome, []

    def wait(self, timeout=datetime.timedelta(0)):
        self.timeouts.append(timeout)
        if self.outcome == "raise":
            raise RuntimeError("Work WorkNCCL(SeqNum=7, OpType=ALLGATHER) timed out in blocking wait")
        return self.outcome


def _dead_peer_collectives(monkeypatch, outcome):
    """Every collective lp.parallel.dist calls, as NCCL behaves with a dead peer: a synchronous call
    returns at once, nothing raised in the calling thread (the host then blocks in its next device
    read until NCCL's watchdog aborts the process); an async one returns a Work that never finishes.
    gloo (``outcome`` "gloo") raises in the call, within the process group's timeout."""
    works, sync = [], []

    def op(*args, async_op=False, **kwargs):
        if outcome == "gloo":
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        if not async_op:
            sync.append(args)
            return None
        works.append(_DeadPeerWork(outcome))
        return works[-1]

    for name in ("all_gather_into_tensor", "all_gather", "broadcast", "all_reduce"):
        monkeypatch.setattr(lp_dist.dist, name, op)
    return works, sync


def _every_collective(group):
    host = torch.zeros(4, dtype=torch.long)
    return {
        "per-step exchange": lambda: group._gather(host, host, torch.zeros(8, dtype=torch.long), 4),
        "broadcast": lambda: group.share_floats([1.0, 2.0]),
        "all_reduce": lambda: group.min_int(3),
        "request channel header": lambda: RequestChannel(group).recv(),
        "request channel handshake": lambda: RequestChannel(group).handshake([1, 2, 3]),
    }


@pytest.mark.parametrize("outcome", ["raise", False])
def test_nccl_dead_rank_ends_in_lps_own_message_within_timeout_s(monkeypatch, outcome):
    startup = datetime.timedelta(seconds=NCCL_STARTUP_S)
    # the first collective waits out the ranks' start-up skew, still inside NCCL's watchdog
    group = WorkerGroup(1, 2, 1, CPU, ParallelConfig(timeout_s=7), backend="nccl")
    works, _ = _dead_peer_collectives(monkeypatch, outcome)
    with pytest.raises(WorkerFailure, match="^all_reduce failed"):
        group.min_int(3)
    assert [w.timeouts for w in works] == [[startup]] and startup < pg_timeout("nccl", 7)
    works, _ = _dead_peer_collectives(monkeypatch, True)  # then every rank answers once: started
    assert group.min_int(3) == 3 and [w.timeouts for w in works] == [[startup]]
    gloo = WorkerGroup(1, 2, 1, CPU, ParallelConfig(timeout_s=7), backend="gloo")
    for what, call in _every_collective(group).items():
        works, sync = _dead_peer_collectives(monkeypatch, outcome)
        with pytest.raises(WorkerFailure, match=f"^{what} failed \\(") as nccl_failure:
            call()
        assert not sync and [w.timeouts for w in works] == [[datetime.timedelta(seconds=7)]], what
        if outcome == "raise":  # the same words as gloo's failure, around each backend's own error
            _dead_peer_collectives(monkeypatch, "gloo")
            with pytest.raises(WorkerFailure) as gloo_failure:
                _every_collective(gloo)[what]()
            assert str(gloo_failure.value).split(" (")[0] == str(nccl_failure.value).split(" (")[0] == f"{what} failed"
        else:
            assert "no answer within parallel.timeout_s=7 s" in str(nccl_failure.value)


@pytest.mark.parametrize("outcome", ["raise", False])
def test_nccl_tensor_parallel_forward_with_a_dead_peer_ends_in_lps_message(monkeypatch, outcome):
    """A TP forward's all-reduces on NCCL with a dead peer return at once; the fence after the
    forward waits at most parallel.timeout_s and raises lp's message, the words gloo's failure
    inside the forward gives."""
    from lp.parallel import tp

    group = WorkerGroup(1, 2, 1, CPU, ParallelConfig(timeout_s=7), backend="nccl")
    group.started = True

    def forward():  # a row-parallel layer's all-reduce, as the model's forward calls it
        y = torch.ones(2)
        lp_dist.dist.all_reduce(y)
        return y

    works, sync = _dead_peer_collectives(monkeypatch, outcome)
    with pytest.raises(WorkerFailure, match="^tensor-parallel forward failed \\(") as nccl_failure:
        tp._collective_failures(forward, tp._fence(group, None, CPU))()
    assert len(sync) == 1 and [w.timeouts for w in works] == [[datetime.timedelta(seconds=7)]]
    if outcome is False:
        assert "no answer within parallel.timeout_s=7 s" in str(nccl_failure.value)
    gloo = WorkerGroup(1, 2, 1, CPU, ParallelConfig(timeout_s=7), backend="gloo")
    assert tp._fence(gloo, None, CPU) is None  # gloo raises inside the forward, in time
    _dead_peer_collectives(monkeypatch, "gloo")
    with pytest.raises(WorkerFailure) as gloo_failure:
        tp._collective_failures(forward, tp._fence(gloo, None, CPU))()
    assert str(gloo_failure.value).split(" (")[0] == str(nccl_failure.value).split(" (")[0]
    works, sync = _dead_peer_collectives(monkeypatch, True)  # every peer answers: the output comes back
    assert torch.equal(tp._collective_failures(forward, tp._fence(group, None, CPU))(), torch.ones(2))
