"""Multi-node LP for real: two torchrun launches (2 workers each) on localhost joined through
torchrun's multi-node rendezvous (``--nnodes 2``, one ``--rdzv-endpoint``) by launch/lp_run.py,
4 workers in total, give exactly the one-process greedy output (and transformers ``generate``).

``parallel.workers`` means the total number of workers (the world size) everywhere.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "launch" / "lp_run.py"
sys.path.insert(0, str(ROOT / "launch"))

import lp_run  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_workers_means_total_over_nodes():
    cmd, _ = lp_run.build_command(["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:1",
                                   "parallel.workers=4"])
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert "parallel.workers=4" in cmd
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    cmd, _ = lp_run.build_command(["parallel.workers=3"])
    assert cmd[cmd.index("--nproc-per-node") + 1] == "3" and "--standalone" in cmd
    with pytest.raises(SystemExit, match="multiple of --nnodes"):
        lp_run.build_command(["--nnodes", "2", "--rdzv-endpoint", "h:1", "parallel.workers=3"])


@pytest.mark.slow
def test_two_launches_of_two_workers_equal_one_process(tmp_path, smollm2):
    model, tok = smollm2
    port = _free_port()
    out = tmp_path / "out.json"
    overrides = ["parallel.workers=4", "prompt=List three uses of a hash map.",
                 "decoding.max_new_tokens=32", "decoding.W=5", "decoding.N=4", "decoding.G=5",
                 f"output={out}", "stream=false", "parallel.timeout_s=90", "model.dtype=float32"]
    env = dict(os.environ, LP_RUN_DIR=str(tmp_path / "run"), LP_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(LAUNCHER), "--nnodes", "2", "--node-rank", str(rank),
             "--rdzv-endpoint", f"127.0.0.1:{port}", *overrides],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=420)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    result = json.loads(out.read_text())
    assert result["workers"] == 4
    prompt_ids = result["prompt_ids"]

    from lp import DecodingConfig, LookaheadDecoder, ModelRunner

    one = LookaheadDecoder(ModelRunner(model), DecodingConfig(W=5, N=4, G=5, max_new_tokens=32)).generate(
        prompt_ids, [tok.eos_token_id])
    assert result["output_ids"] == one.output_ids
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                             eos_token_id=[tok.eos_token_id])[0, len(prompt_ids):].tolist()
    assert result["output_ids"] == ref
