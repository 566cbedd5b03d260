"""Benchmark runner: plain-arithmetic checks, and one tiny end-to-end run (ar, lookahead, lp on 2 workers).

The end-to-end test composes conf/bench with Hydra and calls ``bench.run.run_bench``
directly (lp with 2 workers goes through torchrun + gloo): 2 HumanEval prompts,
16 new tokens; it checks the JSONL fields and that every output equals ar's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scaling
from bench.config import BenchConfig
from bench.methods import stage_bounds, tp_shards_attention
from bench.run import ROOT, SCHEMAS, Job, first_mismatch, plan_jobs, run_bench
from lp import cli

ROW_FIELDS = {
    "method", "workers", "threads", "W", "N", "G", "set", "prompt_index", "prompt_id", "new_tokens", "steps", "S",
    "decode_time_s", "tokens_per_second", "matches_ar", "first_mismatch", "exchange_time_s",
    "exchange_time_per_step_s", "rows_per_step", "rows_per_rank_per_step", "accept_hist", "dtype", "output_ids",
}


def compose(overrides: list[str]) -> BenchConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    cli.register(SCHEMAS)
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "bench"), version_base="1.3"):
        return cli.to_config(hydra_compose("bench", overrides=overrides))


# ---------------------------------------------------------------------------
# arithmetic


def test_law_reproduces_paper_fit():
    # alpha=0.425, f=3.106 (LLaMA-2-7B-chat, MT-Bench) at W=G=15, N=5 gives the paper's S ~ 2
    assert scaling.compression(0.425, 3.106, 4, 15) == pytest.approx(1.98, abs=0.01)
    assert scaling.expected_tokens(0.5, 3, 1) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert scaling.compression(0.3, 2.0, 3, 0) == pytest.approx(1.0)  # no candidates: one token per step


def test_fit_recovers_parameters():
    points = [(3, float(b), scaling.compression(0.4, 2.5, 3, b)) for b in (1, 3, 5, 8, 12, 20)]
    alpha, f = scaling.fit_law(points)
    assert alpha == pytest.approx(0.4, abs=1e-3) and f == pytest.approx(2.5, abs=1e-2)
    assert scaling.fit_law(points[:1]) is None


def test_rows_and_curve():
    assert scaling.packed_rows(5, 4, 5) == 1 + 4 + 10 + 15
    assert scaling.rows_per_device(1, 5, 4, 5) == 30
    assert scaling.rows_per_device(2, 10, 4, 10) <= 31  # W, G doubled over 2 workers: about the same rows
    tq = scaling.TQCurve({1: 1.0, 4: 2.0, 8: 4.0})
    assert tq(2) == pytest.approx(1 + 1 / 3) and tq(16) == pytest.approx(8.0) and tq(0.5) == 1.0
    assert scaling.predict_speedup(2.0, tq, 4, 0.0) == pytest.approx(1.0)


def test_plan_reuses_equal_computations():
    cfg = BenchConfig(methods=["ar", "lookahead", "lp", "tp", "pp"], workers=[1, 2], reference_threads=2).validate()
    plan = plan_jobs(cfg)
    jobs = [j for j, which in plan if which == "main"]
    assert jobs[0] == Job("ar", 1, 1)
    assert sorted(j.W for j, which in plan if which == "sweep") == sorted(cfg.sweep.W)
    by = {(j.method, j.workers, j.threads): j for j in jobs}
    assert by[("lp", 1, 1)].kernel == by[("lookahead", 1, 1)].kernel
    assert by[("tp", 1, 1)].kernel == by[("pp", 1, 1)].kernel == by[("ar", 1, 1)].kernel
    assert (by[("lp", 2, 1)].W, by[("lp", 2, 1)].G) == (10, 10)
    assert ("lookahead", 1, 2) in by and ("ar", 1, 2) in by


def test_tp_and_pp_splits():
    class Cfg:
        num_attention_heads, num_key_value_heads = 9, 3

    assert not tp_shards_attention(Cfg, 2) and tp_shards_attention(Cfg, 3)
    assert stage_bounds(30, 2) == [(0, 15), (15, 30)]
    assert stage_bounds(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1 and first_mismatch([1, 2], [1, 2, 3]) == 2


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="methods"):
        BenchConfig(methods=["beam"]).validate()
    with pytest.raises(ValueError, match="prompts.sets"):
        compose(["prompts.sets=[squad]"]).validate()


# ---------------------------------------------------------------------------
# end to end


@pytest.mark.slow
def test_runner_smoke(tmp_path):
    cfg = compose([
        "prompts=smoke", "methods=[ar,lookahead,lp]", "workers=[1,2]", "reference_threads=0", "sweep=none",
        "tq_qs=[1,4]", "tq_repeats=1", f"out_dir={tmp_path}", "name=smoke",
    ])
    out = run_bench(cfg)
    assert json.loads((out / "errors.json").read_text()) == []
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by = {}
    for r in rows:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
        by.setdefault((r["method"], r["workers"]), []).append(r)
    assert set(by) == {("ar", 1), ("lookahead", 1), ("lp", 1), ("lp", 2)}
    ar = {r["prompt_index"]: r["output_ids"] for r in by[("ar", 1)]}
    assert sorted(ar) == [0, 1]
    for r in rows:
        assert r["set"] == "humaneval" and r["new_tokens"] == len(r["output_ids"]) <= 16
        assert r["output_ids"] == ar[r["prompt_index"]] and r["matches_ar"] is True
        assert r["steps"] >= 1 and r["S"] == pytest.approx(r["new_tokens"] / r["steps"], abs=1e-3)
    for r in by[("lp", 2)]:
        assert (r["W"], r["N"], r["G"]) == (10, 4, 10)
        assert len(r["rows_per_rank_per_step"]) == 2 and r["exchange_time_per_step_s"] is not None
        assert r["ranks_agree"] is True
    assert by[("lp", 1)][0]["same_as"] == "lookahead"
    for name in ("summary.md", "machine.json", "fit.json", "tq.json", "scaling_check.md",
                 "speedup_vs_workers.png", "s_vs_w.png", "accept_hist.png"):
        assert (out / name).is_file(), name
    assert "| lp | 2 | 1 | 10 | 4 | 10 |" in (out / "summary.md").read_text()


def test_presets_compose_from_their_header_examples():
    """Every ``python -m bench.run ...`` line in a preset's header composes into a valid config."""
    import shlex

    for path in sorted((ROOT / "conf" / "bench" / "preset").glob("*.yaml")):
        lines = [ln for ln in path.read_text().splitlines() if ln.startswith("#") and "python -m bench.run" in ln]
        assert lines, path
        for ln in lines:
            args = shlex.split(ln.split("python -m bench.run", 1)[1])
            cfg = compose(args).validate()
            if cfg.kind == "concurrency":
                assert cfg.concurrency.servers and cfg.concurrency.max_tokens == 64, (path.name, args)
            else:
                assert cfg.interleave and cfg.workers == [1], (path.name, args)
    cfg = compose(["+preset=drafts", "prompts.sets=[humaneval]", "prompts.num_prompts=20"])
    assert cfg.prompts.max_new_tokens["humaneval"] == 128 and cfg.lookahead.W == 1
    assert [j.method for j, _ in plan_jobs(cfg)] == ["ar", "prompt_lookup", "lp_default", "lp_torch_matmul", "lookahead"]
    cfg = compose(["+preset=lookahead_vs_ar"])
    assert cfg.lookahead.W == 15 and cfg.prompts.max_new_tokens["humaneval"] == 256


