"""Lookahead Parallelism over tensor-parallel groups: the (lp, tp) mesh on gloo CPU workers.

Checks: bad meshes (workers x tp != world, tp not dividing the heads) are ValueErrors naming
the field and the fix; a tiny random Llama (4 heads, 2 KV heads) on LP 2 x TP 2 (4 processes)
gives exactly the one-process greedy output and transformers ``generate``, with the paper's
window (explicit W/N/G) and with tree drafts (every node, and the budget on the t(Q) curve
measured on the mesh), and samples the same tokens as one process for the same seed, every
process's pool/window/output fingerprint equal at every step (tp ranks included); real
SmolLM2 weights (9 heads, 3 KV heads) on LP 1 x TP 3 equal ``generate`` on held prompts;
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


@pytest.mark.slow
def test_smollm2_lp1_tp3_equals_generate(smollm2, tmp_path):
    from lp.model.loader import resolve_model_path
    from tests.test_smollm2 import MAX_NEW, assert_equal_or_tie, eos_ids, prompt_ids, reference

    model, tok = smollm2
    held = [("code", 0), ("chat", 0)]
    ids = [prompt_ids(tok, k, i) for k, i in held]
    jobs = [{"prompt_ids": p, "eos": eos_ids(model), "decoding": {"W": 5, "N": 3, "G": 5, "max_new_tokens": MAX_NEW}}
            for p in ids]
    spec = {"model_path": str(resolve_model_path("smollm2", None)), "jobs": jobs, "tp": 3, "timeout_s": 180}
    proc, out = run_worker(3, spec, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
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


# ---------------------------------------------------------------------------
# launcher and server on the mesh: a tiny random Llama with SmolLM2's tokenizer


@pytest.fixture(scope="module")
def tiny_tok_dir(tmp_path_factory):
    from lp.model.loader import resolve_model_path

    path = tmp_path_factory.mktemp("tiny_tok_tp")
    make_tiny_model(vocab=49152).save_pretrained(path)  # SmolLM2's vocabulary
    src = resolve_model_path("smollm2", None)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, path / f)
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
