"""Lookahead Parallelism: 2 and 3 gloo workers under torchrun on CPU.

Checks: greedy output equals one process and transformers generate token for token, with
the same steps (so the same S), for W < workers, G = 0 and G not divisible by workers;
sampling under 2 workers draws the same tokens as one process for the same seeds and
matches plain sampling in distribution; a killed worker ends the job within the timeout;
a wrong parallel.workers is a clear error.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "lp_worker.py"

pytestmark = pytest.mark.slow


def torchrun(nproc: int, spec: dict, tmp_path: Path, timeout: float = 600) -> tuple[subprocess.CompletedProcess, list]:
    spec_file = tmp_path / f"spec{nproc}.json"
    out_file = tmp_path / f"out{nproc}.json"
    spec_file.write_text(json.dumps(spec))
    if out_file.exists():
        out_file.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), str(spec_file), str(out_file)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKER), str(spec_file), str(out_file)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    results = json.loads(out_file.read_text()) if out_file.exists() else []
    return proc, results


PROMPTS = [
    ("raw", 'def running_mean(xs):\n    """Return the running mean of the list xs."""\n'),
    ("chat", "List three uses of a hash map, one line each."),
    ("chat", "A train travels 60 km in 1.5 hours. What is its average speed in km/h? Explain briefly."),
]

# (W, N, G): W < workers, G = 0, G not divisible by 2 or 3, N = 2
CONFIGS = [(5, 4, 5), (1, 3, 2), (4, 4, 0), (7, 3, 7), (3, 2, 4)]


@pytest.fixture(scope="module")
def smollm2_refs():
    from lp.model.loader import load_model, resolve_model_path

    path = resolve_model_path("smollm2", None)
    model, tok = load_model(path, "float32")
    torch.set_num_threads(2)
    prompts = []
    for kind, text in PROMPTS:
        if kind == "chat":
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tok(text)["input_ids"]
        prompts.append(ids)
    refs = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False, eos_token_id=[2])
        refs.append(out[0, len(ids):].tolist())
    return prompts, refs


def greedy_pairs(n_prompts: int) -> list[tuple[int, int]]:
    """(prompt, config) pairs: the first config on every prompt, each other config on one prompt
    (in turn): every config's shape and every prompt kind runs, in 7 jobs rather than 15."""
    return [(p, 0) for p in range(n_prompts)] + [(c % n_prompts, c) for c in range(1, len(CONFIGS))]


def greedy_spec(prompts):
    jobs = []
    for p, c in greedy_pairs(len(prompts)):
        W, N, G = CONFIGS[c]
        jobs.append({"prompt_ids": prompts[p], "eos": [2],
                     "decoding": {"W": W, "N": N, "G": G, "max_new_tokens": 40, "prompt_pool": True}})
    return {"jobs": jobs, "check_divergence": True}


