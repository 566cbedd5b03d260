"""model.quant=exact4 (lp.kernels.exact4): linears whose float32 weights are exact 4-bit blocks run
lp's kernel on those blocks. Tiny models whose weights are rounded to 4-bit blocks the way a GGUF
Q4_1 file's dequantization leaves them: every weight reproduced bit for bit, rows independent,
fused q/k/v equal to separate, logits equal to the dense model's up to summation order, and
lookahead (one sequence, a compiled batch) equal to generate on the converted model."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import nn

from lp.config import DecodingConfig
from lp.engine.decoder import LookaheadDecoder
from lp.kernels import exact4
from lp.model.quant import quantize
from lp.model.runner import ModelRunner
from tests.helpers import BATCH_PROMPTS, REPETITIVE_PROMPT, batch_outputs, hf_greedy

pytestmark = [pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="x86 CPU kernels"),
              pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ninja") is None,
                                 reason="the exact4 kernel is built with g++ and ninja")]


def to_q4_blocks(model: nn.Module) -> nn.Module:
    """Every linear but the head rounded as Q4_1 stores it: per 32 weights along the input,
    c = float16(min), d = float16((max - c) / 15), w = q * d + c with q in 0..15."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and m is not head:
                w = m.weight.view(m.out_features, -1, 32)
                c = w.amin(dim=2, keepdim=True).half().float()
                d = ((w.amax(dim=2, keepdim=True) - c) / 15).half().float()
                q = torch.round((w - c) / d).clamp(0, 15)
                m.weight.copy_((q * d + c).view_as(m.weight))
    return model


@pytest.fixture(scope="module")
def q4_model(tiny_factory):
    return to_q4_blocks(copy.deepcopy(tiny_factory("llama")))


def _linears(model):
    return [m for m in model.modules() if isinstance(m, exact4.Exact4Linear)]


def test_every_weight_comes_back_bit_for_bit(q4_model):
    model = copy.deepcopy(q4_model)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert quantize(model, "exact4") == "exact4"
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn._lp_q_k_v, exact4.Exact4Linear)  # q/k/v fused, gate/up fused
    assert isinstance(layer.mlp._lp_gate_up, exact4.Exact4Linear)
    assert isinstance(model.get_output_embeddings(), nn.Linear)  # the head is not 4-bit: left as it was
    for name, lin in model.named_modules():
        if isinstance(lin, exact4.Exact4Linear):
            eye = torch.eye(lin.in_features)
            back_KN = lin(eye)
            parts = [name.rsplit(".", 1)[0] + "." + p for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                                                                  "o_proj", "down_proj")]
            want = torch.cat([dense[p] for p in parts if p in dense][: len(lin.splits)]) if len(lin.splits) > 1 \
                else dense[name]
            assert torch.equal(back_KN.t(), want), name


