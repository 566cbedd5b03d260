"""Benchmarks of lookahead decoding and Lookahead Parallelism against ar, prompt lookup, TP and PP.

    bench.run       Hydra runner (python -m bench.run), configs in conf/bench/
    bench.worker    one torchrun job of a multi-worker method (lp, tp, pp)
    bench.methods   the decoding engines, one function per method
    bench.prompts   HumanEval, MT-Bench, GSM8K, ClassEval prompt sets
    bench.report    summary.md, fit.json and plots from results.jsonl
    bench.scaling   t(Q), the paper's S law and the LP speedup model (python -m bench.scaling)
    bench.gpu_bench t(Q) and lookahead vs ar on one GPU (python -m bench.gpu_bench)

See bench/README.md.
"""
