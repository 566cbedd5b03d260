"""The usage examples in the module docstrings run as written."""

from __future__ import annotations

import doctest

import pytest

import lp.lookahead.pool
import lp.lookahead.shard
import lp.lookahead.verify


@pytest.mark.parametrize("module", [lp.lookahead.pool, lp.lookahead.verify, lp.lookahead.shard], ids=lambda m: m.__name__)
def test_module_doctests(module):
    result = doctest.testmod(module, verbose=False, report=True)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} docstring example(s) of {module.__name__} fail"
