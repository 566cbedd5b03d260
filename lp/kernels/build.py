"""Building and registering lp's C++ kernels: one folder per CPU, a build lock that survives a
killed builder, and ops opaque to torch.compile.

Contract: ``build_extension(name, what)`` returns the loaded module of ``csrc/<name>.cpp`` (its
ops under ``torch.ops.<name>``), built on first use with torch's extension loader into
``build_directory(name)`` (keyed by this CPU, torch's and Python's versions); a ValueError naming
``what`` when no compiler can build it. ``opaque_op(schema, fake)`` registers a Python function
as ``torch.ops.lp.<name>``, opaque to torch.compile. Imports torch only.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch


_LIB = torch.library.Library("lp", "FRAGMENT")
CSRC = Path(__file__).resolve().parent / "csrc"


def cpu_identity() -> str:
    """What a ``-march=native`` build depends on: the first CPU's model name and feature flags in
    ``/proc/cpuinfo`` (``Features`` on ARM), else ``platform``'s machine and processor."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    picked = [fields.get(k, "") for k in ("model name", "flags", "Features", "CPU implementer", "CPU part")]
    if not any(picked):
        import platform

        picked = [platform.machine(), platform.processor()]
    return "\n".join(picked)


def build_directory(name: str) -> Path:
    """Where ``build_extension`` builds ``name``: under torch's extension root
    (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) in a folder keyed by a hash
    of this CPU (``cpu_identity``: the kernels are built with ``-march=native``), torch's and
    Python's versions. A home shared by machines of other CPUs gets a build per CPU, never one
    whose instructions the CPU lacks (SIGILL) or that was built for fewer (the scalar path)."""
    import hashlib
    import os
    import sys

    from torch.utils import cpp_extension

    key = "\n".join([cpu_identity(), torch.__version__, sys.version.split()[0], getattr(sys, "abiflags", "")])
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"lp-{hashlib.sha256(key.encode()).hexdigest()[:16]}" / name


def build_extension(name: str, what: str):
    """lp's C++ kernel ``csrc/<name>.cpp`` as a loaded module (its ops under ``torch.ops.<name>``),
    built on first use with torch's extension loader into ``build_directory(name)`` (one per CPU,
    torch and Python version; rebuilt there when the source or flags change). ``-fopenmp``:
    ATen's ``parallel_for`` is inline OpenMP, without the flag it runs on one thread.
    ``-ffp-contract=off``: a product and a sum written apart stay two roundings (as torch's
    separate ops), never a fused multiply-add the compiler chose; the kernels' fmas are written. A
    ValueError naming ``what`` needs it when it cannot be built."""
    from torch.utils import cpp_extension

    logging.getLogger(__name__).info("%s: loading the kernel %s.cpp (built on the first load on a machine, ~30 s)",
                                     what, name)
    folder = build_directory(name)
    folder.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder, what):
        try:
            return cpp_extension.load(name=name, sources=[str(CSRC / f"{name}.cpp")],
                                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"], build_directory=str(folder),
                                      verbose=False)
        except Exception as e:  # a compiler or ninja missing: the user's fix, said plainly
            raise ValueError(f"{what} needs a C++ compiler (g++) and ninja to build its kernel: {e}") from e


BUILD_WAIT_S = 900.0  # the longest one process waits for another's build of the same kernel


@contextlib.contextmanager
def _build_lock(folder: Path, what: str, wait_s: float | None = None):
    """Hold ``folder``'s build lock: an ``fcntl.flock`` on ``folder/lp.flock``, which the OS
    drops when its holder dies. torch's own loader takes a lock *file* (``folder/lock``, created
    and removed around every load, even of an up-to-date build) and waits without end while it
    exists, so a process killed inside ``cpp_extension.load`` (a worker a test or a supervisor
    kills at start-up) left every later load of that kernel hanging. Under the flock no other
    lp process is inside the loader, so a ``lock`` file found then is such a leftover and is
    removed. Waits at most ``wait_s`` (``BUILD_WAIT_S``) for another process's build, then a
    ValueError naming the folder."""
    import fcntl
    import time

    wait_s = BUILD_WAIT_S if wait_s is None else wait_s
    with open(folder / "lp.flock", "a+") as guard:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ValueError(f"{what}: another process has been building the kernel in {folder} for "
                                     f"over {wait_s:.0f} s; stop it (or remove {folder}) and start again") from None
                time.sleep(0.1)
        try:
            stale = folder / "lock"
            if stale.exists():
                logging.getLogger(__name__).warning("%s: removing %s, left by a process that died while loading "
                                                    "the kernel", what, stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def opaque_op(schema: str, fake):
    """Register the decorated function as ``torch.ops.lp.<name>`` (``schema``), opaque to
    torch.compile (``fake`` gives its output's shape), and return that op. A compiled graph
    calls it through the dispatcher straight into Python, where ``torch.library.custom_op``
    adds its own wrappers (dynamo off and on, alias checks) to every call: a compiled SmolLM2
    one-row step calls 151 such ops, and their own time fell from 1.9 to 1.0 ms a step
    (torch.profiler, 63 steps, 2-core EPYC)."""
    name = schema.split("(")[0]

    def register(fn):
        _LIB.define(schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"lp::{name}")(fake)
        return getattr(torch.ops.lp, name).default

    return register
