"""A GGUF file's loaded model kept on disk as it runs (its kernels' packed weights), and read back
by memory map on a restart (issue 50, item 5: a restart in <= 10 s).

Contract: ``path_for(meta, quant)`` names the kept model of a file whose metadata lives in ``meta``
(lp.model.gguf.metadata_dir): ``packed-<fingerprint>.pt``, the fingerprint a sha256 of everything the
load's result depends on besides the file (``fingerprint``: the source of lp.kernels and of the
loading modules, the C++ kernels, torch's and transformers' versions, the CPU's kernel paths, the
environment switches the loaders read, the scheme). ``read(path)`` returns the model (its tensors
mapped from the file, not copied) or None (absent, or unreadable: then deleted, with a warning);
``write(model, path)`` keeps one (atomically; a failure only warns). Older fingerprints of the same
file are deleted when a new one is written.

Why: a restart otherwise parses the file's header (~0.6 s for a 262k vocabulary), builds the module
tree, unpacks every block and packs it again for the kernels (Gemma-3-270M: 2.7 s; a 0.5B model
about 3x) and leaves the unpacked copies' pages to glibc. The kept model is those same packed
tensors: unpickling them is lp's and transformers' own module classes (torch.load, weights_only off:
a file lp wrote, under lp's cache), the tensors mapped read-only-until-written from the file (the
page cache holds them; resident as they are touched).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# the modules whose code decides what a load builds (any edit: a new fingerprint, the model built again)
SOURCES = ("lp.kernels", "lp.model.gguf", "lp.model.quant", "lp.model.packed")
ENV = ("LP_IDOT",)  # environment switches the loaders read


def fingerprint(quant: str) -> str:
    import transformers

    from lp.kernels import idot
    from lp.kernels.exact4 import extension

    h = hashlib.sha256()
    for name in SOURCES:
        spec = __import__(name, fromlist=["_"])
        root = Path(spec.__file__)
        files = sorted(root.parent.rglob("*")) if root.name == "__init__.py" else [root]
        for f in files:
            if f.suffix in (".py", ".cpp", ".h") and f.is_file():
                h.update(f.name.encode() + b"\0" + f.read_bytes())
    ext = extension()
    h.update(repr((torch.__version__, transformers.__version__, quant, ext.avx512(), ext.vnni(), idot.available(),
                   [os.environ.get(k) for k in ENV])).encode())
    return h.hexdigest()[:24]


def path_for(meta: Path, quant: str) -> Path:
    return Path(meta) / f"packed-{fingerprint(quant)}.pt"


def read(path: Path):
    """The kept model at ``path`` (tensors memory-mapped), or None."""
    if not path.is_file():
        return None
    try:
        model = torch.load(path, mmap=True, weights_only=False)
    except Exception as e:  # noqa: BLE001 - damaged or from an incompatible build: built again
        log.warning("%s does not read (%s: %s); loading the GGUF file again", path, type(e).__name__, e)
        path.unlink(missing_ok=True)
        return None
    if not isinstance(model, torch.nn.Module):
        path.unlink(missing_ok=True)
        return None
    return model


def write(model: torch.nn.Module, path: Path) -> bool:
    """Keep ``model`` at ``path`` (a temporary file renamed over it); older kept models of the file go.
    -> whether it was kept."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(model, tmp)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - a read-only or full cache, a module that does not pickle: no keeping
        tmp.unlink(missing_ok=True)
        log.warning("the loaded model was not kept in %s (%s: %s); a restart loads the GGUF file again",
                    path.parent, type(e).__name__, e)
        return False
    for old in path.parent.glob("packed-*.pt"):
        if old != path:
            old.unlink(missing_ok=True)
    return True