def test_lp_greedy_matches_one_process_and_generate(smollm2_refs, tmp_path):
    prompts, refs = smollm2_refs
    spec = greedy_spec(prompts)
    proc1, single = torchrun(1, spec, tmp_path)
    assert proc1.returncode == 0, proc1.stderr[-3000:]
    for nproc in (2, 3):
        proc, multi = torchrun(nproc, spec, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(multi) == len(spec["jobs"])
        for (p, _), job, one, many in zip(greedy_pairs(len(prompts)), spec["jobs"], single, multi):
            ref = refs[p]
            cfg = job["decoding"]
            assert one["output_ids"] == ref, (cfg, "single process differs from generate")
            assert many["output_ids"] == ref, (nproc, cfg, "LP differs from generate")
            assert many["steps"] == one["steps"], (nproc, cfg)  # same S as one process
            assert len(many["mean_rows_per_rank"]) == nproc
            # balanced shards: the busiest worker runs about its 1/K share of one process's rows,
            # plus what no split removes (every worker's pending rows, one indivisible column or
            # candidate); all rows on one worker fails this wherever that share is a few rows
            share = one["mean_rows_per_rank"][0] / nproc
            assert max(many["mean_rows_per_rank"]) <= share + cfg["N"] + 2, (nproc, cfg, many["mean_rows_per_rank"])
        # LP actually accepted multi-token runs somewhere
        assert any(len(r["accept_hist"]) > 2 and sum(r["accept_hist"][2:]) > 0 for r in multi)


TREE_CONFIGS = [
    # suffix drafts + window n-grams in one token tree, every node verified (no cost model)
    {"drafts": "suffix", "draft_budget": "all", "W": 2, "N": 4, "G": 4, "max_draft_rows": 16,
     "window_policy": "with_candidates"},
    # the default: the budget from rank 0's measured t(Q), broadcast to every rank
    {},
]


def test_lp_tree_drafts_greedy_matches_one_process(smollm2_refs, tmp_path):
    prompts, refs = smollm2_refs
    # each config on two of the three prompts (the raw-code one under the fixed trees, the second
    # chat one under the default budget): 4 jobs rather than 6
    pairs = [(0, 0), (1, 0), (1, 1), (2, 1)]
    jobs = [{"prompt_ids": prompts[p], "eos": [2], "decoding": dict(TREE_CONFIGS[c], max_new_tokens=40)}
            for p, c in pairs]
    spec = {"jobs": jobs, "check_divergence": True}
    proc1, single = torchrun(1, spec, tmp_path)
    assert proc1.returncode == 0, proc1.stderr[-3000:]
    for nproc in (2, 3):
        proc, multi = torchrun(nproc, spec, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for (p, _), job, one, many in zip(pairs, jobs, single, multi):
            ref = refs[p]
            assert one["output_ids"] == ref, (job["decoding"], "single process differs from generate")
            assert many["output_ids"] == ref, (nproc, job["decoding"], "LP differs from generate")
            # the same trees, so the same steps, where every node is verified; under the default
            # budget LP prices a node at 1/K of a row (lp.drafts.budget.best_k's workers), so its trees are
            # legitimately larger and its step count differs: only the tokens must agree there
            if job["decoding"].get("draft_budget") == "all":
                assert many["steps"] == one["steps"], (nproc, job["decoding"])
        assert any(sum(r["accept_hist"][2:]) > 0 for r in multi)


# ---------------------------------------------------------------------------
# sampling on a tiny model


def tiny_model_dir(tmp_path: Path) -> tuple[Path, list[int]]:
    """The 12-token model of test_sampling_dist saved for the workers, and its prompt."""
    from tests.helpers import hf_greedy, make_tiny_model

    model = make_tiny_model("llama", vocab=12, initializer_range=0.2)
    path = tmp_path / "tiny"
    model.save_pretrained(path)  # the worker only uses token ids: no tokenizer needed
    return path, [1, 2, 3, 4, 5] + hf_greedy(model, [1, 2, 3, 4, 5], 20)


SAMPLING = dict(max_new_tokens=3, do_sample=True, temperature=0.9, top_p=0.95)
LP_SHAPES = [
    dict(W=3, N=4, G=5, prompt_pool=True),  # the paper's pool: candidates split over workers
    # suffix drafts in a token tree: outcomes exchanged per trie node
    dict(W=3, N=4, G=5, drafts="suffix", draft_budget="all", max_draft_len=6, max_draft_rows=10),
]


def sampling_spec(path: Path, prompt: list[int], draws: int, **extra) -> dict:
    jobs = [{"prompt_ids": prompt, "decoding": dict(LP_SHAPES[s % 2], seed=s, **SAMPLING)} for s in range(draws)]
    return {"jobs": jobs, "model_path": str(path), "check_divergence": True, **extra}


def test_lp_sampling_same_draws_and_exact_distribution(tmp_path):
    """Same seeds: 1, 2 and 3 workers draw the very same tokens (randomness keyed by seed and
    output position; fp32, where every row's logits are a one-row step's), which are also lp's
    plain seeded decoding (mode=ar, one process); the 2-worker draws fit the exact conditional
    distributions (tests.helpers); a draft accepted by probability on every rank is rejected by
    the same test, and one worker sampling with another seed changes the tokens."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import conditional_fit, exact_next_probs, fit_verdict

    path, prompt = tiny_model_dir(tmp_path)
    draws = 800
    spec = sampling_spec(path, prompt, draws)
    runs = {}
    for nproc in (1, 2, 3):
        proc, runs[nproc] = torchrun(nproc, spec, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(runs[nproc]) == draws
    for nproc in (2, 3):
        differ = [(s, a["output_ids"], b["output_ids"]) for s, (a, b) in enumerate(zip(runs[1], runs[nproc]))
                  if a["output_ids"] != b["output_ids"]]
        assert not differ, (nproc, len(differ), differ[:5])
    plain = {**spec, "jobs": [{**j, "decoding": {**SAMPLING, "seed": j["decoding"]["seed"], "mode": "ar"}}
                              for j in spec["jobs"][:100]]}
    proc, ar = torchrun(1, plain, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["output_ids"] for r in ar] == [r["output_ids"] for r in runs[2][:100]]
    multi_token_steps = sum(sum(r["accept_hist"][2:]) for r in runs[2])
    assert multi_token_steps > draws // 5, multi_token_steps  # the verifier really ran

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    kw = {k: SAMPLING[k] for k in ("temperature", "top_p")}
    exact = exact_next_probs(model, prompt, 3, **kw)
    ok, report = fit_verdict(conditional_fit([r["output_ids"] for r in runs[2]], exact))
    assert ok, report

    proc, bad = torchrun(2, sampling_spec(path, prompt, 400, planted_bug="probability_accept_draw"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ok, report = fit_verdict(conditional_fit([r["output_ids"] for r in bad], exact))
    assert not ok, f"LP 2 workers: the planted verifier bug went unnoticed: {report}"
    proc, other = torchrun(2, sampling_spec(path, prompt, 100, planted_bug="other_seed_draw", planted_rank=1), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["output_ids"] for r in other] != [r["output_ids"] for r in runs[1][:100]], \
        "a worker sampling with another seed went unnoticed"


# ---------------------------------------------------------------------------
# failures


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TIMEOUT_S = 10  # parallel.timeout_s of the failure tests
MARGIN_S = 15  # process exit and a loaded 2-core machine


def _streamed(stdout: str) -> str:
    """The generated text on lp.generate's stdout: without the log lines Hydra's logging writes there
    ("[time][logger][LEVEL] - ...", e.g. the kernel load while the ranks are still starting)."""
    return "\n".join(line for line in stdout.splitlines() if not re.match(r"\[\d{4}-\d\d-\d\d ", line))


@pytest.mark.parametrize("sig,victim", [(signal.SIGKILL, 1), (signal.SIGSTOP, 0)], ids=["killed", "hung"])
def test_dead_or_hung_worker_ends_survivor_by_lps_own_detection(tmp_path, sig, victim):
    """Two lp.generate workers started by hand (no torchrun, which would tear the group
    down itself on a death): once decoding streams, one is SIGKILLed (its socket closes) or
    SIGSTOPped (it stays connected and silent). The survivor must exit 3 with lp's own
    message naming its rank, within parallel.timeout_s plus a margin."""
    port = free_port()
    cmd = [sys.executable, "-m", "lp.generate", "model.dtype=float32", "model.threads=1",
           "prompt=Write a long story about a lighthouse keeper.", "decoding.W=3", "decoding.N=3", "decoding.G=3",
           "decoding.max_new_tokens=2000", f"parallel.timeout_s={TIMEOUT_S}"]
    procs, logs = {}, {}
    try:
        for rank in (0, 1):
            env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            logs[rank] = (tmp_path / f"out{rank}.txt", tmp_path / f"err{rank}.txt")
            procs[rank] = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=open(logs[rank][0], "w"),
                                           stderr=open(logs[rank][1], "w"))
        t = time.monotonic()
        while len(_streamed(logs[0][0].read_text()).split()) < 3:  # rank 0 streams: the ranks are decoding
            assert all(p.poll() is None for p in procs.values()), logs[0][1].read_text()[-3000:]
            assert time.monotonic() - t < 300, "decoding did not start"
            time.sleep(0.2)
        os.kill(procs[victim].pid, sig)
        t = time.monotonic()
        survivor = 1 - victim
        try:
            rc = procs[survivor].wait(TIMEOUT_S + MARGIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {survivor} still runs {TIMEOUT_S + MARGIN_S} s after rank {victim} got {sig!r}")
        elapsed = time.monotonic() - t
        err = logs[survivor][1].read_text()
        assert rc == 3, (rc, err[-3000:])
        assert f"[lp] rank {survivor}: per-step exchange failed" in err, err[-3000:]
        if sig == signal.SIGSTOP:  # nothing closed: only the bounded wait can have ended it
            assert elapsed >= TIMEOUT_S * 0.8, elapsed
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
                p.wait(30)


def test_workers_must_match_world_size(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "lp.generate", "parallel.workers=3", "decoding.max_new_tokens=2", "model.dtype=float32"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert "parallel.workers=3" in proc.stderr and "WORLD_SIZE=2" in proc.stderr, proc.stderr[-2000:]
