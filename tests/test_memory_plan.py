"""The memory plan per rank (lp.parallel.memory): read from the checkpoint's headers before any
weights load, split as lp.parallel.tp shards, and a configuration that cannot fit refused with
a ValueError naming the setting to change (lp.generate refuses before loading)."""

from __future__ import annotations

import shutil

import pytest
import torch

from lp.parallel import memory
from lp.parallel.memory import GiB, MemoryPlan, plan_memory, weight_bytes, weights_bytes
from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    untied = tmp_path_factory.mktemp("plan_untied")
    tied = tmp_path_factory.mktemp("plan_tied")
    make_tiny_model(tie_word_embeddings=False).save_pretrained(untied)
    make_tiny_model(tie_word_embeddings=True).save_pretrained(tied)
    return untied, tied


def _tensors(model) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters()}


def test_weights_per_rank_follow_the_tp_plan(ckpts):
    """TP 1: every tensor's bytes; TP 2: q/k/v/o/gate/up/down (and an untied embedding and
    head) halved, norms replicated; tied: the embedding replicated, the head not stored."""
    from transformers import AutoConfig

    untied, tied = ckpts
    model = make_tiny_model(tie_word_embeddings=False)
    sizes = _tensors(model)
    total = 4 * sum(sizes.values())
    sharded = 4 * sum(n for k, n in sizes.items() if "proj" in k or "embed" in k or "lm_head" in k)
    cfg = AutoConfig.from_pretrained(untied)
    assert weight_bytes(untied, cfg, 1, 4) == (total, total)
    w2, rep2 = weight_bytes(untied, cfg, 2, 4)
    assert w2 == total - sharded // 2 and rep2 == total - sharded
    tcfg = AutoConfig.from_pretrained(tied)
    embed = 4 * sizes["model.embed_tokens.weight"]
    wt, rept = weight_bytes(tied, tcfg, 2, 4)
    assert wt == total - embed - (sharded - 2 * embed) // 2  # one stored embedding, whole on every rank
    assert rept == total - embed - (sharded - 2 * embed)


def test_plan_counts_kv_and_the_step(ckpts):
    untied, _ = ckpts
    plan = plan_memory(untied, torch.float32, torch.device("cpu"), 2, max_len=100, step_rows=10, kv_tokens=1000)
    # 2 layers x (keys + values) x 2 KV heads x 16 dims x 4 bytes, 1 KV head per rank at tp 2
    assert plan.kv_per_token == 2 * 2 * 1 * 16 * 4
    assert plan.kv_request == 100 * plan.kv_per_token and plan.kv_pool == 1000 * plan.kv_per_token
    assert plan.step >= 10 * 128 * 4  # at least the float32 logits of the rows
    assert plan.free and plan.free > 0 and "MemAvailable" in plan.source
    assert plan.needed == plan.weights + plan.kv_pool + plan.step
    assert any("memory plan per rank" in line for line in plan.lines())


def _plan(**kw) -> MemoryPlan:
    base = dict(device="cuda:0", tp=1, dtype="bfloat16", weights=10 * GiB, replicated=1 * GiB, kv_per_token=100_000,
                kv_request=1 * GiB, kv_pool=None, step_rows=64, step=GiB // 10, graphs=0, free=80 * GiB, max_len=8192,
                source="test")
    base.update(kw)
    return MemoryPlan(**base)


def test_plans_that_cannot_fit_name_the_setting():
    _plan().check()  # fits
    with pytest.raises(ValueError, match=r"weights need 140.00 GiB per rank at parallel.tp=1.*raise parallel.tp"):
        _plan(weights=140 * GiB, free=139 * GiB).check()
    with pytest.raises(ValueError, match=r"lower server.kv_tokens \(at most ~\d+ here\)"):
        _plan(kv_pool=75 * GiB).check()
    with pytest.raises(ValueError, match=r"one 8192-token request.*lower decoding.max_new_tokens"):
        _plan(kv_request=75 * GiB).check()
    # an int8 model whose steady state (10 GiB) fits 80 GiB but whose load peak (the bf16 model, 100 GiB) does not
    with pytest.raises(ValueError, match=r"loading the model peaks at 100.00 GiB per rank \(model.quant=int8 .*"
                                         r"10.00 GiB once quantized\)"):
        _plan(load_peak=100 * GiB, quant="int8").check()
    _plan(load_peak=60 * GiB, quant="int8").check()
    _plan(free=None).check()  # unknown free memory: nothing refused
    _plan(weights=None, free=GiB).check()  # no safetensors: nothing to plan from


