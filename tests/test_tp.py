"""Lookahead Parallelism over tensor-parallel groups: the (lp, tp) mesh on gloo CPU workers.

Checks: bad meshes (workers x tp != world, tp not dividing the heads) are ValueErrors naming
the field and the fix; a tiny random Llama (4 heads, 2 KV heads) on LP 2 x TP 2 (4 processes)
gives exactly the one-process greedy output and transformers ``generate``, with the paper's
window (explicit W/N/G) and with tree drafts (every node, and the budget on the t(Q) curve
measured on the mesh), and samples the same tokens as one process for the same seed, every
process's pool/window/output fingerprint equal at every step (tp ranks included); real
SmolLM2 weights (9 heads, 3 KV heads) on LP 1 x TP 3 with model.quant=auto (exact4 shards) equal
``generate`` on held prompts; int8 and auto (exact4) shards on TP 2 equal the same quantized model
in one process (tokens, prompt logits to rounding) and int8's memory plan the bytes held; the
compiled step (model.compile=on) on TP 2 equals one process; int4 is refused under TP;
two launches of launch/lp_run.py joined on localhost run LP 2 x TP 2; lp.serve on LP 2 x TP 2
answers the real openai client with the greedy text; a killed rank ends every rank within
parallel.timeout_s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from lp.config import ParallelConfig
from lp.parallel.dist import mesh_shape
from lp.parallel.tp import check_tp
from tests.helpers import REPETITIVE_PROMPT, hf_greedy, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "lp_worker.py"
sys.path.insert(0, str(ROOT / "launch"))

import lp_run  # noqa: E402


# ---------------------------------------------------------------------------
# configuration errors (no processes)


def test_bad_mesh_is_a_clear_error():
    assert mesh_shape(ParallelConfig(workers=2, tp=2), 4) == (2, 2)
    assert mesh_shape(ParallelConfig(tp=2), 8) == (4, 2)
    with pytest.raises(ValueError, match=r"parallel.workers=3 x parallel.tp=2 = 6 processes .*WORLD_SIZE=4.*"
                                         r"parallel.workers=2"):
        mesh_shape(ParallelConfig(workers=3, tp=2), 4)
    with pytest.raises(ValueError, match=r"parallel.tp=3 does not divide WORLD_SIZE=4"):
        mesh_shape(ParallelConfig(tp=3), 4)
    with pytest.raises(ValueError, match=r"parallel.tp must be an integer >= 1"):
        ParallelConfig(tp=0).validate()


def test_cli_composes_parallel_tp_and_refuses_a_one_process_mesh():
    from hydra import compose, initialize_config_dir

    from lp import cli
    from lp.generate import SCHEMAS, run

    cli.register(SCHEMAS)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = cli.to_config(compose("generate", overrides=["parallel.tp=2", "parallel.workers=2"]))
    assert (cfg.parallel.tp, cfg.parallel.workers) == (2, 2)
    with pytest.raises(ValueError, match=r"parallel.workers=2 x parallel.tp=2 = 4 processes .*WORLD_SIZE=1"):
        run(cfg)  # before any model loads


def test_int4_with_tp_is_refused_before_loading(tmp_path):
    from lp.parallel.tp import check_tp_path

    make_tiny_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model.quant=int4 cannot be combined with parallel.tp=2 .*use "
                                         r"model.quant=int8, exact4, auto or none"):
        check_tp_path(tmp_path, 2, "int4")
    for quant in ("none", "auto", "int8", "exact4"):  # each rank quantizes its shards (test_tp2_quantized_...)
        check_tp_path(tmp_path, 2, quant)
    check_tp_path(tmp_path, 1, "int4")


def test_torchao_schemes_on_shards_are_refused():
    """int4 (and CUDA int8: torchao's) would scale a row-parallel shard over its slice of K only."""
    from lp.parallel.tp import quantize_shards

    class Mesh:
        def size(self):
            return 2

    for quant, device in (("int4", "cpu"), ("int8", "cuda")):
        with pytest.raises(ValueError, match=rf"model.quant={quant} on {device} cannot be combined with "
                                             r"parallel.tp=2 .*slice of K"):
            quantize_shards(None, quant, torch.device(device), Mesh())


def test_tp_must_divide_the_heads():
    from transformers import LlamaConfig

    smollm2 = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    check_tp(smollm2, 1)
    check_tp(smollm2, 3)
    with pytest.raises(ValueError, match=r"parallel.tp=2 does not divide .*num_attention_heads=9, "
                                         r"num_key_value_heads=3.*parallel.tp in \[1, 3\]"):
        check_tp(smollm2, 2)


def test_launcher_counts_processes_as_workers_times_tp():
    cmd, _ = lp_run.build_command(["parallel.workers=2", "parallel.tp=2"])
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
    cmd, _ = lp_run.build_command(["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1",
                                   "parallel.workers=2", "parallel.tp=2"])
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    with pytest.raises(SystemExit, match="multiple of --nnodes"):
        lp_run.build_command(["--nnodes", "2", "--rdzv-endpoint", "h:1", "parallel.workers=1", "parallel.tp=3"])


def test_bench_plans_every_split_the_heads_allow():
    from bench.config import BenchConfig
    from bench.run import plan_jobs

    cfg = BenchConfig(methods=["ar", "lp", "lp_tp", "tp", "pp"], workers=[1, 2, 4], tp_engines=["manual"],
                      reference_threads=0).validate()
    hybrid = [j for j, _ in plan_jobs(cfg, valid_tp=[1, 2]) if j.method == "lp_tp"]
    # 4 processes: lp2 x tp2 (lp1 x tp4 is refused: tp 4 does not divide the heads); 2: lp1 x tp2
    assert [(j.workers, j.engine, j.W, j.G) for j in hybrid] == [(2, "lp1xtp2", 5, 5), (4, "lp2xtp2", 10, 10)]
    assert {j.method for j, _ in plan_jobs(cfg, valid_tp=[1, 2]) if j.workers == 4} == {"lp", "lp_tp", "tp", "pp"}


def test_mesh_model_on_paper():
    from bench import scaling

    m70, h200 = scaling.MODELS["70b"], scaling.GPUS["h200"]
    assert not scaling.mesh_fits("h200", m70, 1) and scaling.mesh_fits("h200", m70, 2)
    # TP shortens a memory-bound step but pays 2 all-reduces per layer
    t1, t8 = (scaling.mesh_step_time(h200, m70, 1, tp) for tp in (1, 8))
    assert t8 < t1 / 4 and t8 > t1 / 8


# ---------------------------------------------------------------------------
# the mesh, for real (slow: 3-4 gloo processes on 2 cores)


def run_worker(nproc: int, spec: dict, tmp_path: Path, timeout: float = 600, monitor_s: float | None = None):
    """``monitor_s``: torchrun's poll interval for dead workers (its default, 0.1 s, can tear
    the job down before the survivors report what they saw)."""
    spec_file, out_file = tmp_path / f"spec{nproc}.json", tmp_path / f"out{nproc}.json"
    spec_file.write_text(json.dumps(spec))
    out_file.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", LP_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, str(WORKER), str(spec_file), str(out_file)]
    if nproc > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] + (
            [f"--monitor-interval={monitor_s}"] if monitor_s is not None else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, (json.loads(out_file.read_text()) if out_file.exists() else [])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (4 heads, 2 KV heads, vocab 128) saved as a transformers folder."""
    path = tmp_path_factory.mktemp("tiny_tp")
    make_tiny_model().save_pretrained(path)
    return path


TINY_JOBS = [
    {"W": 4, "N": 3, "G": 4},  # the paper's window and pool (explicit W/N/G)
    {"drafts": "suffix", "draft_budget": "all", "W": 2, "N": 4, "G": 4, "max_draft_rows": 16,
     "window_policy": "with_candidates"},  # tree drafts, every node verified
    {},  # tree drafts under the budget, on the t(Q) curve measured on the mesh
]


SHARDED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
           "up_proj.weight", "down_proj.weight")


def assert_sharded(ranks: list[dict], full: dict[str, list[int]], tp: int, tied: bool) -> None:
    """Every rank holds exactly 1/tp of each tensor-parallel weight (one dimension divided by
    tp, the rest whole) and every other parameter whole: a plan that silently shards nothing
    (or the wrong thing) fails here even when its outputs are right."""
    sharded = SHARDED + (() if tied else ("embed_tokens.weight", "lm_head.weight"))
    for rank, mem in enumerate(ranks):
        local = mem["local_shapes"]
        assert set(local) == set(full), f"rank {rank}: parameters differ from the one-process model"
        for name, shape in full.items():
            if name.endswith(sharded):
                split = [i for i, (a, b) in enumerate(zip(local[name], shape)) if a != b]
                assert len(split) == 1 and local[name][split[0]] * tp == shape[split[0]], \
                    f"rank {rank}: {name} is {local[name]} locally, not 1/{tp} of {shape}"
            else:
                assert local[name] == shape, f"rank {rank}: {name} should be replicated, is {local[name]} of {shape}"


@pytest.mark.slow
def test_lp2_tp2_equals_one_process_and_generate(tiny_dir, tmp_path):
    prompts = [REPETITIVE_PROMPT, [7, 3, 99, 41, 7, 3, 99, 12, 60, 7, 3]]
    jobs = [{"prompt_ids": p, "decoding": dict(c, max_new_tokens=24)} for p in prompts for c in TINY_JOBS]
    jobs += [{"prompt_ids": p, "decoding": {"W": 4, "N": 3, "G": 4, "max_new_tokens": 24, "do_sample": True,
                                            "temperature": 0.8, "seed": 11}} for p in prompts]
    spec = {"model_path": str(tiny_dir), "jobs": jobs, "check_divergence": True, "timeout_s": 120}
    proc1, one = run_worker(1, spec, tmp_path)
    assert proc1.returncode == 0, proc1.stderr[-3000:]
    proc, mesh = run_worker(4, dict(spec, tp=2), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = make_tiny_model()
    for job, a, b in zip(jobs, one, mesh):
        d = job["decoding"]
        assert len(b["mean_rows_per_rank"]) == 2  # 2 LP workers (of 2 processes each)
        assert b["tp_logits_identical"]  # the all-reduced logits are the same bits on both tp ranks
        assert b["output_ids"] == a["output_ids"], (d, "LP 2 x TP 2 differs from one process")
        if not d.get("do_sample"):
            assert b["output_ids"] == hf_greedy(model, job["prompt_ids"], 24), (d, "differs from generate")
        if d.get("W") == 4 and not d.get("do_sample"):
            assert b["steps"] == a["steps"], d  # the same S as one process
    assert any(sum(r["accept_hist"][2:]) > 0 for r in mesh)  # multi-token steps happened
    assert_sharded(mesh[0]["memory"], one[0]["memory"][0]["local_shapes"], tp=2, tied=False)


@pytest.mark.slow
def test_smollm2_lp1_tp3_equals_generate(smollm2, tmp_path):
    """SmolLM2 (the GGUF Q4_1 model dequantized) on LP 1 x TP 3 with model.quant=auto, the entry
    points' default: every rank resolves it as one process does (exact4 on an AVX-512 CPU: its K
    slices of o_proj and down_proj, 192 and 512, start on 32-blocks, so every linear that converts
    in one process converts on the mesh) and the outputs equal ``generate`` on the one-process model."""
    from lp.model.loader import resolve_model_path
    from tests.test_smollm2 import MAX_NEW, assert_equal_or_tie, eos_ids, prompt_ids, reference

    model, tok = smollm2  # loaded with model.quant=auto
    held = [("code", 0), ("chat", 0)]
    ids = [prompt_ids(tok, k, i) for k, i in held]
    jobs = [{"prompt_ids": p, "eos": eos_ids(model), "decoding": {"W": 5, "N": 3, "G": 5, "max_new_tokens": MAX_NEW}}
            for p in ids]
    spec = {"model_path": str(resolve_model_path("smollm2", None)), "jobs": jobs, "tp": 3, "timeout_s": 180,
            "quant": "auto"}
    proc, out = run_worker(3, spec, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocks = sum(type(m).__name__ == "Exact4Linear" for m in model.modules())
    for mem in out[0]["memory"]:
        assert mem["quant"] == (getattr(model, "_lp_quant", None) or "none")
        assert mem["modules"].get("Exact4Linear", 0) == blocks
    for (kind, i), p, r in zip(held, ids, out):
        assert_equal_or_tie(model, p, r["output_ids"], reference(model, kind, i, p), f"{kind}{i} LP 1 x TP 3")


@pytest.mark.slow
def test_killed_rank_ends_every_rank_within_timeout(tiny_dir, tmp_path):
    spec = {"model_path": str(tiny_dir), "tp": 2, "timeout_s": 15, "kill_rank_at_step": [1, 3],
            "jobs": [{"prompt_ids": REPETITIVE_PROMPT, "decoding": {"W": 4, "N": 3, "G": 4, "max_new_tokens": 200}}]}
    t = time.monotonic()
    # torchrun looks for dead workers every 5 s here, so the survivors' own detection is what
    # ends them (at its default 0.1 s torchrun's SIGTERM can come before their message)
    proc, results = run_worker(4, spec, tmp_path, timeout=300, monitor_s=5)
    elapsed = time.monotonic() - t
    assert proc.returncode != 0 and results == []
    assert elapsed < 120, elapsed  # startup + at most parallel.timeout_s, not torch's 30-minute default
    assert "exchange failed" in proc.stderr and ("Signal 9" in proc.stderr or "SIGKILL" in proc.stderr), \
        proc.stderr[-3000:]


@pytest.mark.slow
def test_rank_killed_mid_forward_ends_the_job_within_timeout_with_lps_message(tiny_dir, tmp_path):
    """1 LP worker x TP 2 on gloo: tp rank 1 dies inside a forward (its last decoder layer, after
    the earlier layers' all-reduces): rank 0, blocked in that layer's all-reduce, ends within
    parallel.timeout_s with lp's "tensor-parallel forward failed" (the NCCL path: test_gpu_paths)."""
    spec = {"model_path": str(tiny_dir), "tp": 2, "timeout_s": 10, "kill_rank_in_forward": [1, 6],
            "jobs": [{"prompt_ids": REPETITIVE_PROMPT, "decoding": {"W": 4, "N": 3, "G": 4, "max_new_tokens": 200}}]}
    t = time.monotonic()
    proc, results = run_worker(2, spec, tmp_path, timeout=300, monitor_s=5)
    elapsed = time.monotonic() - t
    assert proc.returncode != 0 and results == []
    assert elapsed < 90, elapsed
    assert "tensor-parallel forward failed" in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    """The tiny random Llama (untied head) with every linear but the head rounded to exact
    4-bit blocks (tests/test_exact4.py's Q4_1 rounding): what exact4 (and auto) converts."""
    from tests.test_exact4 import to_q4_blocks

    path = tmp_path_factory.mktemp("tiny_q4_tp")
    to_q4_blocks(make_tiny_model()).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("quant, scheme, module", [("int8", "int8", "RowInt8Linear"),
                                                   ("auto", "exact4", "Exact4Linear")])
def test_tp2_quantized_equals_one_process(q4_dir, tmp_path, quant, scheme, module):
    """LP 1 x TP 2, each rank quantizing its own shards after the sharded load, equals the same
    quantized model in one process: greedy tokens (lookahead window and tree drafts), and the
    prompt's logits to float32 rounding (int8's row-parallel shards are scaled by their full
    rows: with per-slice scales they differ by ~0.08). ``auto`` resolves to exact4 on the mesh as
    in one process (the o_proj / down_proj slices of K, 32 and 64, start on 32-blocks). For int8
    the memory plan's per-rank weight bytes are what each rank holds, within 10%."""
    from transformers import AutoConfig

    from lp.parallel.memory import weights_bytes

    jobs = [{"prompt_ids": p, "decoding": dict(c, max_new_tokens=20)}
            for p in (REPETITIVE_PROMPT, [7, 3, 99, 41, 7, 3, 99, 12, 60, 7, 3]) for c in TINY_JOBS[::2]]
    spec = {"model_path": str(q4_dir), "jobs": jobs, "timeout_s": 120, "quant": quant, "return_logits": True}
    if module == "Exact4Linear":  # exact 4-bit blocks run on lp.kernels.idot where the CPU has VNNI
        from lp.kernels import idot

        module = "IDotLinear" if idot.available() else module
    proc1, one = run_worker(1, spec, tmp_path)
    assert proc1.returncode == 0, proc1.stderr[-3000:]
    proc, mesh = run_worker(2, dict(spec, tp=2), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mem in one[0]["memory"] + mesh[0]["memory"]:
        assert mem["quant"] == scheme and mem["modules"].get(module, 0) == one[0]["memory"][0]["modules"][module]
    assert mesh[0]["memory"][0]["modules"]["RowParallel"] == 4  # o_proj, down_proj of 2 layers
    for job, a, b in zip(jobs, one, mesh):
        assert b["output_ids"] == a["output_ids"], (job["decoding"], f"{quant} on TP 2 differs from one process")
    err = (torch.tensor(one[0]["logits"]) - torch.tensor(mesh[0]["logits"])).abs().max().item()
    assert err < 1e-5, f"{quant} on TP 2: prompt logits differ from one process by {err:.3g}"
    if quant == "int8":
        config = AutoConfig.from_pretrained(q4_dir)
        for tp, out in ((1, one), (2, mesh)):
            planned = weights_bytes(q4_dir, config, tp, torch.float32, torch.device("cpu"), "int8")[0]
            for mem in out[0]["memory"]:
                assert abs(planned - mem["weight_bytes"]) <= 0.1 * mem["weight_bytes"], (tp, planned, mem)


@pytest.mark.slow
def test_tp2_compiled_step_equals_one_process(q4_dir, tmp_path):
    """model.compile=on on LP 1 x TP 2 (gloo CPU, model.quant=auto: exact4 shards, row-parallel
    all-reduces and the gathered head inside the compiled step) equals the eager one-process model
    and ``generate`` on it. Costs inductor's compile on both ranks (~80-210 s here on 2 shared cores)."""
    from lp.model.loader import load_model
    from tests.helpers import lookahead

    decoding = {"W": 4, "N": 3, "G": 4, "max_new_tokens": 16}
    spec = {"model_path": str(q4_dir), "jobs": [{"prompt_ids": REPETITIVE_PROMPT, "decoding": decoding}],
            "timeout_s": 300, "quant": "auto", "compile": "on", "tp": 2}
    proc, mesh = run_worker(2, spec, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model, _ = load_model(q4_dir, "float32", quant="auto")
    one = lookahead(model, REPETITIVE_PROMPT, **decoding).output_ids
    assert [m["quant"] for m in mesh[0]["memory"]] == [model._lp_quant] * 2
    assert mesh[0]["output_ids"] == one == hf_greedy(model, REPETITIVE_PROMPT, 16)


# ---------------------------------------------------------------------------
# launcher and server on the mesh: a tiny random Llama with SmolLM2's tokenizer


@pytest.fixture(scope="module")
def tiny_tok_dir(tmp_path_factory):
    from lp.model.loader import load_tokenizer, resolve_model_path

    path = tmp_path_factory.mktemp("tiny_tok_tp")
    make_tiny_model(vocab=49152).save_pretrained(path)  # SmolLM2's vocabulary
    load_tokenizer(resolve_model_path("smollm2", None)).save_pretrained(path)  # SmolLM2's tokenizer files
    return path


def _chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.slow
def test_two_launches_lp2_tp2_equal_one_process(tiny_tok_dir, tmp_path):
    from lp import DecodingConfig, LookaheadDecoder, ModelRunner
    from lp.model.loader import load_model
    from tests.test_multinode import _free_port

    out = tmp_path / "out.json"
    overrides = ["parallel.workers=2", "parallel.tp=2", f"model.path={tiny_tok_dir}", "prompt=Name three colours.",
                 "decoding.max_new_tokens=16", "decoding.W=4", "decoding.N=3", "decoding.G=4", f"output={out}",
                 "stream=false", "parallel.timeout_s=90", "model.dtype=float32"]
    env = dict(os.environ, LP_RUN_DIR=str(tmp_path / "run"), LP_THREADS="1")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "launch" / "lp_run.py"), "--nnodes", "2", "--node-rank",
                               str(r), "--rdzv-endpoint", f"127.0.0.1:{port}", *overrides],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=420)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    result = json.loads(out.read_text())
    assert (result["workers"], result["tp"]) == (2, 2)
    model, tok = load_model(tiny_tok_dir, "float32")
    ids = result["prompt_ids"]
    assert ids == _chat_ids(tok, "Name three colours.")
    one = LookaheadDecoder(ModelRunner(model), DecodingConfig(W=4, N=3, G=4, max_new_tokens=16)).generate(
        ids, [tok.eos_token_id])
    assert result["output_ids"] == one.output_ids
    assert result["output_ids"] == hf_greedy(model, ids, 16, eos_token_id=[tok.eos_token_id])


