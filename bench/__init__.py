"""Benchmarks of lookahead decoding and Lookahead Parallelism against ar, prompt lookup, TP and PP.

    bench.run       Hydra runner (python -m bench.run), configs in conf/bench/
    bench.worker    one torchrun job of a multi-worker method (lp, tp, pp)
    bench.methods   the decoding engines, one function per method
    bench.prompts   HumanEval, MT-Bench, GSM8K, ClassEval prompt sets
    bench.report    summary.md, fit.json and plots from results.jsonl; --doc: docs/benchmarks.md's results tables
    bench.scaling   t(Q), the paper's S law and the LP speedup model (python -m bench.scaling)

Presets (conf/bench/preset/): +preset=lookahead_vs_ar (one process vs generate), +preset=drafts
(draft trees vs generate and prompt lookup), +preset=gpu (t(Q) and lookahead on one GPU).

See bench/README.md.
"""
