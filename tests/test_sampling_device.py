"""Sampling verification on the logits' device (issue 37): ``lp.lookahead.sampling.verify_node``
and the decoders' sampled verification around it never move a vocabulary-sized row to the host;
only token ids and single numbers come back (on CUDA: no V floats copied to the host per node).

Contract checked on the CPU with a device-agnostic assertion: no call asks for a vocabulary-sized
tensor on the CPU (``Tensor.to(<cpu>)``, ``.cpu()``, ``.tolist()``, ``.numpy()``, or an
``aten._to_copy`` naming the CPU device), during ``verify_node`` and during sampled lookahead
decoding (one sequence and the batched engine); and on the CPU the seeded draws are those of the
host-copy verifier lp ran before (the same tokens for the same (seed, step, depth)).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lp.engine.decoder
from lp.config import DecodingConfig
from lp.engine.batch import BatchEngine
from lp.engine.decoder import LookaheadDecoder
from lp.lookahead import sampling
from lp.lookahead.sampling import node_generator, verify_node, warp
from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT

V = 1000  # a vocabulary no other tensor of the tiny model's steps has as many elements as


def _host_verify_node(probs_V: torch.Tensor, candidates: Sequence[int], gen: torch.Generator) -> int:
    """lp's verifier before issue 37 (the whole row copied to the host as float64), verbatim."""
    residual = probs_V.detach().to("cpu", torch.float64)
    tested: set[int] = set()
    for token in candidates:
        if token in tested:
            continue
        tested.add(token)
        u = torch.rand((), generator=gen, dtype=torch.float64).item()
        p = residual[token].item()
        if u < p:
            return token
        residual[token] = 0.0
        total = residual.sum()
        if total <= 0:
            residual[token] = 1.0
            return token
        residual /= total
    return int(torch.multinomial(residual, 1, generator=gen).item())


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


def test_verify_node_draws_on_the_rows_device_and_equals_the_host_verifier(monkeypatch):
    """Accepted candidates, rejected ones, repeated ones, the residual's draw: the same token as
    the host-copy verifier for every (row, candidates, seed), and no vocabulary row to the host."""
    rows = [_row(s) for s in range(4)]
    top = [r.topk(4).indices.tolist() for r in rows]
    cases = [(r, cands) for r, t in zip(rows, top) for cands in ([], t[:1], t[:3], [t[1], t[1], t[0]], [5, 6])]
    expected = [_host_verify_node(r, c, node_generator(7, i, d)) for r, c in cases for i in range(20)
                for d in range(2)]
    copies = _HostCopies(monkeypatch)
    with copies:
        got = [verify_node(r, c, node_generator(7, i, d)) for r, c in cases for i in range(20) for d in range(2)]
    assert copies.seen == []
    assert got == expected
    assert len(set(got)) > 10  # rejections and the residual's draws, not one token
    gen = node_generator(7, 0, 0)
    assert sampling.device_generator(gen, torch.device("cpu")) is gen  # the CPU's draws: gen's own


def test_sampled_decoding_reads_no_vocabulary_row_on_the_host(tiny_factory, monkeypatch):
    model = tiny_factory("llama", vocab=V)
    runner = ModelRunner(model)
    real, nodes = lp.engine.decoder.verify_node, []

    def counted(probs_V, candidates, gen):
        nodes.append(len(candidates))
        return real(probs_V, candidates, gen)

    monkeypatch.setattr(lp.engine.decoder, "verify_node", counted)
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
    assert any(nodes), "verify_node tested candidates"
