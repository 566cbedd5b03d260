"""Build lp's C++ kernels now rather than at a server's first start: ``python -m lp.kernels.prebuild``
(``launch/install.sh`` runs it after installing lp).

Contract: builds ``csrc/lp_exact4.cpp`` (``model.quant=exact4``, what ``model.quant=auto`` picks for
a model whose linears are exact 4-bit blocks) and ``csrc/lp_attention.cpp`` (the batched step's
CPU attention) with ``lp.kernels.build.build_extension`` into its per-CPU cache, prints one line a
kernel (built or loaded, seconds, whether the AVX-512 path is in) and exits 0; a kernel that
cannot be built (no g++ or ninja) is reported and skipped (exit 0: lp then runs its other
kernels). Only where they run: nothing is built on a machine without an x86 CPU build of torch,
nor for a GPU target (``--target auto``, the default: ``cuda`` when torch has CUDA; the GPU
runs neither kernel, and 8 ranks would queue 30-60 s on one build lock); ``--target cpu``
builds them on a CUDA machine too (lp on its CPU).

Why here and not in the package build: the kernels are compiled with ``-march=native`` for the
machine that runs them, against the torch installed there; a setuptools extension would be built
inside pip's isolated build environment, where ``torch`` would be fetched again (a multi-GB CUDA
wheel on a CPU machine) and the CPU of the build host baked in.
"""

from __future__ import annotations

import argparse
import sys
import time

TARGETS = ("auto", "cpu", "cuda")


def cpu_kernels_wanted(target: str, cuda: bool, x86_cpu_torch: bool) -> str | None:
    """None when lp's CPU kernels are to be built for ``target`` (``auto``: cuda when ``cuda``,
    torch has CUDA, else cpu), else why not."""
    if target not in TARGETS:
        raise ValueError(f"--target must be one of {', '.join(TARGETS)}, got {target!r}")
    if target == "cuda" or (target == "auto" and cuda):
        return "the target is a GPU (torch has CUDA): lp's CPU kernels do not run there (--target cpu builds them)"
    if not x86_cpu_torch:
        return "not an x86 CPU build of torch; lp's CPU kernels do not run here"
    return None


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description="Build lp's C++ CPU kernels now.")
    ap.add_argument("--target", default="auto", help="auto (cuda when torch has CUDA, else cpu), cpu or cuda")
    args = ap.parse_args(argv)
    why = cpu_kernels_wanted(args.target, torch.cuda.is_available(), torch.backends.mkldnn.is_available())
    if why is not None:
        print(f"[lp] prebuild: nothing built: {why}")
        return 0
    from lp.kernels import attention, exact4

    for name, build in (("lp_exact4", lambda: exact4.extension()),
                        ("lp_attention", lambda: (attention.native_op() or (None,))[0])):
        t = time.perf_counter()
        try:
            mod = build()
        except ValueError as e:
            print(f"[lp] prebuild: {name}: not built: {e}")
            continue
        if mod is None:
            print(f"[lp] prebuild: {name}: not built (see the log above)")
            continue
        avx2 = getattr(mod, "simd", getattr(mod, "idot", lambda: False))()  # lp_attention's AVX2 path, exact4's idot
        print(f"[lp] prebuild: {name} ready in {time.perf_counter() - t:.1f} s "
              f"({'AVX-512' if mod.avx512() else ('AVX2' if avx2 else 'scalar')} path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
