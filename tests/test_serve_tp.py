"""lp.serve on LP 1 x TP 2 (torchrun, 2 gloo ranks, one LP worker sharded over both) == the one-process
server, with the real ``openai`` client.

Contract: the features a one-process server answers are answered on the tensor-parallel mesh with the
same tokens: a json_schema response (greedy, the grammar's forced drafts on), a regex of digits on the
pool shape, a tool_choice "required" call, chat logprobs with top_logprobs (default shape and the pool
on a counting prompt) and completions echo + logprobs (with new tokens and prompt only); the logprob
values equal the one-process server's to ``LOGPROB_TOL`` (see there).

SmolLM2-135M has 9 query / 3 key-value heads, which TP 2 does not divide: the mesh serves SmolLM2
padded to 12 / 4 heads (bench.tp_memory.pad_heads: zero heads that attend to zero values and o_proj
ignores), the same function: its logits equal SmolLM2's exactly in one process (checked here before
the server starts). The one-process server is tests/test_serve.py's ``one`` (SmolLM2 itself, both
with ``model.quant=auto``: exact4 where the CPU has its kernel, on every TP rank's shards too).
One TP server per module.
"""

from __future__ import annotations

import os
import signal
import sys

import httpx
import pytest

from tests.test_serve import (CHAT, COUNT, RAW, ROOT, SAMPLED_SHAPE, SERVER_ARGS, Server, free_port,  # noqa: F401
                              one, rank_pids)

pytestmark = pytest.mark.slow

# Logprob values, mesh vs one process. TP 2 sums each row-parallel matmul in two halves plus an
# all-reduce (another rounding order than one process); measured on these requests: at most
# 2.8e-5 (loaded machine, 2 cores), so 1e-4 holds with a 3.6x margin.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def padded():
    """SmolLM2 padded to 12 / 4 heads (cached under LP_CACHE), checked equal to SmolLM2 in one process."""
    import torch

    from bench.tp_memory import padded_smollm2
    from lp.model.loader import load_model, resolve_model_path

    path = padded_smollm2()
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 1072, 2099, 28, 216, 17, 18, 19]])
    logits = []
    for p in (resolve_model_path("smollm2", None), path):
        model, _ = load_model(p, "float32", quant="none")
        with torch.inference_mode():
            logits.append(model(ids).logits)
    # zero heads add exact zeros, but the wider q/k/v/o matmuls may sum in another order (oneDNN's
    # blocking depends on the shapes and the thread count): equal to float32 rounding, same argmax
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4, msg="the padded SmolLM2 is not SmolLM2")
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))
    return path


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, padded):
    port = free_port()
    workdir = tmp_path_factory.mktemp("serve_tp2")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "lp.serve",
           "parallel.workers=1", "parallel.tp=2", "model.threads=1", f"server.port={port}", *SERVER_ARGS,
           f"model.path={padded}", "server.model_id=smollm2", "parallel.timeout_s=120", "server.heartbeat_s=2"]
    # parallel.timeout_s=120: the load's collectives (model.quant=auto's agreement) wait while a rank
    # builds a C++ kernel on its first start (30 s timed out here under load)
    server = Server(cmd, port, workdir, env)
    ranks = {}
    try:
        server.wait_healthy()
        ranks = rank_pids(server)  # torchrun starts each rank in its own session: killpg does not reach them
        yield server
    finally:
        server.stop()  # SIGTERM: torchrun forwards it to the ranks
        for pid in ranks.values():  # whatever is left of them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _create(server, **kw):
    return server.client().chat.completions.create(model="smollm2", **kw)


def test_tp_structured_and_tool_calls_equal_one_process(one, tp2):  # noqa: F811 (the fixture)
    """Every TP rank holds the request's grammar (the request channel) and masks the same rows; rank 0's
    verdict rules, so a rank without it breaks the mesh's lockstep (its forced drafts, its masked rows)."""
    from tests.test_structured_serve import ASK, DIGITS, PROMPTS, SCHEMAS, TOOLS, assert_same_structured_answer

    health = httpx.get(tp2.url + "/health", timeout=10).json()
    assert (health["workers"], health["memory"]["tp"]) == (1, 2), health
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS["person"], "strict": True}}
    person = [{"role": "user", "content": PROMPTS["person"]}]
    ids = {"lookahead": {"return_token_ids": True}}
    cases = [
        dict(messages=[{"role": "user", "content": CHAT[0]}], temperature=0, extra_body={
            "structured_outputs": {"regex": DIGITS},
            "lookahead": dict(SAMPLED_SHAPE, return_token_ids=True)}),
        dict(messages=person, response_format=rf, temperature=0, extra_body=ids),
        dict(messages=[{"role": "user", "content": ASK}], tools=TOOLS, tool_choice="required", temperature=0,
             extra_body=ids),
    ]
    for kw in cases:
        a, b = (_create(s, max_tokens=48, **kw) for s in (one, tp2))
        _, la_b = assert_same_structured_answer(kw, a, b)
        if "response_format" in kw:
            assert la_b["forced_tokens"] > 0, la_b  # the grammar's forced drafts, verified on the mesh


def _close(got: list[float], want: list[float]) -> float:
    assert got == pytest.approx(want, abs=LOGPROB_TOL)
    return max((abs(x - y) for x, y in zip(got, want)), default=0.0)


def test_tp_logprobs_equal_one_process(one, tp2):  # noqa: F811 (the fixture)
    """Chat logprobs (top 3: the default shape, and the pool on a counting prompt where long hits are
    verified by candidate rows) and completions echo + logprobs=2 (12 new tokens; max_tokens 0, the
    prompt scored only): tokens and top tokens equal, values to LOGPROB_TOL."""
    worst = 0.0
    pool = {"lookahead": SAMPLED_SHAPE}
    for text, extra in ((CHAT[0], {}), (COUNT, pool)):
        a, b = (_create(s, messages=[{"role": "user", "content": text}], max_tokens=24, temperature=0, logprobs=True,
                        top_logprobs=3, extra_body=extra) for s in (one, tp2))
        assert b.choices[0].message.content == a.choices[0].message.content
        want, got = a.choices[0].logprobs.content, b.choices[0].logprobs.content
        assert len(got) == len(want) > 0 and all(len(x.top_logprobs) == 3 for x in got)
        assert [t.token for t in got] == [t.token for t in want]
        worst = max(worst, _close([t.logprob for t in got], [t.logprob for t in want]))
        for x, y in zip(got, want):
            assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
            worst = max(worst, _close([t.logprob for t in x.top_logprobs], [t.logprob for t in y.top_logprobs]))
    for max_tokens in (12, 0):
        a, b = (s.client().completions.create(model="smollm2", prompt=RAW, max_tokens=max_tokens, temperature=0,
                                              echo=True, logprobs=2) for s in (one, tp2))
        assert b.choices[0].text == a.choices[0].text and a.choices[0].text.startswith(RAW)
        want, got = a.choices[0].logprobs, b.choices[0].logprobs
        assert got.tokens == want.tokens and got.text_offset == want.text_offset
        assert got.token_logprobs[0] is None and want.token_logprobs[0] is None
        worst = max(worst, _close(got.token_logprobs[1:], want.token_logprobs[1:]))
        assert len(got.top_logprobs) == len(want.top_logprobs)
        for x, y in zip(got.top_logprobs[1:], want.top_logprobs[1:]):
            assert list(x) == list(y)
            worst = max(worst, _close(list(x.values()), list(y.values())))
    print(f"LP 1 x TP 2 vs one process: largest logprob difference {worst:.3g}")
