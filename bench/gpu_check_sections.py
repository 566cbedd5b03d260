"""The sections of bench/gpu_check.py, one function each: ``section(sizes, out) -> dict``.

Contract: each runs in its own process (bench.gpu_check.run_child), on ``sizes.device`` ("cuda"
on the GPU, "cpu" in the rehearsal) at ``sizes``' scale, and returns JSON-able data; ``"ok":
False`` in it marks the section failed (an exactness mismatch, a missing import), an exception
marks it errored. On the GPU the model is SmolLM2 converted by the ``model`` section from the
kit's GGUF (a random SmolLM2-shaped Llama when the model was not carried: exactness still holds
against ``generate`` on the same weights); in the rehearsal a tiny random Llama, and lp.serve a
tiny model with SmolLM2's tokenizer. Exactness claims are fp32 (bf16 is reported, not judged).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import threading
import time
from pathlib import Path

import torch

from bench.envelope import progress

ROOT = Path(__file__).resolve().parent.parent
STAGE = Path(os.environ.get("LP_KIT_STAGE", ROOT / ".gpu_kit_stage"))
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _smollm2_dir() -> Path | None:
    from lp.model.loader import default_cache_dir

    target = default_cache_dir() / "smollm2-135m-instruct"
    return target if (target / "config.json").exists() and (target / "model.safetensors").exists() else None


def _load(sizes, dtype: str):
    """(model, tokenizer or None, what it is)."""
    if sizes.device == "cpu":
        from tests.helpers import make_tiny_model

        return make_tiny_model("llama", "sdpa").to(getattr(torch, dtype)), None, "tiny random llama (rehearsal)"
    from lp.model.loader import load_model

    path = _smollm2_dir()
    if path is not None:
        model, tok = load_model(path, dtype, "cuda")
        return model, tok, "smollm2"
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, initializer_range=0.05)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model.to("cuda").eval()
    model.generation_config.eos_token_id = None
    return model, None, "random SmolLM2-shaped Llama (the model was not carried: run the model section first)"


def _texts(k: int) -> list[str]:
    data = json.loads((ROOT / "tests" / "data" / "prompts.json").read_text())
    texts = data["mt_bench"] + data["gsm8k"]
    return [texts[i % len(texts)] for i in range(k)]


def _prompts(model, tok, k: int) -> list[list[int]]:
    if tok is not None:
        return [tok(t)["input_ids"] for t in _texts(k)]
    g = torch.Generator().manual_seed(0)
    n = 120 if model.device.type == "cuda" else 24
    return [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for _ in range(k)]


def _eos(tok):
    return [tok.eos_token_id] if tok is not None else None


def _generate(model, ids, n, eos):
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             eos_token_id=eos)
    return out[0, len(ids):].tolist()


def all_equal(rows: list[dict]) -> bool | None:
    """True when every run finished equal; None when there was no run ("not run", never a vacuous
    True); False when one differed or raised."""
    return all(r.get("equal") is True for r in rows) if rows else None


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def env(sizes, out) -> dict:
    import transformers

    imports = {}
    for mod in ("lp", "lp.serve", "lp.grammar", "hydra", "omegaconf", "antlr4", "llguidance", "gguf", "fastapi",
                "uvicorn", "jsonschema", "pydantic"):
        try:
            m = importlib.import_module(mod)
            imports[mod] = getattr(m, "__version__", "ok")
        except Exception as e:
            imports[mod] = f"FAILED {type(e).__name__}: {e}"
    data = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "flash_attn": importlib.util.find_spec("flash_attn") is not None, "imports": imports,
            "ok": not any(str(v).startswith("FAILED") for v in imports.values())}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        data.update(gpu=p.name, gpus=torch.cuda.device_count(), memory_GiB=round(p.total_memory / 2**30, 1),
                    capability=list(torch.cuda.get_device_capability(0)))
    return data


def model(sizes, out) -> dict:
    """The kit's GGUF (joined and hash-checked by bench.gpu_kit assemble), read by gguf; on the
    GPU converted once into lp's cache (what model=smollm2 then loads) and one greedy line."""
    import gguf

    from bench.gpu_kit import GGUF, sha256

    src = STAGE / "model" / GGUF
    if not src.exists():
        raise ValueError(f"{src} is missing: the model's loads were not carried yet (bench.gpu_kit assemble)")
    manifest = json.loads((STAGE / "manifest.json").read_text())
    reader = gguf.GGUFReader(src)
    data = {"gguf": str(src), "sha256_ok": sha256(src) == manifest["model"]["sha256"], "tensors": len(reader.tensors)}
    data["ok"] = data["sha256_ok"]
    if sizes.device == "cpu":
        data["converted"] = "not in the rehearsal (the conversion takes minutes on 2 busy cores)"
        return data
    from lp.model.loader import convert_gguf, default_cache_dir, load_model

    t = time.perf_counter()
    if _smollm2_dir() is None:
        convert_gguf(src.parent, GGUF, default_cache_dir() / "smollm2-135m-instruct")
    data["convert_s"] = round(time.perf_counter() - t, 1)
    m, tok = load_model(_smollm2_dir(), "bfloat16", "cuda")
    ids = tok("The capital of France is")["input_ids"]
    data["greedy"] = tok.decode(_generate(m, ids, 16, _eos(tok)))
    return data


