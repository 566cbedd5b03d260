"""Build lp's C++ kernels now rather than at a server's first start: ``python -m lp.model.prebuild``
(``launch/install.sh`` runs it after installing lp).

Contract: builds ``csrc/lp_exact4.cpp`` (``model.quant=exact4``, what ``model.quant=auto`` picks for
a model whose linears are exact 4-bit blocks) and ``csrc/lp_attention.cpp`` (the batched step's
CPU attention) with ``lp.model.kernels.build_extension`` into its per-CPU cache, prints one line a
kernel (built or loaded, seconds, whether the AVX-512 path is in) and exits 0; a kernel that
cannot be built (no g++ or ninja) is reported and skipped (exit 0: lp then runs its other
kernels). Only where they run: nothing is built on a machine without an x86 CPU build of torch.

Why here and not in the package build: the kernels are compiled with ``-march=native`` for the
machine that runs them, against the torch installed there; a setuptools extension would be built
inside pip's isolated build environment, where ``torch`` would be fetched again (a multi-GB CUDA
wheel on a CPU machine) and the CPU of the build host baked in.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    import torch

    if not torch.backends.mkldnn.is_available():
        print("[lp] prebuild: not an x86 CPU build of torch; lp's CPU kernels do not run here")
        return 0
    from lp.model import attention, exact4

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
        print(f"[lp] prebuild: {name} ready in {time.perf_counter() - t:.1f} s "
              f"({'AVX-512' if mod.avx512() else 'scalar'} path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
