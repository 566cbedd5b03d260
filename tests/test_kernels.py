"""Small-row matmuls (lp.kernels.linears): the swap keeps the model's own forward bit for bit, the
switched forward equals F.linear to rounding, and decoding through it equals generate."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lp.config import DecodingConfig, ModelConfig
from lp.engine.decoder import LookaheadDecoder
from lp.kernels.linears import SmallRowsLinear, install
from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT, hf_greedy, make_tiny_model


def test_install_keeps_parameters_tying_and_the_models_own_output():
    model = make_tiny_model("llama", "sdpa", 128, 0, 256, tie_word_embeddings=True)
    ids = torch.tensor([REPETITIVE_PROMPT])
    before = model(input_ids=ids).logits
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    switch = install(model)
    assert install(model) is switch  # once per model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is SmallRowsLinear for m in linears if m.bias is None)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params
    assert torch.equal(model(input_ids=ids).logits, before)  # switch off: nn.Linear's own path
    switch.on = True
    try:
        on = model(input_ids=ids).logits
    finally:
        switch.on = False
    torch.testing.assert_close(on, before, rtol=1e-5, atol=1e-5)


def _swapped_layer(rows: int):
    """One bias-free 96 -> 200 linear swapped by ``install``: (layer, its switch, x of ``rows``
    rows, F.linear's output on x)."""
    torch.manual_seed(rows)
    layer = nn.Linear(96, 200, bias=False)
    x = torch.randn(1, rows, 96)
    ref = F.linear(x, layer.weight)
    return layer, install(nn.Sequential(layer)), x, ref


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
def test_small_rows_linear_equals_f_linear(rows):
    layer, switch, x, ref = _swapped_layer(rows)
    switch.on = True
    out = layer(x)
    assert out.shape == ref.shape
    if rows == 1:
        assert torch.equal(out, ref)  # one row never changes kernel
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", [dict(small_rows="on"), dict(small_rows="off", linears="packed")],
                         ids=["small_rows", "packed"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_decoding_through_lp_linears_equals_generate(tiny_factory, family, kernels):
    """Small-row matmuls, or oneDNN-packed linears, in every lp step: generate's tokens."""
    model = tiny_factory(family)
    ref = hf_greedy(model, REPETITIVE_PROMPT, 40)
    runner = ModelRunner(model, **kernels)
    cfg = DecodingConfig(max_new_tokens=40, drafts="suffix", draft_budget="all", max_draft_rows=12, W=2, N=3, G=3,
                         window_policy="with_candidates")
    res = LookaheadDecoder(runner, cfg).generate(REPETITIVE_PROMPT)
    assert res.output_ids == ref
    assert res.stats.compression_ratio > 1.0
    assert hf_greedy(model, REPETITIVE_PROMPT, 40) == ref  # the user's generate is unchanged


def test_calibration_picks_small_rows_per_row_count(tiny_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("LP_CACHE", str(tmp_path))
    from lp.model.calibrate import QS, row_cost_curve

    runner = ModelRunner(tiny_factory("llama"))
    assert runner.small_rows_mode == "auto" and runner.small_rows == frozenset()
    # timings made unambiguous: 50 ms more for torch's kernel at 4 rows and for the small-row
    # kernel at 2 and 8, so the calibration must choose exactly {4}
    real = runner.forward

    def slowed(layout, cache, *args, **kwargs):
        q = len(layout.tokens)
        if (q == 4) != (q in runner.small_rows):
            time.sleep(0.05)
        return real(layout, cache, *args, **kwargs)

    monkeypatch.setattr(runner, "forward", slowed)
    curve = row_cost_curve(runner, qs=(1, 2, 4, 8), repeats=1)
    monkeypatch.setattr(runner, "forward", real)
    assert [q for q, _ in curve] == [1, 2, 4, 8] and all(t > 0 for _, t in curve)
    chosen = runner.small_rows
    assert chosen == {4}, chosen
    runner.small_rows = frozenset()
    # read back from the cache file (probe=False: its one-sample t(1) may be a noisy one here)
    assert row_cost_curve(runner, qs=(1, 2, 4, 8), probe=False) == curve
    assert runner.small_rows == chosen
    off = ModelRunner(tiny_factory("llama"), small_rows="off")
    assert off.small_rows_mode == "off" and off.small_rows == frozenset() and max(QS) >= 32


def test_calibration_leaves_out_sizes_past_16_rows_that_cost_above_cap(tiny_factory, monkeypatch):
    """lp.model.calibrate.measure: a size past 16 rows whose warm-up step took above CAP x t(1) is not
    timed and not in the curve (its price extrapolated); sizes up to 16 always are. Steps made
    unambiguous: 20 ms more for every step past 16 rows."""
    from lp.model import calibrate

    runner = ModelRunner(tiny_factory("llama"), small_rows="off")
    real = runner.forward

    def slowed(layout, cache, *args, **kwargs):
        if len(layout.tokens) > 16:
            time.sleep(0.02)
        return real(layout, cache, *args, **kwargs)

    monkeypatch.setattr(runner, "forward", slowed)
    qs = (1, 2, 16, 20, 32)
    monkeypatch.setattr(calibrate, "CAP", 1e9)
    assert [q for q, _ in calibrate.measure(runner, qs, repeats=1)[0]] == list(qs)
    monkeypatch.setattr(calibrate, "CAP", 2.0)  # t(1) of a tiny model: well under 10 ms
    curve = calibrate.measure(runner, qs, repeats=1)[0]
    assert [q for q, _ in curve] == [1, 2, 16] and all(t > 0 for _, t in curve)


def test_tensor_parallel_ranks_agree_on_the_sizes_they_time(tiny_factory, monkeypatch):
    """Under TP every forward is collective, so the sizes past 16 rows that calibrate.measure times
    are agreed (lp.parallel.tp's ``_lp_tp_all``: true on every rank iff true on all): a size this
    rank's own warm-up keeps but a peer's drops is dropped here too. Seen when it was not: an LP 2 x
    TP 2 server's rank aborted at start-up on a gloo size mismatch (24 rows against its peer's 32)."""
    from lp.model import calibrate

    model = tiny_factory("llama")
    runner = ModelRunner(model, small_rows="off")
    monkeypatch.setattr(calibrate, "CAP", 1e9)  # this rank keeps every size
    asked = []
    model._lp_tp_all = lambda flag: asked.append(flag) or False  # a peer's warm-up dropped every size asked about
    try:
        curve = calibrate.measure(runner, (1, 2, 16, 20, 32), repeats=1)[0]
    finally:
        del model._lp_tp_all
    assert asked == [True, True] and [q for q, _ in curve] == [1, 2, 16]


def test_stale_curve_is_measured_again(tiny_factory, tmp_path, monkeypatch):
    """A cached t(Q) curve whose t(1) is far slower than a re-time now (measured while a build
    ran: the load average missed it) is measured again and rewritten; one at or below today's
    cost is read back as it is; probe=False reads even the stale one back; a file re-timed once
    in this process is trusted afterwards."""
    import json

    from lp.model import calibrate

    monkeypatch.setenv("LP_CACHE", str(tmp_path))
    runner = ModelRunner(tiny_factory("llama"), small_rows="off")
    path = calibrate.cache_path(runner)
    path.parent.mkdir(parents=True)

    def cached(t1: float) -> list:
        curve = [[1, t1], [2, 2 * t1], [4, 3 * t1]]
        path.write_text(json.dumps({"curve": curve, "small_rows": [], "loadavg": 0.0, "busy": False}))
        return [tuple(p) for p in curve]

    monkeypatch.setattr(calibrate, "_probed", set())
    slow = cached(1.0)  # a tiny model's one-row forward takes well under a millisecond
    assert calibrate.row_cost_curve(runner, qs=(1, 2, 4), probe=False) == slow
    fresh = calibrate.row_cost_curve(runner, qs=(1, 2, 4))
    assert [q for q, _ in fresh] == [1, 2, 4] and fresh[0][1] < 0.1
    assert [tuple(p) for p in json.loads(path.read_text())["curve"]] == fresh
    assert calibrate.row_cost_curve(runner, qs=(1, 2, 4), probe=False) == fresh
    assert calibrate.row_cost_curve(runner, qs=(1, 2, 4)) == fresh  # measured here: not re-timed
    monkeypatch.setattr(calibrate, "_probed", set())
    fast = cached(1e-6)
    assert calibrate.row_cost_curve(runner, qs=(1, 2, 4)) == fast
    slow = cached(1.0)
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("measured"))
    assert calibrate.row_cost_curve(runner, qs=(1, 2, 4)) == slow  # re-timed once: trusted now


def test_small_rows_setting_is_validated(tiny_factory):
    with pytest.raises(ValueError, match="model.small_rows must be auto, on or off"):
        ModelRunner(tiny_factory("llama"), small_rows="fast")
    with pytest.raises(ValueError, match="model.small_rows"):
        ModelConfig(small_rows="yes").validate()


def test_one_row_through_the_head_runs_as_two_rows():
    """The LM head (output embedding) computes one row as a two-row GEMM when the switch is
    on (MKL's one-row path is ~3x slower on a 49k x 576 head); other layers keep one row."""
    model = make_tiny_model("llama", "sdpa", 128, 0, 256)
    switch = install(model)
    head = model.get_output_embeddings()
    assert head.pad_one_row and not model.model.layers[0].mlp.down_proj.pad_one_row
    x = torch.randn(1, 1, head.in_features)
    ref = F.linear(x, head.weight)
    calls = []
    real_cat = torch.cat
    switch.on = True
    try:
        torch.cat = lambda *a, **k: calls.append(1) or real_cat(*a, **k)
        out = head(x)
    finally:
        torch.cat = real_cat
        switch.on = False
    assert calls, "the padded two-row path did not run"
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# oneDNN-packed linears (model.linears)


def _ops_run(runner, rows: int) -> set[str]:
    """The op names one forward of ``rows`` rows runs (torch.profiler)."""
    from torch.profiler import profile

    from lp.lookahead.layout import chain_layout

    cache = runner.new_cache(64, rows)
    with profile() as prof:
        runner.forward(chain_layout(list(range(3, 3 + rows))), cache)
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64])
def test_packed_linear_equals_f_linear_and_the_model_keeps_its_own(rows):
    from lp.kernels.linears import pack

    layer, switch, x, ref = _swapped_layer(rows)
    assert pack(layer) == 1 and layer.packed_weight.layout == torch._mkldnn
    assert torch.equal(layer(x), ref)  # switch off: nn.Linear's own kernel, bit for bit
    switch.packed = True
    try:
        out = layer(x)
    finally:
        switch.packed = False
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_runner_forwards_run_the_packed_kernel_only_where_chosen(tiny_factory):
    model = tiny_factory("llama")
    packed = ModelRunner(model, small_rows="off", linears="packed")
    assert packed.linears == "packed"
    ops = _ops_run(packed, 4)
    assert "mkldnn::_linear_pointwise" in ops and "aten::mm" not in ops, sorted(ops)
    plain = ModelRunner(tiny_factory("llama"), small_rows="off", linears="plain")
    assert "mkldnn::_linear_pointwise" not in _ops_run(plain, 4)
    # the user's own forward, outside lp's steps, never runs it
    from torch.profiler import profile

    with profile() as prof:
        model(input_ids=torch.tensor([REPETITIVE_PROMPT[:6]]))
    assert "mkldnn::_linear_pointwise" not in {e.key for e in prof.key_averages()}


