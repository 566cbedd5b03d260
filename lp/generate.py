"""CLI: ``python -m lp.generate [overrides]``, or ``torchrun --nproc-per-node K -m lp.generate``.

Contract: the Hydra main is thin: it turns the composed config into
``lp.config.GenerateConfig`` and calls ``run``, which tests call directly. Under
torchrun only rank 0 prints, streams and writes ``output=``; the other ranks
run with Hydra's output and logging off, so one run dir is written.

    python -m lp.generate prompt="Write a haiku about caches" decoding.W=7 decoding.G=7
    python -m lp.generate decoding.mode=ar            # lp's own step, one token per step (no drafts)
    python -m lp.generate decoding.mode=hf            # plain transformers generate (the reference)
    python launch/lp_run.py parallel.workers=2 ...    # LP on 2 workers (torchrun)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from lp import cli
from lp.config import DecodingConfig, GenerateConfig, chat_template_text
from lp.parallel.dist import WorkerFailure, init_worker_group, torchrun_env, worker_device

DEFAULT_PROMPT = "Explain in three short paragraphs what a hash table is and when to use one."


def build_prompt_ids(tokenizer, cfg: GenerateConfig) -> list[int]:
    if cfg.prompt_file:
        p = Path(cfg.prompt_file)
        if not p.is_file():
            raise ValueError(f"prompt_file must be a readable file, got {cfg.prompt_file!r}")
        text = p.read_text()
    else:
        text = cfg.prompt if cfg.prompt is not None else DEFAULT_PROMPT
    if not text or not text.strip():
        raise ValueError("prompt must be a non-empty string (set prompt=... or prompt_file=PATH)")
    if not cfg.raw_prompt and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text)["input_ids"]


def eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    for e in [gen_eos, tokenizer.eos_token_id]:
        if e is None:
            continue
        for t in e if isinstance(e, (list, tuple)) else [e]:
            if t not in ids:
                ids.append(int(t))
    return ids


def _shape(dcfg: DecodingConfig) -> str:
    """What decoded, as the summary line names it."""
    if dcfg.mode != "lookahead":
        return dcfg.mode
    window = "off" if dcfg.window_policy == "off" else f"W={dcfg.W} N={dcfg.N} ({dcfg.window_policy})"
    return f"lookahead drafts={dcfg.drafts} G={dcfg.G} window {window}"


def _quant_note(quant: str) -> str:
    """The summary line names a quantized model loudly: outputs equal generate on *it*, not fp32."""
    if quant == "none":
        return ""
    if quant == "exact4":  # the checkpoint's own weights, another kernel: not a quantization
        return (" EXACT4 (the file's or checkpoint's weights on lp's exact block kernels, bit for bit; exact vs "
                "generate on the float32 weights they stand for)")
    exact = "exact" if quant == "int8" else "exact up to bf16 near-ties"  # int4 runs bf16 activations
    return f" QUANT={quant.upper()} ({exact} vs generate on the {quant} model)"


def run(cfg: GenerateConfig) -> dict | None:
    """Load the model, decode one prompt, report. Returns the result dict on rank 0. Stages: the
    prompt and the memory plan (``_prepare``), the weights, the decode (``_decode``), the report."""
    from lp.parallel.cpus import pin_worker
    from lp.parallel.tp import load_for

    cfg.validate()
    rank, world, _ = torchrun_env()
    if cfg.decoding.mode in ("ar", "hf") and world > 1:
        raise ValueError(f"decoding.mode={cfg.decoding.mode} runs in one process; launch it without torchrun")
    pin_worker(cfg.model.cpus, cfg.model.threads)  # before the first parallel region: OpenMP inherits it
    device = worker_device(cfg.model.device)
    group = init_worker_group(cfg.parallel, device)
    lead = rank == 0
    try:
        path, tokenizer, prompt_ids = _prepare(cfg, device, lead)
        # the whole replica, or under parallel.tp > 1 only this rank's shards of it
        model, _ = load_for(path, cfg.model.dtype, str(device), cfg.model.quant, group, tokenizer=False)
        ids, stats, dcfg = _decode(cfg, model, tokenizer, prompt_ids, group, lead)
    except WorkerFailure as e:
        print(f"[lp] rank {rank}: {e}; stopping this worker", file=sys.stderr, flush=True)
        os._exit(3)
    if group is not None:
        group.close()
    if not lead:
        return None
    result = {
        "prompt_ids": prompt_ids,
        "output_ids": ids,
        "text": tokenizer.decode(ids, skip_special_tokens=True),
        **stats,
        "mode": dcfg.mode,
        "W": dcfg.W,
        "N": dcfg.N,
        "G": dcfg.G,
        "window_policy": dcfg.window_policy,
        "prompt_pool": dcfg.prompt_pool,
        "workers": world // cfg.parallel.tp,  # LP workers
        "tp": cfg.parallel.tp,
        "dtype": str(model.dtype).replace("torch.", ""),
        "quant": getattr(model, "_lp_quant", None) or "none",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "model": str(path),
    }
    _report(cfg, dcfg, result)
    return result


def _prepare(cfg: GenerateConfig, device, lead: bool):
    """(model path, tokenizer, prompt ids): the path checked against parallel.tp and the memory this
    rank will hold printed (on the lead) and checked, all before any weights load."""
    from lp.model.loader import load_tokenizer, resolve_dtype, resolve_model_path
    from lp.parallel.memory import decode_rows, plan_memory
    from lp.parallel.tp import check_tp_path

    path = resolve_model_path(cfg.model.name, cfg.model.path, cfg.model.cache_dir)
    check_tp_path(path, cfg.parallel.tp, cfg.model.quant)  # heads vs parallel.tp, before any weights load
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"lp.generate needs a tokenizer in the model folder {path}")
    if cfg.model.chat_template is not None:  # the model's own replaced (model.chat_template)
        tokenizer.chat_template = chat_template_text(cfg.model.chat_template)
    prompt_ids = build_prompt_ids(tokenizer, cfg)
    plan = plan_memory(path, resolve_dtype(cfg.model.dtype, device), device, cfg.parallel.tp,
                       max_len=len(prompt_ids) + cfg.decoding.max_new_tokens + decode_rows(cfg.decoding),
                       step_rows=max(len(prompt_ids), decode_rows(cfg.decoding)),
                       cuda_graphs=cfg.model.cuda_graphs, quant=cfg.model.quant)
    if lead:
        print("\n".join("[lp] " + line for line in plan.lines()), file=sys.stderr, flush=True)
    plan.check()
    return path, tokenizer, prompt_ids


def _decode(cfg: GenerateConfig, model, tokenizer, prompt_ids: list[int], group, lead: bool):
    """(output ids, stats, the decoding config as resolved) for one prompt: transformers' generate
    (decoding.mode=hf) or lp's runner with lookahead or one-token (ar) steps."""
    from transformers import TextStreamer

    from lp.engine.decoder import LookaheadDecoder
    from lp.model.runner import ModelRunner

    eos = eos_ids(model, tokenizer)
    streamer = TextStreamer(tokenizer, skip_prompt=True) if (lead and cfg.stream) else None
    dcfg = cfg.decoding
    if dcfg.mode == "hf":
        ids, stats = _run_hf(model, tokenizer, prompt_ids, dcfg, eos, streamer)
        return ids, stats, dcfg
    on_step = _step_logger() if (lead and cfg.log_steps) else None
    runner = ModelRunner(model, cfg.model.attention, cfg.model.cuda_graphs, small_rows=cfg.model.small_rows,
                         linears=cfg.model.linears, compile=cfg.model.compile, fused=cfg.model.fused,
                         head=cfg.model.head)
    decoder = LookaheadDecoder(runner, dcfg, group)
    res = decoder.generate(prompt_ids, eos, streamer=streamer, tokenizer=tokenizer, on_step=on_step)
    stats = res.stats.summary()
    if res.logprobs is not None:
        stats["logprobs"] = [{"token": t.token, "logprob": t.logprob, "top": [list(x) for x in t.top]}
                             for t in res.logprobs]
    return res.output_ids, stats, decoder.cfg  # W/N/G resolved for the hardware (mode=ar: one-token steps)


