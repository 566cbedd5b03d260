"""Sampling on the logits' device (issue 37): ``lp.lookahead.sampling.sample_at`` and the decoders'
sampled verification around it never move a vocabulary-sized row to the host; only token ids
come back (on CUDA: no V floats copied to the host per node).

Contract checked on the CPU with a device-agnostic assertion: no call asks for a vocabulary-sized
tensor on the CPU (``Tensor.to(<cpu>)``, ``.cpu()``, ``.tolist()``, ``.numpy()``, or an
``aten._to_copy`` naming the CPU device), during ``sample_at`` and during sampled lookahead
decoding (one sequence and the batched engine); and the draws are the host-side inverse CDF's
(numpy over the same probabilities, the same uniform per (seed, position)).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine
from lp.engine.decoder import LookaheadDecoder
from lp.lookahead.sampling import sample_at, uniform, warp
from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT

V = 1000  # a vocabulary no other tensor of the tiny model's steps has as many elements as


def _host_sample(probs_V: torch.Tensor, seed: int, position: int) -> int:
    """The inverse CDF on the host, in numpy: the first token whose float64 cumulative probability
    exceeds u(seed, position) times the total."""
    cdf = np.cumsum(probs_V.detach().to("cpu", torch.float64).numpy())
    return int(np.searchsorted(cdf, uniform(seed, position) * cdf[-1], side="right"))


class _HostCopies(TorchDispatchMode):
    """Records every request for a tensor of >= V elements on the CPU."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.seen: list[str] = []
        for name in ("to", "cpu", "tolist", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _note(self, what: str, t) -> None:
        if isinstance(t, torch.Tensor) and t.numel() >= V:
            self.seen.append(f"{what} {tuple(t.shape)}")

    def _wrap(self, name, real):
        def method(t, *args, **kwargs):
            targets = [*args, kwargs.get("device")]
            if name != "to" or any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu"
                                   for a in targets):
                self._note(f"Tensor.{name}", t)
            return real(t, *args, **kwargs)

        return method

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            self._note(str(func), args[0])
        return func(*args, **kwargs)


def _row(seed: int) -> torch.Tensor:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3
    return warp(logits, 0.9, 0, 1.0)


def test_sample_at_draws_on_the_rows_device_and_equals_the_host_inverse_cdf(monkeypatch):
    rows = [_row(s) for s in range(4)]
    keys = [(seed, pos) for seed in (7, -3) for pos in range(40)]
    expected = [_host_sample(r, seed, pos) for r in rows for seed, pos in keys]
    copies = _HostCopies(monkeypatch)
    with copies:
        got = [sample_at(r, seed, pos) for r in rows for seed, pos in keys]
    assert copies.seen == []
    assert got == expected
    assert len(set(got)) > 10  # draws over the vocabulary, not one token


def test_sampled_decoding_reads_no_vocabulary_row_on_the_host(tiny_factory, monkeypatch):
    model = tiny_factory("llama", vocab=V)
    runner = ModelRunner(model)
    real, nodes = LookaheadDecoder._draw, []

    def counted(self, run, probs_V, position, kids):
        nodes.append(len(kids))
        return real(self, run, probs_V, position, kids)

    monkeypatch.setattr(LookaheadDecoder, "_draw", counted)
    cfg = dict(max_new_tokens=10, W=3, N=3, G=3, do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
    prompts = [REPETITIVE_PROMPT, [3, 4, 5, 6, 7, 8, 3, 4, 5, 6]]
    copies = _HostCopies(monkeypatch)
    with copies:
        alone = LookaheadDecoder(runner, DecodingConfig(seed=3, **cfg)).generate(list(prompts[0])).output_ids
        engine = BatchEngine(runner, kv_tokens=512, block_size=8, max_batch=2)
        ids = [engine.add(p, DecodingConfig(seed=3, **cfg)) for p in prompts]
        outs = {rid: [] for rid in ids}
        while engine.has_work:
            for o in engine.step():
                outs[o.request_id].extend(o.new_tokens)
    assert copies.seen == []
    assert len(alone) == 10 and all(len(o) == 10 for o in outs.values())
    assert outs[ids[0]] == alone  # the same seeded draws in the batch as alone
    assert any(nodes), "drafts were tested"