def test_linears_auto_packs_float_models_and_a_copy_packs_again(tiny_factory):
    import copy

    model = tiny_factory("llama")
    assert ModelRunner(model).linears == "packed"  # the CPU, fp32, a few MB
    clone = copy.deepcopy(model)  # an opaque oneDNN tensor cannot be copied: the copy drops it
    assert all(m.packed_weight is None and m.fused is None for m in clone.modules() if isinstance(m, SmallRowsLinear))
    again = ModelRunner(clone, linears="packed")
    assert all(m.packed_weight is not None or m.fused is not None
               for m in clone.modules() if isinstance(m, SmallRowsLinear))
    assert "mkldnn::_linear_pointwise" in _ops_run(again, 2)


def test_linears_setting_is_validated(tiny_factory):
    with pytest.raises(ValueError, match="model.linears must be one of auto, packed, plain"):
        ModelRunner(tiny_factory("llama"), linears="fast")
    with pytest.raises(ValueError, match="model.linears must be auto, packed or plain"):
        ModelConfig(linears="onednn").validate()


def test_compiled_step_decodes_exactly_like_generate(tiny_factory):
    """model.compile=on: the packed step under torch.compile (inductor, dynamic rows and cache
    length, packed linears as opaque ops) gives generate's tokens; it compiles at most twice."""
    import torch._dynamo

    model = tiny_factory("llama")
    ref = hf_greedy(model, REPETITIVE_PROMPT, 48)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runner = ModelRunner(model, small_rows="off", linears="packed", compile="on")
    cfg = DecodingConfig(max_new_tokens=48, drafts="suffix", draft_budget="all", max_draft_rows=12, W=2, N=3, G=3,
                         window_policy="with_candidates")
    res = LookaheadDecoder(runner, cfg).generate(REPETITIVE_PROMPT)
    assert res.output_ids == ref
    assert runner._compiled is not None and res.stats.steps > 3
    stats = torch._dynamo.utils.counters["stats"]
    # the prefill (an empty cache), the first step, then one dynamic graph for every later step
    assert stats["unique_graphs"] <= 3, dict(stats)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    graphs = stats["unique_graphs"]
    assert not _aliasing_guards(runner), "a compiled step re-checks in Python what every linear shares"
    cfg.max_new_tokens = 40  # another generation, another length: its buffers fall in the same buckets
    again = LookaheadDecoder(runner, cfg).generate(REPETITIVE_PROMPT[2:])
    assert again.output_ids == hf_greedy(model, REPETITIVE_PROMPT[2:], 40)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a new generation recompiled"
    assert hf_greedy(model, REPETITIVE_PROMPT, 48) == ref  # the user's generate stays eager and unchanged
    with pytest.raises(ValueError, match="model.compile must be one of auto, on, off"):
        ModelRunner(model, compile="yes")


