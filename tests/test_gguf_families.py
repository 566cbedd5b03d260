"""Each model family, as a GGUF file in each block format, runs exactly (issue 50, items 1-3).

A tiny random model of every family lp claims (llama, qwen2 with q/k/v biases, qwen3 with q/k
norms, gemma3 with its extra norms, GeGLU, scaled embeddings and sliding windows, gemma2 with
soft-capped attention and logits besides, phi3 with fused q/k/v and gate/up; and, on transformers'
own modules, starcoder2 and stablelm: LayerNorms, biases, partial rotary, a layer that drops its
keyword arguments) is written by tests/gguf_tiny.py, in llama.cpp's Q4_K_M mix (Q4_K, with Q6_K
for v and down and the head, Q8_0 for the embedding) and, on qwen2 (biases on every kernel), in each
format lp keeps as blocks, F16 / BF16 (kept as 2-byte floats) among them. For each file:

* every decoder linear in a kept format runs on lp's exact kernels (none is held as float32);
* the logits of every prompt position are those of transformers' ``from_pretrained(gguf_file=...)``
  in float32 up to summation order (and argmax-equal);
* greedy lookahead with lp's defaults equals ``generate`` on transformers' model, token for token
  up to proven float32 ties, on lp's own decoder stack (lp.kernels.fused: its C++ layers or its loop
  over the layers' modules, kept where bit-equal to the model's forward), one sequence and batched;
* with ``model.quant=none`` every parameter is transformers' own, bit for bit (the name map, the
  processors' permutations and the dequantization are the same).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gguf_tiny import FAMILIES, OTHERS, Q4_K_M, write_tiny_gguf

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS",
           "IQ2_XXS", "IQ2_XS", "IQ3_S", "IQ1_S")  # the last four: codebooks, int8 codes with the file's scales
CASES = [(arch, "Q4_K_M") for arch in FAMILIES + OTHERS] + [("qwen2", kind) for kind in FORMATS] + \
        [("llama", "F16"), ("llama", "BF16"), ("qwen3", "Q6_K")]  # qwen3: a tied Q6_K embedding and head, one copy
CPP_STACK = ("llama", "qwen2", "qwen3", "gemma3", "phi3")  # families lp.kernels.fused runs as its C++ layers (the others: its loop)
TIED = ("qwen3",)  # as its small real models are; the others write an output tensor (a tied random model repeats its input token: a weak check)
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"


def _kinds(fmt: str) -> dict:
    return Q4_K_M if fmt == "Q4_K_M" else {"attn": fmt, "ffn": fmt, "embd": fmt, "output": fmt}


@pytest.mark.parametrize("arch,fmt", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_family_gguf_runs_exactly(arch, fmt, tokenizer, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.kernels import idot
    from lp.kernels.exact4 import BlockHead, Exact4Linear, extension
    from lp.kernels.fused import FusedDecoder
    from lp.model.gguf import CODES8, KEPT
    from lp.model import calibrate
    from lp.model.loader import load_model
    from lp.model.runner import ModelRunner
    from tests.helpers import batch_outputs, hf_greedy
    from tests.test_smollm2 import assert_equal_or_tie

    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    file = write_tiny_gguf(tmp_path / f"{arch}-{fmt}.gguf", arch, _kinds(fmt), tokenizer, seed=len(arch),
                           tie=arch in TIED)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name, dtype=torch.float32,
                                               attn_implementation="eager" if arch == "gemma2" else "sdpa").eval()
    model, tok = load_model(file, "auto", quant="auto")
    ids = tok(PROMPT)["input_ids"]
    assert len(ids) > 16  # past gemma3's sliding window of 8

    linears = [m for m in ref.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    kernels = [m for m in model.modules() if isinstance(m, Exact4Linear)]
    on_kernels = sum(len(m.splits) for m in kernels)
    kept = fmt == "Q4_K_M" or fmt in KEPT or fmt in CODES8
    avx512 = extension().avx512()
    fast = avx512 or idot.available()  # lp's exact kernels: AVX-512, or idot's AVX2 form
    if not avx512 and fast:  # AVX2: the formats idot takes, the rest float32
        kept = kept and fmt != "Q2_K"
        assert getattr(model, "_lp_quant", None) == ("exact4" if kept else None)
        assert all(isinstance(m, idot.IDotLinear) for m in kernels)
        assert isinstance(model.get_output_embeddings(), idot.IBlockHead) == kept
    if kept and fast:
        assert model._lp_quant == "exact4"
        assert on_kernels == len(linears), f"{on_kernels} of {len(linears)} decoder linears on exact kernels"
        big = [n for n, p in model.named_parameters() if p.dim() == 2 and p.dtype == torch.float32]
        assert not big, f"float32 copies of file blocks: {big[:4]}"
        assert isinstance(model.get_output_embeddings(), BlockHead)  # idot's IBlockHead is one
        if fmt in ("F16", "BF16"):  # 2-byte floats everywhere, the embedding's rows widened from them
            assert all(m.bits == 16 for m in kernels) and model.get_output_embeddings().bits == 16
            emb = model.get_input_embeddings()
            every = torch.arange(emb.num_embeddings)
            assert torch.equal(emb(every), ref.get_input_embeddings().weight)
        if fmt == "Q6_K":  # embedding and head held as exactq's kind 8, rows widened bit for bit
            head, emb = model.get_output_embeddings(), model.get_input_embeddings()
            from lp.kernels.fused import kernel_kind

            # linears on Q6_K's codes: idot's kind 25 where the CPU has VNNI, else exactq's kind 8; the
            # head (a QParts format) idot's 25 with its screen wherever idot runs (no second int8 copy)
            assert head.qkind == (25 if idot.available() else 8) and head.h8 is not None
            assert all(kernel_kind(m) in (8, 25) for m in kernels)
            assert (emb.source is head) == (arch in TIED)
            every = torch.arange(emb.num_embeddings)
            assert torch.equal(emb(every), ref.get_input_embeddings().weight)
        if (fmt.startswith("IQ4") or fmt in ("Q3_K", "Q2_K")) and idot.iq4_kinds():
            from lp.kernels.fused import kernel_kind

            # the file's nibbles (kinds 34 / 38: IQ4_XS's d per 256, int8 scales), not a byte a code; Q3_K's 3-bit codes (36);
            # Q2_K's 2-bit ones (37), not exact8x's byte and float32 scales
            want, bits = {"Q3_K": ((36,), 3.625), "Q2_K": ((37,), 3.25), "IQ4_XS": ((38,), 4.375)}.get(fmt, ((34,), 4.5))
            assert all(kernel_kind(m) in want for m in kernels), [kernel_kind(m) for m in kernels]
            assert max(m.bits for m in kernels) <= bits
        if fmt in CODES8:  # a byte a weight and the file's scale per 32 (idot's 8-bit kinds) or 16 (exact8x)
            from lp.kernels.fused import kernel_kind

            want = (28, 31) if CODES8[fmt] == 32 and idot.available() else (1, 2) if avx512 else (22, 28, 31)
            assert all(kernel_kind(m) in want for m in kernels), [kernel_kind(m) for m in kernels]
        if arch == "qwen2":
            assert all(m.b is not None for m in kernels if len(m.splits) == 3)  # q/k/v biases on the kernel
    elif not kept:
        assert on_kernels == 0

    with torch.no_grad():
        x = torch.tensor([ids])
        got, want = model(input_ids=x).logits, ref(input_ids=x).logits
    scale = want.abs().max().item()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * scale), (got - want).abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    ref_tokens = hf_greedy(ref, ids, 32)
    if arch == "gemma2":  # soft-capped attention: the eager kernel only (sdpa would drop the cap silently)
        with pytest.raises(ValueError, match="model.attention=sdpa: this model soft-caps"):
            ModelRunner(model, attention="sdpa")
    runner = ModelRunner(model)
    if arch in OTHERS:  # transformers' modules, and the log line says why
        assert runner.fused is None and type(ref.model.layers[0]).__name__ in runner.fused_why
    elif kept and fast:
        assert runner.fused is not None, runner.fused_why  # lp's own stack (C++ or its layer loop), bit-equal
        if arch in CPP_STACK:  # its C++ layers, whatever the mix of kernel kinds, with q/k/v biases
            assert isinstance(runner.fused, FusedDecoder), runner.fused
    eos = ref.generation_config.eos_token_id  # generate stops there: lp too
    out = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=32)).generate(ids, eos_token_ids=eos).output_ids
    assert_equal_or_tie(ref, ids, out, ref_tokens, what=f"{arch} {fmt}")
    if fmt == "Q4_K_M":  # the server's batched step (paged pool, lp's attention) on the same stack
        prompts = [ids, ids[5:], ids[:9] * 2]
        for prompt, got in zip(prompts, batch_outputs(runner, DecodingConfig(max_new_tokens=16), prompts, eos)):
            assert_equal_or_tie(ref, prompt, got, hf_greedy(ref, prompt, 16), what=f"{arch} {fmt} batched")
        if arch in CPP_STACK and fast:  # as one decoder_paged call a step
            assert runner.fused.paged_calls > 0

    dense, _ = load_model(file, "auto", quant="none", tokenizer=False)  # a restart: the kept metadata, not a parse
    for name, p in ref.named_parameters():
        assert torch.equal(dense.get_parameter(name), p), name
    # the same t(Q) cache key as the first load's parse (else a restart measures t(Q) again)
    assert calibrate.cache_key(dense) == calibrate.cache_key(model)


def test_chat_template_override(tokenizer, tmp_path):
    """``model.chat_template``: a file's template or an inline one replaces the model's (a GGUF file
    without a template, as a base model's); a value that is neither is a ValueError naming the field,
    and ``lp generate`` stops on it before loading anything."""
    import subprocess
    import sys

    from lp.config import ModelConfig, chat_template_text

    inline = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    file = tmp_path / "t.jinja"
    file.write_text(inline)
    assert chat_template_text(None) is None
    assert chat_template_text(inline) == inline and chat_template_text(str(file)) == inline
    for bad in ("", "no-such-file.jinja", str(tmp_path)):
        with pytest.raises(ValueError, match=r"model\.chat_template"):
            ModelConfig(chat_template=bad).validate()
    (tmp_path / "plain.txt").write_text("hello")
    with pytest.raises(ValueError, match="holds no Jinja template"):
        chat_template_text(str(tmp_path / "plain.txt"))

    fields = [f for f in tokenizer if f[0] != "tokenizer.chat_template"]
    gguf = write_tiny_gguf(tmp_path / "base.gguf", "llama", Q4_K_M, fields, seed=3, tie=False)
    root = Path(__file__).resolve().parent.parent
    # no t(Q) measurement (decoding.draft_calibration=false): what runs here is the template, not the budget
    env_cmd = [sys.executable, "-m", "lp.generate", f"model.path={gguf}", "prompt=hi", "decoding.max_new_tokens=4",
               "model.threads=1", "stream=false", "decoding.draft_calibration=false"]
    bad = subprocess.run(env_cmd + ["model.chat_template=missing.jinja"], capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert bad.returncode != 0 and "model.chat_template names no file" in bad.stderr + bad.stdout
    good = subprocess.run(env_cmd + [f"model.chat_template={file}", "log_steps=true"], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert good.returncode == 0, good.stderr[-2000:]
    # the template is the one that runs: one that raises stops the run with its message
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('the override ran') }}")
    ran = subprocess.run(env_cmd + [f"model.chat_template={raising}"], capture_output=True, text=True, timeout=300,
                         cwd=root)
    assert ran.returncode != 0 and "the override ran" in ran.stderr + ran.stdout


def test_a_file_without_a_chat_template_gets_llama_servers_chatml(tokenizer, tmp_path, monkeypatch, caplog):
    """A GGUF file that holds no chat template (a base model's, as Gemma-3-270M's) is given ChatML,
    the template llama-server falls back to, with a warning naming the file and the override; the
    metadata a first load keeps does not keep it (a restart, reading that metadata, warns again).
    model.chat_template replacing it: test_chat_template_override."""
    import logging

    from lp.model.gguf import CHATML, metadata_dir
    from lp.model.loader import default_cache_dir, load_model, load_tokenizer

    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    fields = [f for f in tokenizer if f[0] != "tokenizer.chat_template"]
    file = write_tiny_gguf(tmp_path / "base.gguf", "llama", Q4_K_M, fields, seed=3, tie=False)
    for start in ("first", "restart"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lp.model.gguf"):
            tok = load_model(file, "auto", quant="none")[1] if start == "first" else load_tokenizer(file)
        if start == "first":  # the load kept the file's metadata, its tokenizer among it: the restart reads that
            assert (metadata_dir(file, default_cache_dir()) / "tokenizer_config.json").is_file()
        assert tok.chat_template == CHATML, start
        assert any("base.gguf holds no chat template" in r.getMessage() and "model.chat_template" in r.getMessage()
                   for r in caplog.records), start
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    own = load_tokenizer(write_tiny_gguf(tmp_path / "own.gguf", "llama", Q4_K_M, tokenizer, seed=3, tie=False))
    assert own.chat_template and own.chat_template != CHATML


def test_file_blocks_are_unpacked_one_group_at_a_time(tokenizer, tmp_path, monkeypatch):
    """The load stages each kept tensor as the file's bytes (lp.kernels.exact4.Staged) and unpacks it
    only when a kernel's maker reads it; a linear replaced by a kernel drops its codes at once, so a
    whole model's unpacked codes (about a byte a weight) never sit beside its packed ones."""
    from lp.kernels import exact4, idot
    from lp.model import gguf as lp_gguf
    from lp.model.loader import load_model

    if not (exact4.extension().avx512() or idot.available()):
        pytest.skip("no exact kernel runs the file's blocks on this CPU")
    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    file = write_tiny_gguf(tmp_path / "qwen2-Q4_K_M.gguf", "qwen2", Q4_K_M, tokenizer, seed=3)
    staged, made = [], []
    read = lp_gguf._read_tensors

    def read_and_look(file, model, info, keep, ends):
        out = read(file, model, info, keep, ends)
        for m in model.modules():
            for name in exact4.STAGED:
                value = m.__dict__.get(name)
                if value is not None:
                    assert isinstance(value, exact4.Staged) and value.value is None, name  # nothing unpacked yet
                    staged.append(m)
        return out

    consuming = exact4._consuming

    def watched(make):
        inner = consuming(make)

        def made_one(linears):
            module = inner(linears)
            if module is not None:  # the replaced linears hold no codes any more
                assert not any(name in lin.__dict__ for lin in linears for name in exact4.STAGED)
                unpacked = [m for m in staged if m not in linears and any(
                    isinstance(v, exact4.Staged) and v.value is not None for v in (m.__dict__.get(n) for n in exact4.STAGED))]
                made.append(len(unpacked))
            return module

        return made_one

    monkeypatch.setattr(lp_gguf, "_read_tensors", read_and_look)
    monkeypatch.setattr(exact4, "_consuming", watched)
    model, _ = load_model(file, "auto", quant="auto", tokenizer=False)
    assert staged and made and model._lp_quant == "exact4"
    # when a kernel is made, no other linear holds unpacked codes (a declined group released them)
    assert max(made) == 0, made
    assert not any(name in m.__dict__ for m in model.modules() for name in exact4.STAGED)


def test_a_first_read_parses_the_file_once(tokenizer, tmp_path, monkeypatch):
    """A file's first load reads its config and its tokenizer, and transformers parses the whole file
    (every vocabulary string) for each; lp.model.gguf runs that parse once and puts transformers'
    function back afterwards. The second load reads the kept metadata: no parse."""
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    from lp.model.loader import load_model

    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    file = write_tiny_gguf(tmp_path / "llama-Q8_0.gguf", "llama", _kinds("Q8_0"), tokenizer, seed=5)
    real, calls = hf_gguf.load_gguf_checkpoint, []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", counted)
    _, tok = load_model(file, "auto", quant="none")
    assert len(calls) == 1, calls
    assert hf_gguf.load_gguf_checkpoint is counted  # transformers' function (here the counter) back in place
    _, again = load_model(file, "auto", quant="none")
    assert len(calls) == 1 and again("a b c")["input_ids"] == tok("a b c")["input_ids"]


def test_phi3_layers_outside_the_cpp_stack_say_why(tokenizer, tmp_path, monkeypatch):
    """Phi-3 layers run as lp's C++ layers (fused q/k/v and gate/up, the test above) only without a
    sliding window and with a full rotary: the C++ stack has neither. Otherwise lp's layer loop, and
    the reason names the field."""
    from lp.kernels import exact4, fused, idot
    from lp.model.loader import load_model

    if not (exact4.extension().avx512() or idot.available()):
        pytest.skip("lp's exact kernels: AVX-512, or idot's AVX2 form")
    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))
    file = write_tiny_gguf(tmp_path / "phi3.gguf", "phi3", Q4_K_M, tokenizer, seed=4)
    model, _ = load_model(file, "auto", quant="auto", tokenizer=False)
    layers, why = fused._plan(model)
    assert layers and why == ""
    model.config.sliding_window = 8
    layers, why = fused._plan(model)
    assert not layers and "config.sliding_window" in why
    assert isinstance(fused.build(model)[0], fused.LayerLoop)
    model.config.sliding_window = None
    model.config.rope_parameters = {**model.config.rope_parameters, "partial_rotary_factor": 0.75}
    layers, why = fused._plan(model)
    assert not layers and "partial_rotary_factor 0.75" in why