def test_concurrency_config_and_commands():
    """The concurrency preset's servers start with the commands a user would type; bad fields name themselves."""
    from bench.concurrency import server_command

    cfg = compose(["+preset=concurrency"]).validate()
    assert cfg.kind == "concurrency" and cfg.concurrency.clients == [1, 2, 4, 8, 16]
    lp = server_command("lp_max_batch1", 8123, Path("/m"), 2, ["server.kv_tokens=4096"])
    assert lp[1:3] == ["-m", "lp.serve"] and "server.port=8123" in lp and lp[-2:] == ["server.kv_tokens=4096",
                                                                                       "server.max_batch=1"]
    cb = server_command("transformers_cb", 8124, Path("/m"), 2, [])
    assert cb[1:3] == ["serve", "--continuous-batching"] and cb[-1] == "/m" and "8124" in cb
    assert "--continuous-batching" not in server_command("transformers", 8125, Path("/m"), 2, [])
    for override, field in (("concurrency.servers=[sglang]", "concurrency.servers"),
                            ("concurrency.workloads=[json]", "concurrency.workloads"),
                            ("concurrency.code_set=mt_bench", "concurrency.code_set"),
                            ("concurrency.repeats=0", "concurrency.repeats"),
                            ("concurrency.clients=[0]", "concurrency.clients"),
                            ("concurrency.max_tokens=0", "concurrency.max_tokens"),
                            ("concurrency.prompt_set=humaneval", "concurrency.prompt_set"),
                            ("kind=serve", "kind")):
        with pytest.raises(ValueError, match=field):
            compose(["+preset=concurrency", override]).validate()