@pytest.mark.slow
def test_serve_lp2_tp2_answers_openai_with_greedy_text(tiny_tok_dir, tmp_path):
    from lp.generate import eos_ids
    from lp.model.loader import load_model
    from tests.test_serve import Server, free_port

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), LP_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "lp.serve",
           "parallel.workers=2", "parallel.tp=2", f"model.path={tiny_tok_dir}", "model.dtype=float32",
           "model.threads=1", f"server.port={port}", "server.log_level=warning", "parallel.timeout_s=60",
           "server.heartbeat_s=2", "decoding.draft_budget=all", "server.model_id=tiny"]
    server = Server(cmd, port, tmp_path, env)
    workers: list[int] = []
    try:
        server.wait_healthy()
        # torchrun starts every worker in its own session: keep their ids for the teardown
        workers = [int(p) for p in Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()]
        model, tok = load_model(tiny_tok_dir, "float32")
        text = "List three uses of a hash map."
        ids = _chat_ids(tok, text)
        ref = hf_greedy(model, ids, 16, eos_token_id=eos_ids(model, tok))
        r = server.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": text}], max_tokens=16, temperature=0,
            extra_body={"lookahead": {"W": 4, "N": 3, "G": 4, "return_token_ids": True}})
        la = r.model_extra["lookahead"]
        assert la["output_ids"] == ref and la["workers"] == 2
        assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
        assert r.usage.completion_tokens == len(ref)
        # concurrent requests on the mesh: batched together, each still its own greedy text
        import concurrent.futures

        texts = ["Name two sorting algorithms.", "What is a mutex?", "Say hello in French."]
        refs = [hf_greedy(model, _chat_ids(tok, t), 12, eos_token_id=eos_ids(model, tok)) for t in texts]

        def ask(t):
            return server.client().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": t}], max_tokens=12, temperature=0,
                extra_body={"lookahead": {"return_token_ids": True}}).model_extra["lookahead"]["output_ids"]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, texts))
        assert got == refs, "concurrent requests on LP 2 x TP 2 differ from generate"
        # a chat's next turn: the prefix cache (on by default) hits the earlier turn's blocks; rank 0
        # decides the hit and it rides the step message to the 3 other ranks
        system = "You are a terse assistant. " * 12
        chat = [{"role": "system", "content": system}, {"role": "user", "content": texts[1]}]
        for turn in range(2):
            ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            want = hf_greedy(model, ids, 12, eos_token_id=eos_ids(model, tok))
            r = server.client().chat.completions.create(model="tiny", messages=chat, max_tokens=12, temperature=0,
                                                        extra_body={"lookahead": {"return_token_ids": True}})
            assert r.model_extra["lookahead"]["output_ids"] == want, f"turn {turn} on LP 2 x TP 2 with the prefix cache"
            if turn:
                assert r.usage.prompt_tokens_details.cached_tokens >= 16, r.usage
            chat += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": texts[2]}]
        health = httpx.get(server.url + "/health", timeout=10).json()
        assert health["memory"]["tp"] == 2 and health["memory"]["weights"] > 0  # rank 0's memory plan
        # a clean shutdown of the mesh: SIGTERM reaches rank 0 (the others wait for its SHUTDOWN)
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        assert server.proc.wait(90) == 0, server.log()[-3000:]
    finally:
        server.stop(signal.SIGKILL)
        for pid in workers:  # whatever is left of this server's workers
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------------------
# sharded loading: each tp rank reads only its shards of the checkpoint


