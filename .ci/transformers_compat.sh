#!/usr/bin/env bash
# CI: lp under transformers 5.17.0, the version on the GPU machine's image (issue 37), beside the
# newer transformers the main suite runs with.
#
# Contract:
# - Makes a venv with --system-site-packages (under a temp dir removed on exit, or at
#   $LP_COMPAT_VENV, kept and reused when it already holds transformers 5.17.0) and installs into it
#   ONLY transformers==5.17.0 and huggingface-hub==1.33.0 (5.17 needs hub >=1.5,<2), both --no-deps:
#   torch, tokenizers, safetensors and lp itself (editable) come from the system site-packages,
#   so pip never pulls a CUDA torch. Run from inside a venv, that venv's site dirs are added after
#   the new venv's own (a .pth), as the system ones would be.
# - Checks in the venv, before any test: transformers.__version__ == "5.17.0", hub 1.33.0, torch
#   imported from the system site-packages at the outer interpreter's version (2.13.0+cpu in CI),
#   and every non-extra requirement of transformers 5.17.0 satisfied by what the venv sees.
# - Runs a short selection of lp's transformers-integration tests with the venv's python: greedy
#   == generate on the tiny families (tests/test_greedy_tiny.py), packed rows == separate forwards
#   over lp's cache and masks (test_packed_forward.py), static shapes (test_static_shapes.py), the
#   CUDA-path pieces on the CPU (test_gpu_paths.py), the fused exact4 stack (test_fused.py: it must
#   still equal this version's Llama layers bit for bit), and the batch engine (test_batch.py, not slow,
#   not the second compiled-model test). One pytest process (the import costs ~15 s).
# - Exit status: pytest's (0 = green); non-zero too on any check above failing.
# Run from anywhere: `bash .ci/transformers_compat.sh` (.ci/run calls it after the main suite).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
TF_VERSION=5.17.0
HUB_VERSION=1.33.0
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)

if [[ -n "${LP_COMPAT_VENV:-}" ]]; then
    venv=$LP_COMPAT_VENV
else
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    venv=$tmp/venv
fi
vpy=$venv/bin/python
if ! [[ -x $vpy ]] || [[ $("$vpy" -c 'import transformers; print(transformers.__version__)' 2>/dev/null) != "$TF_VERSION" ]]; then
    "$PY" -m venv --system-site-packages "$venv"
    # an outer venv's own packages are not the new venv's "system" ones: add its site dirs after ours
    "$PY" - "$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" <<'PTH'
import site, sys
if sys.prefix != sys.base_prefix:
    with open(f"{sys.argv[1]}/lp_outer_venv.pth", "w") as f:
        f.writelines(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages())
PTH
    "$vpy" -m pip install -q --no-deps "transformers==$TF_VERSION" "huggingface-hub==$HUB_VERSION"
fi

outer_torch=$("$PY" -c 'import torch; print(torch.__version__)')
"$vpy" - "$TF_VERSION" "$HUB_VERSION" "$outer_torch" <<'EOF'
import sys
from importlib import metadata

from packaging.requirements import Requirement

import huggingface_hub
import torch
import transformers

tf_want, hub_want, torch_want = sys.argv[1:]
assert transformers.__version__ == tf_want, f"transformers {transformers.__version__}, want {tf_want}"
assert huggingface_hub.__version__ == hub_want, f"huggingface_hub {huggingface_hub.__version__}, want {hub_want}"
assert torch.__version__ == torch_want, f"torch {torch.__version__} in the venv, {torch_want} outside"
assert not torch.__file__.startswith(sys.prefix), f"torch installed into the venv: {torch.__file__}"
for line in metadata.requires("transformers") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    have = metadata.version(req.name)
    assert req.specifier.contains(have, prereleases=True), f"transformers {tf_want} needs {req}, the venv has {have}"
print(f"venv: transformers {transformers.__version__}, huggingface_hub {huggingface_hub.__version__}, "
      f"torch {torch.__version__} ({torch.__file__})")
EOF

set +e
"$vpy" -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/test_greedy_tiny.py tests/test_packed_forward.py tests/test_static_shapes.py tests/test_gpu_paths.py tests/test_fused.py \
    tests/test_batch.py --deselect tests/test_batch.py::test_two_compiled_models_of_one_class_each_run_their_own
rc=$?
set -e
echo "transformers $TF_VERSION compat job: exit $rc in $(( $(date +%s) - start )) s"
exit $rc
