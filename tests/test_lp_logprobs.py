"""decoding.logprobs under Lookahead Parallelism (2 gloo workers under torchrun on CPU).

Contract checked: for every published token, the chosen token's raw logprob and its
``top_logprobs`` alternatives come from the rank whose rows verified it (they ride the step's
one all_gather, lp.parallel.dist ``with_logprobs``), so 2 LP workers report the same tokens, the
same top ids and the same values (to 1e-4, fp32) as one process: greedy (the paper's pool split
over workers, a suffix-draft tree) and sampled (same seeds). The server side (chat
``top_logprobs``, completions ``echo`` + ``logprobs``) is in tests/test_serve.py (``lp2``).
"""

from __future__ import annotations

import pytest

from tests.test_lp import LP_SHAPES, tiny_model_dir, torchrun

pytestmark = pytest.mark.slow

TOL = 1e-4


def assert_logprobs_equal(one: list, many: list, what) -> None:
    """lp_worker's [token, logprob, [[id, logprob], ...]] per token: same tokens, same top ids, values to TOL."""
    assert len(one) == len(many), what
    for i, ((t1, v1, top1), (t2, v2, top2)) in enumerate(zip(one, many)):
        assert t1 == t2, (what, i)
        assert v2 == pytest.approx(v1, abs=TOL), (what, i, v1, v2)
        assert [t for t, _ in top1] == [t for t, _ in top2], (what, i, top1, top2)
        assert [v for _, v in top2] == pytest.approx([v for _, v in top1], abs=TOL), (what, i, top1, top2)


def test_lp_logprobs_equal_one_process(tmp_path):
    """Greedy and sampled, pool and tree drafts: 2 workers' logprobs == one process's, token by token,
    over runs that accept multi-token steps (the accepted tokens' rows live on either worker)."""
    path, prompt = tiny_model_dir(tmp_path)
    jobs = []
    for shape in LP_SHAPES:
        jobs.append({"prompt_ids": prompt, "decoding": dict(shape, max_new_tokens=16, logprobs=True, top_logprobs=3)})
        jobs += [{"prompt_ids": prompt, "decoding": dict(shape, max_new_tokens=16, logprobs=True, top_logprobs=2,
                                                          do_sample=True, temperature=0.9, top_p=0.95, seed=s)}
                 for s in range(3)]
    jobs.append({"prompt_ids": prompt, "decoding": dict(LP_SHAPES[0], max_new_tokens=8, logprobs=True)})  # top 0
    spec = {"jobs": jobs, "model_path": str(path), "check_divergence": True}
    proc1, one = torchrun(1, spec, tmp_path)
    assert proc1.returncode == 0, proc1.stderr[-3000:]
    proc2, two = torchrun(2, spec, tmp_path)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert len(one) == len(two) == len(jobs)
    for job, a, b in zip(jobs, one, two):
        what = job["decoding"]
        assert b["output_ids"] == a["output_ids"], what
        assert [x[0] for x in a["logprobs"]] == a["output_ids"], what
        assert all(len(x[2]) == what.get("top_logprobs", 0) for x in b["logprobs"]), what
        assert_logprobs_equal(a["logprobs"], b["logprobs"], what)
    # multi-token steps: logprobs read from candidate rows, not only the rows every worker runs
    assert all(sum(r["accept_hist"][2:]) > 0 for r in two[:-1]), [r["accept_hist"] for r in two]