@pytest.fixture(scope="module")
def mid_dirs(tmp_path_factory):
    """A ~155M-parameter random Llama with untied embeddings (so every big tensor shards),
    saved twice: float32 (~620 MB) and bfloat16 (~310 MB)."""
    model = make_tiny_model(vocab=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                            num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                            initializer_range=0.05)
    f32, b16 = tmp_path_factory.mktemp("mid_f32"), tmp_path_factory.mktemp("mid_bf16")
    model.save_pretrained(f32)
    model.to(torch.bfloat16).save_pretrained(b16)
    del model
    yield f32, b16
    shutil.rmtree(f32, ignore_errors=True)
    shutil.rmtree(b16, ignore_errors=True)


def _loaded_mb(mem: dict) -> float:
    """What loading and decoding added to a rank's peak resident memory (torch, the process
    group and lp's imports are in the part before loading)."""
    return mem["peak_rss_end_mb"] - mem["rss_before_load_mb"]


@pytest.mark.slow
def test_sharded_load_reads_only_this_ranks_shards(mid_dirs, tmp_path):
    """LP 1 x TP 2 loads each rank's shards straight from the checkpoint: local shapes are
    1/tp of the full ones, what loading (and decoding) adds to each rank's peak RSS is at
    most 0.8x the one-process run (0.68 measured here: ~130 MB of model construction and the
    slice being copied are in both; unsharded it is ~1.0; the ~490M model of
    bench/results/tp_memory shows the split at scale), the outputs equal one process and ``generate``; a bfloat16 checkpoint loaded as
    bfloat16 stays bfloat16 (never widened to float32 on the way: well under the float32 load)."""
    f32, b16 = mid_dirs
    prompt = [5, 17, 300, 4, 5, 17, 300, 4, 5, 17]
    job = {"prompt_ids": prompt, "decoding": {"W": 4, "N": 3, "G": 4, "max_new_tokens": 12}}
    spec = {"model_path": str(f32), "jobs": [job], "timeout_s": 300, "check_divergence": True}
    proc1, one = run_worker(1, spec, tmp_path)
    assert proc1.returncode == 0, proc1.stderr[-3000:]
    proc2, tp2 = run_worker(2, dict(spec, tp=2), tmp_path)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    ref = hf_greedy(AutoModelForCausalLM.from_pretrained(f32, dtype=torch.float32), prompt, 12)
    assert one[0]["output_ids"] == ref
    assert tp2[0]["output_ids"] == ref, "LP 1 x TP 2 from sharded loading differs from generate"
    full = one[0]["memory"][0]["local_shapes"]
    assert_sharded(tp2[0]["memory"], full, tp=2, tied=False)
    base = _loaded_mb(one[0]["memory"][0])
    assert base > 500, f"the one-process run added only {base:.0f} MB for ~620 MB of weights"
    for mem in tp2[0]["memory"]:
        assert _loaded_mb(mem) <= 0.8 * base, (
            f"a tp=2 rank added {_loaded_mb(mem):.0f} MB, one process {base:.0f} MB: not sharded on read")
    proc, half = run_worker(2, dict(spec, tp=2, model_path=str(b16), dtype="bfloat16",
                                    jobs=[dict(job, decoding=dict(job["decoding"], max_new_tokens=2))]), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mem, mem32 in zip(half[0]["memory"], tp2[0]["memory"]):
        assert mem["dtypes"] == ["torch.bfloat16"], mem["dtypes"]
        assert _loaded_mb(mem) <= 0.75 * _loaded_mb(mem32), (
            f"bf16 shards added {_loaded_mb(mem):.0f} MB vs float32's {_loaded_mb(mem32):.0f} MB: widened on the way?")
    print("one process", base, "tp2", [_loaded_mb(m) for m in tp2[0]["memory"]],
          "bf16 tp2", [_loaded_mb(m) for m in half[0]["memory"]])


# ---------------------------------------------------------------------------
# what a sharded load reads beside the parameters: persistent buffers, keep-in-float32 modules


def _register_buffer_llama():
    """A tiny Llama subclass with a persistent buffer (``model.lp_scale``, all ones as built)
    and keep-in-float32 modules: ``_keep_in_fp32_modules`` (transformers applies it under
    float16 only) on down_proj, ``_keep_in_fp32_modules_strict`` (float16 and bfloat16) on
    o_proj and the buffer. Registered with the Auto classes, as load_sharded builds from them."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    class BufferLlamaConfig(LlamaConfig):
        model_type = "lp_test_buffer_llama"

    class BufferLlamaForCausalLM(LlamaForCausalLM):
        config_class = BufferLlamaConfig
        _keep_in_fp32_modules = ["down_proj"]
        _keep_in_fp32_modules_strict = ["o_proj", "lp_scale"]

        def __init__(self, config):
            super().__init__(config)
            self.model.register_buffer("lp_scale", torch.ones(config.hidden_size))  # persistent

    AutoConfig.register(BufferLlamaConfig.model_type, BufferLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(BufferLlamaConfig, BufferLlamaForCausalLM, exist_ok=True)
    return BufferLlamaConfig, BufferLlamaForCausalLM


def _sharded_load_rank(rank: int, world: int, folder: str):
    """One gloo rank: load_sharded in three dtypes, each compared with from_pretrained."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from lp.parallel.tp import load_sharded

    torch.set_num_threads(1)
    _register_buffer_llama()
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        expected_scale = torch.arange(64, dtype=torch.float32) / 7  # what the checkpoint holds
        for dtype, fp32 in (("bfloat16", {"o_proj", "lp_scale"}), ("float16", {"o_proj", "lp_scale", "down_proj"}),
                            ("float32", set())):
            model, _ = load_sharded(folder, dtype, "cpu", mesh["tp"], tokenizer=False)
            ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
            ref = ref_model.state_dict()
            got = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
            # the buffers no checkpoint holds (rotary inv_freq, ...): computed alike
            ref_buffers = dict(ref_model.named_buffers())
            for k, v in model.named_buffers():
                assert v.dtype == ref_buffers[k].dtype and torch.equal(v, ref_buffers[k]), (dtype, k)
            assert {k for k, _ in model.named_buffers()} == set(ref_buffers), dtype
            assert set(got) == set(ref), (dtype, set(got) ^ set(ref))
            assert any(isinstance(p, DTensor) and p.to_local().shape != p.shape for p in model.parameters()) == (
                world > 1), "nothing sharded"
            for k, v in got.items():
                want = torch.float32 if any(m in k for m in fp32) else getattr(torch, dtype)
                assert v.dtype == ref[k].dtype == want, (dtype, k, v.dtype, ref[k].dtype, want)
                assert torch.equal(v, ref[k]), (dtype, k, "differs from from_pretrained")
            assert torch.equal(model.model.lp_scale, expected_scale.to(model.model.lp_scale.dtype)), dtype
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_load_reads_persistent_buffers_and_keeps_fp32_modules(tmp_path):
    """LP 1 x TP 2 sharded loading (two gloo ranks) of a tiny Llama whose checkpoint holds a
    persistent buffer with non-default values (arange / 7; the class builds ones) and whose
    class keeps modules in float32: loaded as bfloat16, float16 and float32, every parameter
    and buffer equals ``from_pretrained``'s, dtype included (o_proj and the buffer float32 under
    both half dtypes, down_proj under float16 only, as transformers does); the buffers no
    checkpoint holds (rotary frequencies) are computed alike."""
    import torch.multiprocessing as mp

    from tests.helpers import _family_config

    config_cls, model_cls = _register_buffer_llama()
    torch.manual_seed(0)
    model = model_cls(config_cls(**_family_config("llama", 128, "sdpa", 512).to_dict()))
    with torch.no_grad():
        model.model.lp_scale.copy_(torch.arange(64, dtype=torch.float32) / 7)
    model.save_pretrained(tmp_path)
    mp.spawn(_sharded_load_rank, args=(2, str(tmp_path)), nprocs=2, join=True)


def _auto_dtype_rank(rank: int, world: int, folder: str, cases: list):
    """One gloo rank on a pretend AMX CPU (model.dtype=auto is bf16 there): load_sharded with
    model.dtype=auto and model.quant=auto gives the dtype and scheme load_model gives
    (tests/test_defaults.py checks load_model's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lp.model import loader
    from lp.parallel.tp import load_sharded

    torch.set_num_threads(1)
    loader.cpu_has_amx_bf16 = lambda: True
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for path, want in cases:
            model, _ = load_sharded(path, "auto", "cpu", mesh["tp"], tokenizer=False, quant="auto")
            got = (str(model.dtype), getattr(model, "_lp_quant", None) or "none")
            assert got == want, (path, got)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_auto_dtype_and_quant_under_tp_follow_one_process(q4_dir, tiny_dir, tmp_path):
    """model.dtype=auto + model.quant=auto on an AMX CPU under TP 2: float32 + exact4 for a model
    whose linears are exact 4-bit blocks, bfloat16 + none for one whose are not, as in one process."""
    import torch.multiprocessing as mp

    cases = [(str(q4_dir), ("torch.float32", "exact4")), (str(tiny_dir), ("torch.bfloat16", "none"))]
    mp.spawn(_auto_dtype_rank, args=(2, str(tmp_path), cases), nprocs=2, join=True)


def _split_blocks_rank(rank: int, world: int, folder: str):
    """One gloo rank: exact4 shards of a model whose o_proj slice of K (96 / 2 = 48) splits its
    32-blocks: o_proj stays float32, every other linear converts, logits equal one process's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lp.kernels.exact4 import Exact4Linear
    from lp.model.loader import load_model
    from lp.parallel.tp import RowParallel, load_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        model, _ = load_sharded(f"{folder}/model", "float32", "cpu", mesh["tp"], tokenizer=False, quant="exact4")
        one, _ = load_model(f"{folder}/model", "float32", quant="exact4", tokenizer=False)
        rows = {n: type(m.linear).__name__ for n, m in model.named_modules() if isinstance(m, RowParallel)}
        assert {n: k for n, k in rows.items() if k not in ("Exact4Linear", "IDotLinear")} == {
            f"model.layers.{i}.self_attn.o_proj": "SmallRowsLinear" for i in range(2)}, rows
        assert sum(isinstance(m, Exact4Linear) for m in model.modules()) == sum(
            isinstance(m, Exact4Linear) for m in one.modules()) - 2  # one o_proj per layer left dense
        ids = torch.tensor([[5, 17, 30, 4, 5, 17, 30]])
        with torch.inference_mode():
            err = (model(ids).logits - one(ids).logits).abs().max().item()
        assert err < 1e-5, err
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_exact4_shard_that_splits_blocks_stays_dense(tmp_path):
    import torch.multiprocessing as mp

    from tests.test_exact4 import to_q4_blocks

    to_q4_blocks(make_tiny_model(hidden_size=96)).save_pretrained(tmp_path / "model")
    mp.spawn(_split_blocks_rank, args=(2, str(tmp_path)), nprocs=2, join=True)


def test_sharded_load_needs_safetensors(tmp_path):
    from lp.parallel.tp import _weight_files

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"parallel.tp > 1 loads each rank's shards from safetensors"):
        _weight_files(tmp_path)