def exact(sizes, out) -> dict:
    from lp import DecodingConfig, LookaheadDecoder, ModelRunner

    kernels = ["sdpa", "flex"] + (["flash"] if sizes.device == "cuda" and importlib.util.find_spec("flash_attn") else [])
    rows, name = [], None
    for dtype in ("float32", "bfloat16"):
        m, tok, name = _load(sizes, dtype)
        eos, prompts = _eos(tok), _prompts(m, tok, sizes.prompts)
        refs = [_generate(m, ids, sizes.tokens, eos) for ids in prompts]
        for attention in kernels:
            runner = ModelRunner(m, attention=attention)
            for W, N, G in [(15, 5, 15), (5, 4, 5)]:
                dec = LookaheadDecoder(runner, DecodingConfig(W=W, N=N, G=G, max_new_tokens=sizes.tokens))
                for i, (ids, ref) in enumerate(zip(prompts, refs)):
                    row = {"dtype": dtype, "attention": attention, "W": W, "N": N, "G": G, "prompt": i}
                    try:
                        got = dec.generate(ids, eos).output_ids
                    except Exception as e:
                        rows.append({**row, "error": f"{type(e).__name__}: {e}"})
                        continue
                    d = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), None)
                    gap = None
                    if d is not None:
                        with torch.inference_mode():
                            top = torch.topk(m(input_ids=torch.tensor([ids + ref[:d]], device=m.device)).logits[0, -1]
                                             .float(), 2).values
                        gap = round((top[0] - top[1]).item(), 5)
                    rows.append({**row, "equal": got == ref, "first_divergence": d, "top2_gap_there": gap})
            progress(out, "exact", {"model": name, "kernels": kernels, "rows": rows})
        del m
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    fp32_all_equal = all_equal(fp32)
    return {"model": name, "kernels": kernels, "fp32_runs": len(fp32), "fp32_all_equal": fp32_all_equal,
            "ok": fp32_all_equal is True, "rows": rows}


def tq(sizes, out) -> dict:
    from bench.scaling import measure_tq

    m, _, name = _load(sizes, "bfloat16" if sizes.device == "cuda" else "float32")
    t = measure_tq(m, list(sizes.qs), repeats=sizes.repeats)
    return {"model": name, "cache_len": 200, "t_ms": {q: round(s * 1e3, 3) for q, s in t.items()}}