def test_vllm_server_command_env_and_missing_venv(tmp_path):
    """vllm / vllm_ngram start <venv>/bin/vllm serve on the CPU settings; a missing venv names the setting."""
    from bench.concurrency import NGRAM_SPEC, run_concurrency, server_command, server_order, vllm_env

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
    cmd = server_command("vllm", 8200, Path("/m"), 2, ["server.kv_tokens=1"], venv)
    assert cmd[:3] == [str(venv / "bin" / "vllm"), "serve", "/m"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8200" and flags["--dtype"] == "float32"
    assert flags["--generation-config"] == "vllm" and "--speculative-config" not in flags
    assert "server.kv_tokens=1" not in cmd  # lp overrides are lp's
    ngram = server_command("vllm_ngram", 8201, Path("/m"), 2, [], venv)
    spec = json.loads(ngram[ngram.index("--speculative-config") + 1])
    assert spec == NGRAM_SPEC and spec["method"] == "ngram" and spec["num_speculative_tokens"] == 5
    assert vllm_env(2) == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4",
                           "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert vllm_env(1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert vllm_env(1, "1", 2)["VLLM_CPU_OMP_THREADS_BIND"] == "1" and vllm_env(1, "1", 2)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert vllm_env(2, None, 4, {"LD_PRELOAD": "/x.so"})["LD_PRELOAD"] == "/x.so"
    cfg = compose(["+preset=concurrency", "concurrency.vllm_cpu_bind=1", "+concurrency.vllm_extra_env.LD_PRELOAD=/x.so"])
    assert vllm_env(1, cfg.validate().concurrency.vllm_cpu_bind)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert cfg.concurrency.vllm_extra_env == {"LD_PRELOAD": "/x.so"}
    with pytest.raises(ValueError, match="concurrency.vllm_extra_env"):
        compose(["+preset=concurrency", "+concurrency.vllm_extra_env.VLLM_CPU_KVCACHE_SPACE=8"]).validate()
    assert server_order(["lp", "vllm", "vllm_ngram"], 1) == ["vllm", "vllm_ngram", "lp"]
    assert server_order(["lp", "vllm"], 2) == ["lp", "vllm"]
    for kind in ("vllm", "vllm_ngram"):
        with pytest.raises(ValueError, match=r"concurrency\.vllm_venv.*bench/vllm_venv\.sh"):
            server_command(kind, 8202, Path("/m"), 2, [], tmp_path / "nothing")
    # the bench fails at once, before any reference decode or server start
    cfg = compose(["+preset=concurrency", "concurrency.servers=[lp,vllm]",
                   f"concurrency.vllm_venv={tmp_path / 'nothing'}"]).validate()
    with pytest.raises(ValueError, match=r"concurrency\.vllm_venv"):
        run_concurrency(cfg, tmp_path, Path("/m"))
    assert not list(tmp_path.glob("server_*.log"))


def test_concurrency_tables_per_workload():
    """The tables give every server x workload x clients the median over the repeats, with the range."""
    from bench.concurrency import aggregate, markdown

    def pt(server, workload, repeat, tps):
        return {"server": server, "workload": workload, "clients": 1, "repeat": repeat, "requests": 2, "completed": 2,
                "errors": [], "equal_lp_greedy": 2, "wall_s": 1.0, "completion_tokens": 32, "tokens_per_s": tps,
                "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "load_avg": [0, 0, 0], "server_command": "x"}

    pts = [pt("lp", "chat", 0, 10.0), pt("lp", "chat", 1, 30.0), pt("lp", "chat", 2, 20.0), pt("vllm", "code", 0, 5.0)]
    agg = aggregate(pts)
    assert agg[("lp", "chat", 1)]["tokens_per_s"] == 20.0 and agg[("lp", "chat", 1)]["min"] == 10.0
    assert agg[("vllm", "code", 1)]["n"] == 1 and ("lp", "code", 1) not in agg
    m = {"cpus": 2, "load_avg": [0, 0, 0]}
    md = markdown({"command": "c", "machine_before": m, "machine_after": m, "max_tokens": 16, "threads": 1,
                   "repeats": 3, "points": pts, "server_env": {"vllm": {"VLLM_TARGET_DEVICE": "cpu"}}})
    assert "## chat" in md and "## code" in md and "| lp | 20.0 [10.0-30.0] (0.1 / 0.2) |" in md
    assert "`VLLM_TARGET_DEVICE=cpu x`" in md


def test_server_memory_reads_its_session_and_the_table_shows_it():
    """bench.serve_load.ServerProcess.memory sums VmRSS / VmHWM over the processes of the server's
    session (a parent and its child here, ~64 MB touched by the child alone); the concurrency table
    shows them per point."""
    import subprocess
    import sys

    from bench.concurrency import markdown
    from bench.serve_load import ServerProcess

    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'b = bytearray(64 << 20); import time; time.sleep(30)']); time.sleep(30)")
    srv = ServerProcess.__new__(ServerProcess)
    srv.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        import time

        deadline = time.monotonic() + 20
        mem = srv.memory()
        while (mem is None or mem["rss_mib"] < 64) and time.monotonic() < deadline:
            time.sleep(0.2)
            mem = srv.memory()
        assert mem is not None and 64 <= mem["rss_mib"] <= mem["rss_peak_mib"] < 1024, mem
    finally:
        import os
        import signal

        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
    m = {"cpus": 2, "load_avg": [0, 0, 0]}
    pt = {"server": "lp", "workload": "chat", "clients": 1, "repeat": 0, "requests": 2, "completed": 2, "errors": [],
          "equal_lp_greedy": 2, "wall_s": 1.0, "completion_tokens": 32, "tokens_per_s": 9.0, "ttft_p50_s": 0.1,
          "ttft_p90_s": 0.2, "load_avg": [0, 0, 0], "server_command": "x", "startup_s": 3.0, **mem}
    md = markdown({"command": "c", "machine_before": m, "machine_after": m, "max_tokens": 16, "threads": 1,
                   "repeats": 1, "points": [pt]})
    assert f"| 3.0 | {mem['rss_mib']} ({mem['rss_peak_mib']}) |" in md