@pytest.mark.slow
def test_gguf_file_on_tp2_equals_generate(tokenizer, tmp_path):
    """A GGUF file under parallel.tp=2 (every rank reads it whole as float32, keeps its shards,
    then quantizes them as model.quant=auto resolves: float32 shards for these formats): a tiny
    Llama in Q8_0 and in the Q4_K_M mix both equal ``generate`` on transformers'
    ``from_pretrained(gguf_file=...)``, and each rank holds half of every sharded linear."""
    from transformers import AutoModelForCausalLM

    from tests.gguf_tiny import Q4_K_M, write_tiny_gguf

    fields = tokenizer
    prompt = list(range(40, 100, 3)) + REPETITIVE_PROMPT[:12]
    for fmt, kinds in (("Q8_0", {"attn": "Q8_0", "ffn": "Q8_0", "embd": "Q8_0", "output": "Q8_0"}), ("Q4_K_M", Q4_K_M)):
        file = write_tiny_gguf(tmp_path / f"tp-{fmt}.gguf", "llama", kinds, fields, seed=11, tie=False)
        ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name, dtype=torch.float32).eval()
        spec = {"model_path": str(file), "tp": 2, "timeout_s": 120, "quant": "auto",
                "jobs": [{"prompt_ids": prompt, "decoding": {"W": 4, "N": 3, "G": 4, "max_new_tokens": 24}}]}
        (tmp_path / fmt).mkdir()
        proc, out = run_worker(2, spec, tmp_path / fmt, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert out[0]["output_ids"] == hf_greedy(ref, prompt, 24), fmt
        shapes = out[0]["memory"][0]["local_shapes"]
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == [128, 256]  # half of 4 heads x 64
        assert shapes["model.layers.0.mlp.down_proj.weight"] == [256, 256]  # half of K = 512