def _aliasing_guards(runner) -> list[str]:
    """The compiled forward's guards that dynamo evaluates in Python (LAMBDA_GUARD) on the
    layers' shared switch, fused group or packed weight: one object reached from many modules
    is an aliasing guard per module, ~1 us each on every call (lp.kernels.linears keys them)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    lines = [line for entry in _debug_get_cache_entry_list(runner._traced.__func__.__code__)
             for line in str(entry.guard_manager).splitlines() if "LAMBDA_GUARD" in line]
    assert lines, "no guard found: the cache entries moved"  # the inspection itself still works
    return [line for line in lines if any(k in line for k in (".switch", ".fused", "packed_weight", "_group"))]


def test_fused_siblings_are_one_matmul_and_equal_their_separate_products(tiny_factory):
    """pack stacks q/k/v and gate/up into one packed weight per group: one oneDNN call a group,
    every member's output equal to its own product, whatever order and input it is called with."""
    from torch.profiler import profile

    from lp.lookahead.layout import chain_layout

    model = tiny_factory("llama")
    runner = ModelRunner(model, small_rows="off", linears="packed")
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.fused is attn.k_proj.fused is attn.v_proj.fused is not None
    assert mlp.gate_proj.fused is mlp.up_proj.fused is not None and mlp.down_proj.fused is None
    assert attn.q_proj.fused is not mlp.gate_proj.fused and attn.o_proj.packed_weight is not None
    with profile() as prof:
        runner.forward(chain_layout([3, 4, 5]), runner.new_cache(16, 3))
    calls = {e.key: e.count for e in prof.key_averages()}["mkldnn::_linear_pointwise"]
    layers = model.config.num_hidden_layers
    assert calls == 4 * layers + 1, calls  # qkv, o, gate-up, down a layer, and the head
    switch = attn.q_proj.switch
    x, other = torch.randn(5, model.config.hidden_size), torch.randn(5, model.config.hidden_size)
    switch.packed = True
    try:
        # called in another order, and a member on another input between two of one input
        got = [attn.v_proj(x), attn.k_proj(other), attn.q_proj(x), attn.k_proj(x), mlp.up_proj(x), mlp.gate_proj(x)]
    finally:
        switch.packed = False
    want = [attn.v_proj(x), attn.k_proj(other), attn.q_proj(x), attn.k_proj(x), mlp.up_proj(x), mlp.gate_proj(x)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_kernel_builds_are_kept_per_cpu(monkeypatch, tmp_path):
    """lp's C++ kernels are built with -march=native: build_extension builds each into a folder
    keyed by the CPU (its /proc/cpuinfo model name and flags), torch's and Python's versions, so
    a home shared by machines of other CPUs never loads a build made for another CPU."""
    from torch.utils import cpp_extension

    from lp.kernels import build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    real = build.cpu_identity()
    flags = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith(("flags", "Features"))] if Path("/proc/cpuinfo").is_file() else []
    assert not flags or flags[0] in real  # this CPU's feature flags are part of its key
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(kw) or kw["build_directory"])
    cpus = {"a": "Xeon X\nfpu sse avx2", "b": "Xeon X\nfpu sse avx2 avx512f", "a again": "Xeon X\nfpu sse avx2"}
    dirs = {}
    for name, cpu in cpus.items():
        monkeypatch.setattr(build, "cpu_identity", lambda cpu=cpu: cpu)
        dirs[name] = build.build_extension("lp_attention", "a test")
    assert dirs["a"] != dirs["b"] and dirs["a"] == dirs["a again"]  # another flag: another build
    assert all(kw["extra_cflags"] == ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"] for kw in seen)
    for d in dirs.values():
        assert d.startswith(str(tmp_path)) and d.endswith("/lp_attention") and Path(d).is_dir()
    monkeypatch.setattr(build.torch, "__version__", "0.0.0")  # another torch: another build
    assert build.build_extension("lp_attention", "a test") not in dirs.values()


def test_a_load_killed_midway_does_not_hang_later_loads(tmp_path):
    """torch's extension loader holds a lock *file* in the build folder around every load and
    waits without end while one exists: a process killed inside the loader (a worker killed at
    start-up) left every later server hanging at "loading the kernel" (CI, 92 errors). The
    leftover is planted here on the real (prebuilt) kernel's folder and a fresh process must
    load it within the timeout; a holder killed while holding lp's own flock frees it too."""
    import signal
    import subprocess
    import sys

    from lp.kernels import build

    folder = build.build_directory("lp_attention")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lock").touch()  # what a process killed inside cpp_extension.load leaves
    load = "from lp.kernels import build; build.build_extension('lp_attention', 'a test'); print('loaded')"
    try:
        out = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("a leftover torch lock file made the kernel's load wait forever")
    finally:
        (folder / "lock").unlink(missing_ok=True)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]

    hold = ("import sys, time; from pathlib import Path; from lp.kernels import build\n"
            "with build._build_lock(Path(sys.argv[1]), 'a test'):\n print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="another process has been building the kernel in"):
            with build._build_lock(tmp_path, "a test", wait_s=0.5):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with build._build_lock(tmp_path, "a test", wait_s=10):  # the OS dropped the dead holder's flock
            pass
    finally:
        holder.kill()
