"""What every bench result carries besides its numbers, and how it is written.

Contract: ``commit()`` is the checkout's short commit, ``+dirty`` with uncommitted changes to
tracked files (None outside git); ``cpu_name()`` the CPU's model name; ``command(module, argv)``
the command line that reproduces a result; ``write(out, name, result, md)`` writes
``<out>/<name>.json`` (``result``) and ``<out>/<name>.md`` (the lines ``md``), creating ``out``.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 1 else "")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def command(module: str, argv: list[str] | None) -> str:
    return f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])


def write(out: str | Path, name: str, result: dict, md: list[str]) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{name}.md").write_text("\n".join(md) + "\n")


def write_json(out: Path, name: str, data: dict) -> None:
    tmp = out / f".{name}.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(out / f"{name}.json")


def progress(out: Path, name: str, data: dict) -> None:
    """A section's rows so far (status ``partial``): what its time-out leaves behind."""
    write_json(out, name, {"status": "partial", "seconds": None, **data})