def _report(cfg: GenerateConfig, dcfg: DecodingConfig, result: dict) -> None:
    """The summary line(s) on stdout and, with ``output=``, the result as JSON."""
    print(
        f"\n[lp] {_shape(dcfg)} workers={result['workers']} tp={cfg.parallel.tp} dtype={result['dtype']}"
        f"{_quant_note(result['quant'])}: "
        f"{result['new_tokens']} tokens in {result['steps']} steps (S={result['compression_ratio']:.2f}), "
        f"{result['decode_time_s']:.2f} s, {result['tokens_per_second']:.1f} tok/s",
        flush=True,
    )
    if dcfg.mode != "hf":
        print(
            f"[lp] forward {result['forward_time_s']:.2f} s, exchange {result['exchange_time_s']:.3f} s, "
            f"host {result['host_time_s']:.3f} s, rows/step per rank {result['mean_rows_per_rank']}, "
            f"accepted-length histogram {result['accept_hist']}",
            flush=True,
        )
    if cfg.output:
        Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output).write_text(json.dumps(result) + "\n")


def _run_hf(model, tokenizer, prompt_ids, dcfg: DecodingConfig, eos, streamer):
    from lp.model.hf_generate import generate_kwargs

    if dcfg.logprobs:
        raise ValueError("decoding.logprobs is reported by lp's own steps (decoding.mode=lookahead or ar), not by hf")
    kwargs = dict(max_new_tokens=dcfg.max_new_tokens, do_sample=dcfg.do_sample, eos_token_id=eos,
                  **generate_kwargs(dcfg, len(prompt_ids)))
    if dcfg.do_sample:
        torch.manual_seed(dcfg.seed)
        kwargs.update(temperature=dcfg.temperature, top_k=dcfg.top_k or None, top_p=dcfg.top_p)
    if dcfg.stop_strings:
        kwargs.update(stop_strings=list(dcfg.stop_strings), tokenizer=tokenizer)
    from lp.grammar.matcher import GenerateGrammarProcessor, grammar_of

    grammar = grammar_of(dcfg)
    if grammar is not None:  # decoding.json_schema / grammar: the same llguidance mask as lookahead's
        from transformers import LogitsProcessorList

        procs = kwargs.pop("logits_processor", None) or LogitsProcessorList()
        procs.append(GenerateGrammarProcessor(grammar, tokenizer, model.config.vocab_size, len(prompt_ids), eos))
        kwargs["logits_processor"] = procs
    input_ids = torch.tensor([prompt_ids], device=model.device)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **kwargs)
    dt = time.perf_counter() - t
    ids = out[0, len(prompt_ids) :].tolist()
    n = len(ids)
    return ids, {
        "steps": n,
        "new_tokens": n,
        "compression_ratio": 1.0,
        "decode_time_s": round(dt, 4),
        "tokens_per_second": round(n / dt, 3) if dt > 0 else 0.0,
    }


def _step_logger():
    def log(step, rec):
        print(
            f"[lp] step {step}: +{rec.emitted} tokens, rows/rank {rec.rows_per_rank}, "
            f"forward {rec.forward_s * 1e3:.1f} ms, exchange {rec.exchange_s * 1e3:.2f} ms, "
            f"host {rec.host_s * 1e3:.2f} ms",
            file=sys.stderr,
            flush=True,
        )

    return log


# ---------------------------------------------------------------------------
# Hydra entry point


SCHEMAS = {(None, "generate_schema"): GenerateConfig, **cli.RUNTIME_SCHEMAS}


def main() -> None:
    cli.hydra_main("generate", SCHEMAS, run, cli.repo_conf_dir())


if __name__ == "__main__":
    main()
