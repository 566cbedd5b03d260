"""Import hygiene: a run that does not quantize with torchao never imports it.

torchao prints warnings when it is imported (``KernelPreference ... register_constant() on
Enum subclasses is deprecated``, failed CUDA extension loads), and transformers imports it,
when installed, with every model class. lp imports it only for a ``model.quant`` that uses it
(lp.model.quant.defer_torchao). A fresh interpreter (the test process has imported
everything already) imports lp's entry points, builds a tiny model, a ModelRunner with
``quant="none"``, and runs lookahead and transformers ``generate`` on it: torchao must not be
in ``sys.modules`` and nothing of it printed. The same process then asks for int4: torchao
comes in, and transformers' torchao quantizer module gets its torchao imports back.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys
import lp, lp.generate, lp.serve
from lp.model.runner import ModelRunner
from tests.helpers import REPETITIVE_PROMPT, hf_greedy, lookahead, make_tiny_model

out = {"after_imports": "torchao" in sys.modules}
model = make_tiny_model("qwen2", seed=1)
runner = ModelRunner(model, quant="none")
res = lookahead(runner, REPETITIVE_PROMPT, max_new_tokens=8)
ref = hf_greedy(model, REPETITIVE_PROMPT, 8)
out["equal"] = res.output_ids == ref
out["hf_quantizer_imported"] = "transformers.quantizers.quantizer_torchao" in sys.modules
out["after_run"] = "torchao" in sys.modules
print("---- quant=none done ----", file=sys.stderr, flush=True)
if sys.argv[1] == "int4":
    from lp.model.quant import quantize
    from transformers.utils import is_torchao_available

    quantize(model, "int4", "cpu")
    hf = sys.modules["transformers.quantizers.quantizer_torchao"]
    out["int4_torchao"] = "torchao" in sys.modules
    out["int4_hf_whole"] = hasattr(hf, "flatten_tensor_state_dict") and is_torchao_available()
print(json.dumps(out))
"""


def _has_int4_cpu() -> bool:
    try:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig  # noqa: F401
    except Exception:
        return False
    import torch

    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed: nothing to keep out")
def test_quant_none_never_imports_torchao():
    then = "int4" if _has_int4_cpu() else "none"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, then], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    before_int4 = proc.stderr.split("---- quant=none done ----")[0]
    assert out["equal"], "lookahead differs from generate on the tiny model"
    assert not out["after_imports"], "importing lp, lp.generate, lp.serve imported torchao"
    assert not out["after_run"], "a quant=none run (tiny model, ModelRunner, lookahead, generate) imported torchao"
    for noise in ("torchao", "register_constant"):
        assert noise not in before_int4, f"a quant=none run printed {noise!r}:\n{before_int4[-2000:]}"
    if then == "int4":
        assert out["int4_torchao"], "model.quant=int4 ran without importing torchao?"
        assert out["int4_hf_whole"], "transformers' torchao quantizer module was not completed once torchao came in"
        assert "register_constant" not in proc.stderr, proc.stderr[-2000:]