def test_rows_do_not_depend_on_each_other_and_fused_equals_separate(q4_model):
    model = copy.deepcopy(q4_model)
    attn = model.model.layers[1].self_attn
    q_w, k_w = attn.q_proj.weight.detach().clone(), attn.k_proj.weight.detach().clone()
    quantize(model, "exact4")
    fused = model.model.layers[1].self_attn._lp_q_k_v
    lin = nn.Linear(64, q_w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(q_w)
    from lp.kernels.idot import IDotLinear

    single = IDotLinear.of([lin]) or exact4.Exact4Linear.of([lin])  # the maker convert takes first
    torch.manual_seed(1)
    x = torch.randn(21, fused.in_features)
    y = fused(x)
    for m in (*range(1, 10), 12, 16, 21):  # every row tile the kernel has (1..8 rows), and sums of them
        assert torch.equal(fused(x[:m].clone()), y[:m]), m
        assert torch.equal(fused(x[m - 1 : m].clone())[0], y[m - 1]), m
    assert torch.equal(single(x), y[:, : q_w.shape[0]])  # the stacked columns equal the separate linear's
    q, d, c = exact4.encode(q_w)
    full = exact4.mm(x, exact4.pack(q, d, c), q_w.shape[0])  # exact4's own (the model runs idot where VNNI)
    for n in (1, 7, 13):  # outputs that fill no whole group of 8 (the packed layout's zero padding)
        part = exact4.pack(q[:n].contiguous(), d[:n].contiguous(), c[:n].contiguous())
        assert torch.equal(exact4.mm(torch.eye(q_w.shape[1]), part, n).t(), q_w[:n])
        assert torch.equal(exact4.mm(x, part, n), full[:, :n])
    assert torch.allclose(y[:, q_w.shape[0] : q_w.shape[0] + k_w.shape[0]], x @ k_w.t(), rtol=1e-5, atol=1e-5)


def test_every_tile_width_gives_the_same_bits(q4_model, q48_model):
    """The kernels form 1, 2, 4 or 8 outputs at once per row tile (lp_exact4.tiles(): a speed
    choice, bench.exact4_tiles): each output's sum runs in the same order at every width, so
    every width gives the built-in one's bits, at every row count of a tile, for both kinds."""
    ext = exact4.extension()
    builtin = ext.tiles()
    w_q = q4_model.model.layers[0].mlp.gate_proj.weight.detach().clone()
    p4, n4 = exact4.pack(*exact4.encode(w_q)), w_q.shape[0]
    w_h = q48_model.get_output_embeddings().weight.detach().clone()
    p8, n8 = exact4.pack8(*exact4.encode8(w_h)), w_h.shape[0]
    g = torch.Generator().manual_seed(4)  # 8-bit blocks with a scale and an offset per 16 weights (Q6_K's kind)
    q8x = torch.randint(-32, 32, (40, 256), generator=g, dtype=torch.int8)
    p8x = exact4.pack8x(q8x, torch.rand(40, 16, generator=g), torch.randn(40, 16, generator=g))
    p16 = exact4.pack16(torch.randn(40, 256, generator=g).to(torch.bfloat16))
    p16h = exact4.pack16(torch.randn(40, 256, generator=g).to(torch.float16))
    torch.manual_seed(3)
    try:
        for kind, mm, p, n, k in ((0, exact4.mm, p4, n4, w_q.shape[1]), (1, exact4.mm8, p8, n8, w_h.shape[1]),
                                  (2, exact4.mm8x, p8x, 40, 256),
                                  (3, lambda x, p, n: exact4.mm16(x, p, n, True), p16, 40, 256),
                                  (3, lambda x, p, n: exact4.mm16(x, p, n, False), p16h, 40, 256)):
            for m in range(1, 9):
                x = torch.randn(m, k)
                want = mm(x, p, n)
                for width in (1, 2, 4, 8):
                    ext.set_tile(kind, m, width)
                    assert torch.equal(mm(x, p, n), want), (kind, m, width)
                ext.set_tile(kind, m, builtin[kind][m - 1])
    finally:
        for kind, widths in enumerate(builtin):
            for m, width in enumerate(widths, start=1):
                ext.set_tile(kind, m, width)
    assert ext.tiles() == builtin
    with pytest.raises(RuntimeError, match="set_tile: kind 0"):
        ext.set_tile(0, 9, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_widen_exactly_rows_alone(dtype):
    """``mm16`` (GGUF F16 / BF16 linears): unit rows give back every stored weight widened to
    float32 bit for bit (the widening is exact), each row's output alone equals it among 1-20 rows,
    and the products are x @ W.float().T up to summation order; the zero-padded last group (N = 44)
    adds nothing."""
    g = torch.Generator().manual_seed(16)
    w = (torch.randn(44, 256, generator=g) * 3).to(dtype)
    w[0, :4] = torch.tensor([0.0, -0.0, 1e-7, -65504.0]).to(dtype)  # signed zero, a subnormal (F16), the edge
    p, bf16 = exact4.pack16(w), dtype == torch.bfloat16
    eye = torch.eye(256)
    assert torch.equal(exact4.mm16(eye, p, 44, bf16), w.float().t())
    x = torch.randn(20, 256, generator=g)
    together = exact4.mm16(x, p, 44, bf16)
    for m in (1, 3, 8, 20):
        assert torch.equal(exact4.mm16(x[:m], p, 44, bf16), together[:m])
    for i in range(20):
        assert torch.equal(exact4.mm16(x[i:i + 1], p, 44, bf16), together[i:i + 1])
    assert torch.allclose(together, x @ w.float().t(), rtol=1e-4, atol=1e-3)
    with pytest.raises(RuntimeError, match="exact16_pack"):
        exact4.pack16(torch.randn(4, 48).to(dtype))


def test_the_kernel_runs_on_every_thread():
    """ATen's parallel_for is inline OpenMP: an extension built without -fopenmp runs it on the
    calling thread only (the kernel was single-threaded so, at half its speed on two cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert exact4.extension().parallel_width() == 2
    finally:
        torch.set_num_threads(before)


def test_weights_that_are_not_4_bit_blocks_stay_dense(tiny_factory):
    w = torch.randn(64, 64)
    assert exact4.encode(w) is None
    assert exact4.encode(torch.randn(64, 48)) is None  # K not a multiple of 32
    nearly = to_q4_blocks(nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        nearly.weight[3, 7] = torch.nextafter(nearly.weight[3, 7], torch.tensor(1.0))  # one ulp off
    assert exact4.encode(nearly.weight.detach()) is None
    with pytest.raises(ValueError, match="model.quant=exact4: no linear of this model holds exact 4-bit blocks"):
        quantize(copy.deepcopy(tiny_factory("llama")), "exact4")
    with pytest.raises(ValueError, match="model.quant=exact4 runs float32 models on the CPU"):
        quantize(copy.deepcopy(tiny_factory("llama")).to(torch.bfloat16), "exact4")


@pytest.mark.parametrize("parent,member,fused", [("self_attn", "v_proj", "_lp_q_k_v"), ("mlp", "up_proj", "_lp_gate_up")])
def test_a_group_with_one_member_that_does_not_encode_is_not_fused(q4_model, parent, member, fused):
    """One member of a fused group (q/k/v, gate/up) one ulp off its 4-bit blocks: the group is
    declined (no fused module there), that member stays a dense float32 linear holding its very
    weight, each other member runs on its own exact 4-bit blocks, the other layers' groups
    are fused, and the model still equals the dense one (logits up to summation order, greedy
    tokens)."""
    dense = copy.deepcopy(q4_model)
    off = getattr(getattr(dense.model.layers[0], parent), member)
    with torch.no_grad():
        off.weight[5, 9] = torch.nextafter(off.weight[5, 9], torch.tensor(float("inf")))
    assert exact4.encode(off.weight.detach()) is None
    model = copy.deepcopy(dense)
    want_w = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert quantize(model, "exact4") == "exact4"
    group = getattr(model.model.layers[0], parent)
    assert fused not in dict(group.named_children())  # declined
    kept = getattr(group, member)
    assert isinstance(kept, nn.Linear) and torch.equal(kept.weight, want_w[f"model.layers.0.{parent}.{member}"])
    names = ("q_proj", "k_proj", "v_proj") if parent == "self_attn" else ("gate_proj", "up_proj")
    for name in names:
        if name != member:
            lin = getattr(group, name)
            assert isinstance(lin, exact4.Exact4Linear) and len(lin.splits) == 1, name
            assert torch.equal(lin(torch.eye(lin.in_features)).t(), want_w[f"model.layers.0.{parent}.{name}"]), name
    assert all(isinstance(getattr(getattr(layer, parent), fused), exact4.Exact4Linear)
               for layer in model.model.layers[1:])
    ids = torch.tensor([REPETITIVE_PROMPT])
    with torch.inference_mode():
        want, got = dense(ids).logits, model(ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    assert hf_greedy(model, REPETITIVE_PROMPT, 20) == hf_greedy(dense, REPETITIVE_PROMPT, 20)


def test_logits_equal_the_dense_model_up_to_summation_order(q4_model):
    model = copy.deepcopy(q4_model)
    quantize(model, "exact4")
    ids = torch.tensor([REPETITIVE_PROMPT])
    with torch.inference_mode():
        want, got = q4_model(ids).logits, model(ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_lookahead_equals_generate_on_the_converted_model(q4_model):
    import torch._dynamo

    model = copy.deepcopy(q4_model)
    quantize(model, "exact4")
    ref = hf_greedy(model, REPETITIVE_PROMPT, 40)
    assert ref == hf_greedy(q4_model, REPETITIVE_PROMPT, 40)  # and here equal to the dense model's
    cfg = DecodingConfig(max_new_tokens=40, drafts="suffix", draft_budget="all", max_draft_rows=12, W=2, N=3, G=3,
                         window_policy="always")
    runner = ModelRunner(model)
    assert runner.quant == "exact4" and runner.linears == "packed"  # the head it kept is packed
    res = LookaheadDecoder(runner, cfg).generate(REPETITIVE_PROMPT)
    assert res.output_ids == ref and res.stats.compression_ratio > 1.0
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = ModelRunner(model, small_rows="off", compile="on")
    assert batch_outputs(compiled, cfg) == [hf_greedy(model, p, 40) for p in BATCH_PROMPTS]
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > 0, "the batched step never ran compiled"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_one_pass_encoder_equals_the_torch_reference(q4_model):
    """lp_exact4.encode (C++, one pass) finds the very blocks encode_torch finds, and declines what
    it declines: a weight one ulp off its block, a NaN, a block minimum that is not a float16 value,
    a constant block (d = 0)."""
    lins = [m for m in q4_model.modules() if isinstance(m, nn.Linear) and m is not q4_model.get_output_embeddings()]
    cases = [lin.weight.detach().clone() for lin in lins]
    w = lins[0].weight.detach()
    off = w.clone()
    off[3, 37] = torch.nextafter(off[3, 37], torch.tensor(float("inf")))
    nan = w.clone()
    nan[0, 0] = float("nan")
    not_half = w.clone()
    not_half[5, 32] = -1.0 / 3.0  # the second block's new minimum, not a float16 value
    const = w.clone()
    const[2, :32] = 0.25  # d = 0: q = 0 everywhere, w = c
    cases += [off, nan, not_half, const]
    accepted = 0
    for case in cases:
        a, b = exact4.encode(case), exact4.encode_torch(case)
        assert (a is None) == (b is None)
        if a is not None:
            accepted += 1
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert accepted == len(lins) + 1  # every rounded linear and the constant block; the three others declined


# -- the LM head as exact 8-bit blocks (a GGUF Q8_0 head: SmolLM2's) --------------------------------


def to_q8_head(model: nn.Module) -> nn.Module:
    """The head rounded as Q8_0 stores it: per 32 weights d = float16(max |w| / 127), w = q * d with
    q = round(w / d) in -127..127 (a tied embedding shares it)."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        w = head.weight.view(head.out_features, -1, 32)
        d = (w.abs().amax(dim=2, keepdim=True) / 127).half().float()
        head.weight.copy_((torch.round(w / d).clamp(-127, 127) * d).view_as(head.weight))
    return model


@pytest.fixture(scope="module")
def q48_model(q4_model):
    return to_q8_head(copy.deepcopy(q4_model))


def test_a_q8_head_runs_on_its_blocks_bit_for_bit_and_rows_alone(q48_model):
    w_VK = q48_model.get_output_embeddings().weight.detach().clone()
    q, d = exact4.encode8(w_VK)
    p, v = exact4.pack8(q, d), w_VK.shape[0]
    eye = torch.eye(w_VK.shape[1])
    assert torch.equal(exact4.mm8(eye, p, v).t(), w_VK)  # every weight, bit for bit
    torch.manual_seed(2)
    x = torch.randn(21, w_VK.shape[1])
    y = exact4.mm8(x, p, v)
    for m in (*range(1, 10), 12, 16, 21):  # every row tile: a row's logits depend on that row only
        assert torch.equal(exact4.mm8(x[m - 1 : m].clone(), p, v)[0], y[m - 1]), m
        assert torch.equal(exact4.mm8(x[:m].clone(), p, v), y[:m]), m
    for n in (1, 7, 13):  # outputs that fill no whole group of 8 (the packed layout's zero padding)
        assert torch.equal(exact4.mm8(eye, exact4.pack8(q[:n].contiguous(), d[:n].contiguous()), n).t(), w_VK[:n])
    assert torch.allclose(y, x @ w_VK.t(), rtol=1e-5, atol=1e-5)  # the fp32 head's, up to summation order


def test_a_head_that_is_not_8_bit_blocks_stays_float32(q4_model, q48_model):
    w = q48_model.get_output_embeddings().weight.detach()
    off = w.clone()
    off[3, 37] = torch.nextafter(off[3, 37], torch.tensor(float("inf")))  # one ulp off its block
    assert exact4.encode8(off) is None and exact4.encode8(torch.randn(64, 64)) is None
    model = copy.deepcopy(q4_model)  # random head
    quantize(model, "exact4")
    runner = ModelRunner(model)
    assert runner.linears == "packed" and runner.head8 is None


def test_lookahead_on_the_8_bit_head_equals_generate(q48_model):
    """The runner's head reads the 8-bit blocks (up to HEAD8_MAX_ROWS rows, the fp32 head beyond),
    and lookahead == generate on the converted model (whose head, nn.Linear, multiplies the same
    float32 weights); model.head=exact keeps the fp32 head."""
    model = copy.deepcopy(q48_model)
    quantize(model, "exact4")
    ref = hf_greedy(model, REPETITIVE_PROMPT, 40)
    cfg = DecodingConfig(max_new_tokens=40, drafts="suffix", draft_budget="all", max_draft_rows=12, W=2, N=3, G=3,
                         window_policy="always")
    runner = ModelRunner(model)
    assert runner.head8 is not None and runner.head_screen is None
    res = LookaheadDecoder(runner, cfg).generate(REPETITIVE_PROMPT)
    assert res.output_ids == ref and res.stats.compression_ratio > 1.0
    assert runner.head8.calls >= res.stats.steps  # every step's head ran on the blocks
    if exact4.extension().vnni():  # its drafting steps' greedy rows through the screen (Head8.argmax_logits)
        assert runner.head8.screened > 0
    calls = runner.head8.calls
    torch.manual_seed(3)
    x = torch.randn(exact4.HEAD8_MAX_ROWS + 1, model.config.hidden_size)
    assert runner.head8.logits(x) is None and runner.head8.calls == calls  # more rows: the fp32 head
    fp32 = ModelRunner(model, head="exact")
    assert fp32.head8 is None and LookaheadDecoder(fp32, cfg).generate(REPETITIVE_PROMPT).output_ids == ref
    assert runner.head8.calls == calls  # another runner with model.head=exact on the same model: its own head


def test_rms_norms_run_as_one_op_rows_alone(q4_model, tiny_factory):
    """Under exact4 every Llama-style RMSNorm is one op (lp_exact4::rms_norm): the module's own
    values up to the mean's summation order, a row's output from that row alone, the module's
    weight shared; Gemma 3's norms with their scale 1 + w; a norm whose formula differs is left as it was."""
    model = copy.deepcopy(q4_model)
    reference = copy.deepcopy(model.model.layers[0].input_layernorm)
    with torch.no_grad():
        reference.weight.copy_(torch.randn_like(reference.weight))
    quantize(model, "exact4")
    fused = [m for m in model.modules() if isinstance(m, exact4.FusedRMSNorm)]
    assert len(fused) == 2 * len(model.model.layers) + 1
    assert model.model.layers[0].input_layernorm.weight is fused[0].weight
    norm = exact4.FusedRMSNorm(reference)
    torch.manual_seed(3)
    x = torch.randn(4, 5, reference.weight.shape[0]) * 3
    x[0] *= 1e-3  # rows whose mean square is near eps: eps must be added where the module adds it
    with torch.no_grad():
        y, want = norm(x), reference(x)
        assert torch.allclose(y, want, rtol=2e-6, atol=1e-6)
        for i in range(4):
            for j in range(5):
                assert torch.equal(norm(x[i, j : j + 1].clone())[0], y[i, j]), (i, j)
        odd = nn.Linear(37, 1)  # a width that fills no 16-lane vector: the tail's path
        odd_norm = type(reference)(37, eps=reference.variance_epsilon)
        odd_norm.weight.copy_(odd.weight[0])
        xo = torch.randn(6, 37)
        assert torch.allclose(exact4.FusedRMSNorm(odd_norm)(xo), odd_norm(xo), rtol=2e-6, atol=1e-6)
    # Gemma's (x * rsqrt(...)) * (1 + w): the op with the scale 1 + w; a norm of that class name
    # whose forward is another formula is left as it was
    gemma = copy.deepcopy(tiny_factory("gemma3"))
    norms = [m for m in gemma.modules() if type(m).__name__ == "Gemma3RMSNorm"]
    ids = torch.randint(0, gemma.config.vocab_size, (1, 12))
    with torch.no_grad():
        for m in norms:
            m.weight.copy_(torch.randn_like(m.weight) * 0.5)
        want = gemma(input_ids=ids).logits
        assert exact4.convert_norms(gemma) == len(norms) > 0
        swapped = [m for m in gemma.modules() if isinstance(m, exact4.FusedRMSNorm)]
        assert len(swapped) == len(norms)
        assert all(torch.equal(f.weight, 1.0 + n.weight) for f, n in zip(swapped, norms))
        assert torch.allclose(gemma(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    unlike = type("Gemma3RMSNorm", (nn.Module,), {"forward": lambda self, x: x * (1.0 + self.weight)})()
    unlike.weight, unlike.eps = nn.Parameter(torch.randn(64)), 1e-6
    holder = nn.Sequential(unlike)
    assert exact4.convert_norms(holder) == 0 and holder[0] is unlike


# -- the greedy head's screen (Head8.argmax_logits, lp_exact4.screen8) ----------------------------


@pytest.fixture(scope="module")
def vnni():
    if not exact4.extension().vnni():
        pytest.skip("the head's screen runs where the kernels' build has AVX-512 VNNI")


def _q8_head(V: int, K: int, seed: int) -> torch.Tensor:
    """A random [V, K] head in Q8_0's blocks, per-token scales far apart (the screen's per-token
    re-quantization loses the most where a token's blocks differ)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.round(torch.randn(V, K // 32, 32, generator=g) * 40).clamp(-127, 127)
    q[:, :, 0] = 127  # the block's largest |q|, as Q8_0 writes it
    d = ((0.02 + torch.rand(V, K // 32, 1, generator=g)).pow(2) * 1e-3).half().float()
    return (q * d).view(V, K).contiguous()


def _adversarial_rows(w_VK: torch.Tensor, screen, tokens) -> torch.Tensor:
    """Per token v, the one-hot row c e_i at the input i where the screen's int8 weight w~ is
    furthest from w, signed so that the true logit lies above the screen's: its error is then
    c werr_v, the bound's leading term, with nothing to spare but the bound's 2%."""
    _, D_V, _, _ = screen
    rows = []
    for v in tokens:
        r = torch.clamp(torch.round(w_VK[v].double() / D_V[v].double()), -127, 127)
        delta = w_VK[v].double() - r * D_V[v].double()
        i = int(delta.abs().argmax())
        x = torch.zeros(w_VK.shape[1])
        x[i] = 3.0 * (1.0 if delta[i] > 0 else -1.0)
        rows.append(x)
    return torch.stack(rows)


def test_the_head_screen_bounds_every_logit(vnni):
    """upper >= every token's exact8 logit, and each row's largest lower <= its maximum, on random
    rows with outlier channels and on rows that drive the screen's weight error to its bound (a
    bound of 0.9x the proved one fails there)."""
    ext = exact4.extension()
    w_VK = _q8_head(203, 96, seed=5)  # a vocabulary that fills no whole group of 16 (nor of 8)
    q, d = exact4.encode8(w_VK)
    p, screen = exact4.pack8(q, d), ext.screen8_pack(q, d)
    torch.manual_seed(6)
    x = torch.randn(24, 96)
    x[:, 7] *= 40  # an outlier channel, as final hidden states have
    x = torch.cat([x, _adversarial_rows(w_VK, screen, range(0, 203, 7)), torch.zeros(1, 96)])
    ok, upper_MV, lower_M = ext.screen8(x, *screen)
    f_MV = exact4.mm8(x, p, 203)
    assert ok and upper_MV.shape == f_MV.shape
    assert (upper_MV >= f_MV).all(), float((upper_MV - f_MV).min())
    assert (lower_M <= f_MV.max(1).values).all()
    x[3, 5] = float("nan")
    assert not ext.screen8(x, *screen)[0]


def test_greedy_rows_through_the_screen_keep_the_heads_argmax_and_bits(vnni):
    """argmax_logits: every row's argmax (ties by the first index) is the exact8 head's, every finite
    entry is that head's logit bit for bit, over random, near-tied and one-hot rows
    (where the screen's own order of the tokens is often wrong), 1 to 64 rows; more than 64: None
    (as ``logits`` past its rows: the caller runs the fp32 head)."""
    from lp.kernels.head import argmax_rows

    w_VK = _q8_head(517, 64, seed=7)
    w_VK[300] = w_VK[17]  # two tokens with the same weights: every row ties them
    # tokens 0..31 lead input 0 (q = 127, their block scales rising with the token) but hold a larger
    # block scale in their second block, falling with the token: the screen's one scale a token
    # rounds input 0 coarsely, and its order of them there is the reverse of the true one
    ladder = torch.tensor([float(torch.tensor(0.004 + 1e-5 * v).half()) for v in range(32)])
    w_VK[:32, :32] *= 0
    w_VK[:32, 0] = 127 * ladder
    w_VK[:32, 32:] = torch.round(torch.randn(32, 32, generator=torch.Generator().manual_seed(9)) * 40).clamp(-127, 127)
    w_VK[:32, 32] = 127
    w_VK[:32, 32:] *= (0.05 - 1e-3 * torch.arange(32.0)).half().float()[:, None]
    D_V = exact4.extension().screen8_pack(*exact4.encode8(w_VK))[1]
    true, seen = int(w_VK[:, 0].argmax()), int((D_V * torch.round(w_VK[:, 0] / D_V)).argmax())
    assert true // 8 == seen // 8 != 0 and true != seen  # move the true first into group 0, alone with it
    w_VK[[0, true]] = w_VK[[true, 0]]
    q, d = exact4.encode8(w_VK)
    h8 = exact4.Head8(exact4.pack8(q, d), 517, q, d)
    torch.manual_seed(8)
    eye = torch.eye(64) * 2.5  # one-hot rows: the logits are one input's weights, many close
    x = torch.cat([torch.randn(40, 64), eye, -eye, torch.randn(8, 64) * 1e-30])
    screened = 0
    for m0, m in [(0, 2), (2, 5), (7, 8), (15, 16), (31, 33), (40, 2), (64, 64), (128, 8), (136, 1)]:
        rows = x[m0 : m0 + m].contiguous()
        full, got = exact4.mm8(rows, h8.p, 517), h8.argmax_logits(rows)
        assert argmax_rows(got) == argmax_rows(full), (m0, m)
        keep = torch.isfinite(got)
        assert torch.equal(got[keep], full[keep]) and keep.any(1).all()
        screened += 1
    assert h8.screened == screened
    assert h8.argmax_logits(x[:65]) is None and h8.screened == screened  # the caller's fp32 head
    assert argmax_rows(h8.argmax_logits(torch.zeros(2, 64))) == [0, 0]  # all tie: the first index


def test_the_head_screen_runs_without_the_gil(vnni):
    """screen8_logits releases the GIL (as torch.ops calls do): the server's HTTP thread runs
    while a step's head does. A Python thread stamps the time as it counts; with the switch
    interval at 0.5 ms, some stamps fall well inside one ~10 ms call (a call that kept the GIL
    leaves none there)."""
    import sys
    import threading
    import time

    ext = exact4.extension()
    w_VK = _q8_head(32768, 576, seed=11)
    q, d = exact4.encode8(w_VK)
    screen, p = ext.screen8_pack(q, d), exact4.pack8(q, d)
    x = torch.randn(64, 576)
    stamps, stop = [], [False]

    def count():
        while not stop[0]:
            stamps.append(time.perf_counter())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)
    counter = threading.Thread(target=count)
    counter.start()
    try:
        inside = 0
        for _ in range(3):
            t0 = time.perf_counter()
            ext.screen8_logits(x, *screen, p, 32768)
            t1 = time.perf_counter()
            assert t1 - t0 > 4e-3, t1 - t0  # long enough to tell
            inside += sum(t0 + 2e-3 < s < t1 - 1e-3 for s in stamps[-200000:])
    finally:
        stop[0] = True
        counter.join()
        sys.setswitchinterval(interval)
    assert inside > 0