def test_quantized_plan_counts_the_load_peak(ckpts, monkeypatch):
    """model.quant=int8 / int4: load_model reads the whole checkpoint in model.dtype and quantizes
    after, so the plan counts that peak beside the quantized steady state, and refuses a device
    the steady state fits but the peak does not, naming the peak. Literal sizes of the tiny Llama
    (vocab 128, hidden 64, 2 layers, q/o 64x64, k/v 32x64, gate/up/down 128x64 / 64x128): linears
    2 x 36864 + head 8192 = 81920 weights, the rest (embedding 8192, norms 5 x 64) 8512."""
    untied, tied = ckpts
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    plan = plan_memory(untied, torch.float32, cpu, 1, max_len=8, step_rows=1, quant="int8")
    # CPU int8: int8 linears, the rest float32; peak: all 90432 weights in float32 plus the
    # fused gate/up (16384 weights) being quantized at 10 bytes a weight
    assert plan.weights == 81920 * 1 + 8512 * 4 == 115968
    assert plan.load_peak == 90432 * 4 + 16384 * 10 == 525568
    assert any("0.00 GiB at the load peak" in line and "quant=int8" in line for line in plan.lines())
    # a tied checkpoint stores no head; quantizing unties it (a copy), so the same sizes
    assert weights_bytes(tied, plan_config(tied), 1, torch.float32, cpu, "int8") == (115968, 115968, 525568)
    # CUDA int8 from bfloat16 (torchao, no fusion): rest bf16; peak bf16 + one 8192 linear at 5 bytes
    assert weights_bytes(untied, plan_config(untied), 1, torch.bfloat16, cuda, "int8") == (
        81920 + 8512 * 2, 81920 + 8512 * 2, 90432 * 2 + 8192 * 5)
    # int4 from float32: 0.625 bytes a linear weight (scales, zero points), the rest bf16; the
    # float32 model is the peak
    assert weights_bytes(untied, plan_config(untied), 1, torch.float32, cpu, "int4") == (
        51200 + 8512 * 2, 51200 + 8512 * 2, 90432 * 4 + 8192 * 5)
    # unquantized: the peak is the steady state
    none = plan_memory(untied, torch.float32, cpu, 1, max_len=8, step_rows=1)
    assert none.weights == none.load_peak == 90432 * 4
    # a device the quantized model and its K/V fit (0.9 x 500000 = 450000 >= 115968 + 4096 + 3620)
    # but the load peak (525568) does not: refused before loading, naming the peak
    monkeypatch.setattr(memory, "_free_bytes", lambda device: (500_000, "a small device"))
    plan = plan_memory(untied, torch.float32, cpu, 1, max_len=8, step_rows=1, quant="int8")
    assert plan.needed == 115968 + 8 * 512 + 1 * (128 * 4 + 12 * 64 * 4 + 4 * 9) <= 0.9 * 500_000 < plan.load_peak
    with pytest.raises(ValueError, match=r"loading the model peaks at 0.00 GiB per rank \(model.quant=int8"):
        plan.check()
    monkeypatch.setattr(memory, "_free_bytes", lambda device: (600_000, "a larger device"))
    plan_memory(untied, torch.float32, cpu, 1, max_len=8, step_rows=1, quant="int8").check()  # 540000 > peak


def plan_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def test_generate_refuses_before_any_weights_load(ckpts, tmp_path, monkeypatch):
    """lp.generate with a model that cannot fit: the ValueError comes from the plan, and the
    loader is never called."""
    from lp.config import DecodingConfig, GenerateConfig, ModelConfig
    from lp.generate import run
    from lp.model.loader import load_tokenizer, resolve_model_path
    from lp.parallel import tp

    folder = tmp_path / "tok"
    shutil.copytree(ckpts[0], folder)
    load_tokenizer(resolve_model_path("smollm2", None)).save_pretrained(folder)  # SmolLM2's tokenizer files

    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the plan refused")

    monkeypatch.setattr(tp, "load_for", no_load)
    monkeypatch.setattr(memory, "_free_bytes", lambda device: (1000, "a tiny device"))
    cfg = GenerateConfig(model=ModelConfig(path=str(folder), dtype="float32"),
                         decoding=DecodingConfig(max_new_tokens=4), prompt="hi", stream=False)
    with pytest.raises(ValueError, match=r"weights need .* GiB per rank at parallel.tp=1"):
        run(cfg)
    # model.quant=int8: the quantized weights (115968 bytes) fit 0.9 x 500000, loading's peak
    # (525568: the float32 checkpoint whole, then quantized) does not
    monkeypatch.setattr(memory, "_free_bytes", lambda device: (500_000, "a small device"))
    cfg = GenerateConfig(model=ModelConfig(path=str(folder), dtype="float32", quant="int8"),
                         decoding=DecodingConfig(max_new_tokens=4), prompt="hi", stream=False)
    with pytest.raises(ValueError, match=r"loading the model peaks at .* GiB per rank \(model.quant=int8"):
        run(cfg)