def lookahead(sizes, out) -> dict:
    from lp import DecodingConfig, LookaheadDecoder, ModelRunner

    m, tok, name = _load(sizes, "bfloat16" if sizes.device == "cuda" else "float32")
    eos, prompts = _eos(tok), _prompts(m, tok, sizes.long_prompts)
    runner = ModelRunner(m)  # auto kernel: flash when flash-attn is here, else flex (CUDA)
    dec = LookaheadDecoder(runner, DecodingConfig(W=15, N=5, G=15, max_new_tokens=sizes.long_tokens))
    _generate(m, prompts[0], 4, eos)
    dec.generate(prompts[0][:16], eos)  # warm-up (flex compiles here)
    rows = []
    for ids in prompts:
        _sync(m.device)
        t = time.perf_counter()
        ref = _generate(m, ids, sizes.long_tokens, eos)
        _sync(m.device)
        t_ar = time.perf_counter() - t
        t = time.perf_counter()
        res = dec.generate(ids, eos)
        _sync(m.device)
        t_la = time.perf_counter() - t
        rows.append({"tokens": len(ref), "lookahead_tokens": len(res.output_ids), "generate_s": round(t_ar, 4),
                     "lookahead_s": round(t_la, 4), "S": round(res.stats.compression_ratio, 3),
                     "equal": res.output_ids == ref})
        progress(out, "lookahead", {"model": name, "attention": runner.attention, "rows": rows})
    tot_ar, tot_la = sum(r["generate_s"] for r in rows), sum(r["lookahead_s"] for r in rows)
    return {"model": name, "attention": runner.attention, "speedup": round(tot_ar / tot_la, 3),
            "generate_tok_s": round(sum(r["tokens"] for r in rows) / tot_ar, 2),
            "lookahead_tok_s": round(sum(r["lookahead_tokens"] for r in rows) / tot_la, 2),
            "all_equal": all_equal(rows), "rows": rows}


def batch(sizes, out) -> dict:
    """The batched engine as lp.serve builds it (model.attention=auto), fp32, 8 prompts at once."""
    from lp import DecodingConfig, ModelRunner
    from lp.engine.batch import BatchEngine

    m, tok, name = _load(sizes, "float32")
    eos, prompts = _eos(tok), _prompts(m, tok, 8)
    refs = [_generate(m, ids, sizes.tokens, eos) for ids in prompts]
    runner = ModelRunner(m)
    resolved = runner.attention
    engine = BatchEngine(runner, kv_tokens=8 * 512, block_size=16, max_batch=8)
    cfg = DecodingConfig(max_new_tokens=sizes.tokens)
    ids = [engine.add(p, cfg, eos) for p in prompts]
    outs: dict = {}
    t, steps = time.perf_counter(), 0
    while engine.has_work and steps < 20 * sizes.tokens:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_tokens)
        steps += 1
    _sync(m.device)
    wall = time.perf_counter() - t
    equal = [outs.get(i) == ref for i, ref in zip(ids, refs)]
    return {"model": name, "runner_attention": resolved, "batch_attention": runner.attention, "steps": steps,
            "tokens_per_s": round(sum(len(v) for v in outs.values()) / wall, 2), "equal": equal, "ok": all(equal)}


def _serve_model(sizes, out) -> Path:
    if sizes.device == "cuda":
        path = _smollm2_dir()
        if path is None:
            raise ValueError("lp.serve needs SmolLM2 (its tokenizer): the model section converts it from the kit")
        return path
    import shutil

    from lp.model.loader import resolve_model_path
    from tests.helpers import make_tiny_model

    src, path = resolve_model_path("smollm2", None), out / "tiny_serve"
    make_tiny_model("llama", "sdpa", vocab=49152).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / f).exists():
            shutil.copy(src / f, path / f)
    return path


def serve(sizes, out) -> dict:
    """lp.serve (model.attention=auto, fp32) and ``sizes.clients`` concurrent /v1/completions at
    temperature 0, each text == the one-process greedy lookahead's for its prompt."""
    import httpx

    from bench.serve_load import ServerProcess
    from lp import DecodingConfig, LookaheadDecoder, ModelRunner
    from lp.config import GenerateConfig
    from lp.generate import build_prompt_ids, eos_ids
    from lp.model.loader import load_model

    path = _serve_model(sizes, out)
    m, tok = load_model(path, "float32", sizes.device)
    texts, n = _texts(sizes.clients), sizes.serve_tokens
    dec = LookaheadDecoder(ModelRunner(m), DecodingConfig(max_new_tokens=n))
    refs = [tok.decode(dec.generate(build_prompt_ids(tok, GenerateConfig(prompt=p, raw_prompt=True)),
                                    eos_ids(m, tok)).output_ids, skip_special_tokens=True) for p in texts]
    del m, dec
    server = ServerProcess(threads=4 if sizes.device == "cuda" else 1, log_path=out / "serve_server.log",
                           overrides=[f"model.path={path}", f"model.device={sizes.device}", "server.max_batch=8"],
                           start_timeout_s=45 if sizes.device == "cuda" else 150)
    got: dict = {}
    try:
        def client(i):
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": texts[i], "max_tokens": n, "temperature": 0})
            got[i] = r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}: {r.text}"

        t = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(texts))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t
    finally:
        server.stop()
    equal = [got.get(i) == ref for i, ref in enumerate(refs)]
    return {"model": str(path), "clients": len(texts), "wall_s": round(wall, 3), "equal": equal, "ok": all(equal),
            "texts": [got.get(i) for i in range(len(texts))]}


def graphs(sizes, out) -> dict:
    """CUDA graphs (each row bucket captured once, replayed) == eager, fp32; on the CPU the same
    static-shape path uncaptured."""
    from lp import DecodingConfig, LookaheadDecoder, ModelRunner

    m, tok, name = _load(sizes, "float32")
    eos, prompts = _eos(tok), _prompts(m, tok, 2)
    refs = [_generate(m, ids, sizes.tokens, eos) for ids in prompts]
    cuda = sizes.device == "cuda"
    runner = ModelRunner(m, attention="auto", cuda_graphs=cuda, static_shapes=not cuda)
    dec = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=sizes.tokens))
    rows = []
    for ids, ref in zip(prompts, refs):
        t = time.perf_counter()
        got = dec.generate(ids, eos).output_ids
        _sync(m.device)
        rows.append({"equal": got == ref, "seconds": round(time.perf_counter() - t, 3)})
    return {"model": name, "captured": cuda, "rows": rows, "ok": all(r["equal"] for r in rows)}


def sampling(sizes, out) -> dict:
    """Sampled lookahead (temperature 0.8, a fixed seed) twice: the same output both times."""
    from lp import DecodingConfig, LookaheadDecoder, ModelRunner

    m, tok, name = _load(sizes, "float32")
    eos, ids = _eos(tok), _prompts(m, tok, 1)[0]
    dec = LookaheadDecoder(ModelRunner(m), DecodingConfig(do_sample=True, temperature=0.8, seed=1234,
                                                         max_new_tokens=sizes.tokens))
    a, b = dec.generate(ids, eos), dec.generate(ids, eos)
    return {"model": name, "tokens": len(a.output_ids), "S": round(a.stats.compression_ratio, 3),
            "reproduced": a.output_ids == b.output_ids, "ok": a.output_ids == b.output_ids}


def profile(sizes, out) -> dict:
    """One generation under torch.profiler: per step, kernel launches and host syncs (CUDA), aten ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from lp import DecodingConfig, LookaheadDecoder, ModelRunner

    m, tok, name = _load(sizes, "bfloat16" if sizes.device == "cuda" else "float32")
    eos, ids = _eos(tok), _prompts(m, tok, 1)[0]
    runner = ModelRunner(m)
    dec = LookaheadDecoder(runner, DecodingConfig(max_new_tokens=16))
    dec.generate(ids, eos)  # warm-up
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if sizes.device == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        res = dec.generate(ids, eos)
        _sync(m.device)
    names = [e.name for e in prof.events()]
    steps = max(res.stats.steps, 1)
    return {"model": name, "attention": runner.attention, "steps": res.stats.steps,
            "launches_per_step": round(sum(n in LAUNCHES for n in names) / steps, 1),
            "syncs_per_step": round(sum(n in SYNCS for n in names) / steps, 1),
            "memcpy_per_step": round(sum(n.startswith("cudaMemcpy") for n in names) / steps, 1),
            "aten_ops_per_step": round(sum(n.startswith("aten::") for n in names) / steps, 1)}


def compile(sizes, out) -> dict:  # noqa: A001 (the section's name)
    """model.compile=on == generate, fp32; the first generation's seconds (compiles) and the next."""
    from lp import DecodingConfig, LookaheadDecoder, ModelRunner

    m, tok, name = _load(sizes, "float32")
    eos, ids = _eos(tok), _prompts(m, tok, 1)[0]
    ref = _generate(m, ids, sizes.tokens, eos)
    dec = LookaheadDecoder(ModelRunner(m, compile="on"), DecodingConfig(max_new_tokens=sizes.tokens))
    times, outs = [], []
    for _ in range(2):
        t = time.perf_counter()
        outs.append(dec.generate(ids, eos).output_ids)
        _sync(m.device)
        times.append(round(time.perf_counter() - t, 2))
    return {"model": name, "seconds": times, "equal": [o == ref for o in outs], "ok": all(o == ref for o in outs)}
