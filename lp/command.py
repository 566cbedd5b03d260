"""The ``lp`` command: one console script over lp's entry points.

Contract: ``lp SUBCOMMAND [args...]`` where SUBCOMMAND is

* ``generate`` -- ``python -m lp.generate`` (one prompt, offline),
* ``serve``    -- ``python -m lp.serve`` (the OpenAI-compatible HTTP server),
* ``bench``    -- ``python -m bench.run`` (the benchmark harness; needs a repository checkout),
* ``run``      -- the torchrun launcher ``launch/lp_run.py`` (LP over several processes; needs a
  repository checkout); ``--nproc N`` sets the processes in total (all nodes), i.e.
  ``parallel.workers = N / parallel.tp``; ``--dry-run`` prints the torchrun command instead of
  running it; every other flag and override goes to ``launch/lp_run.py`` unchanged.

Only the first argument is parsed here (argparse); everything after the subcommand reaches the
entry point exactly as given (the same argv elements, so ``"prompt=two words"`` stays one
override): Hydra overrides are never re-parsed. ``generate``/``serve``/``bench`` run the module
in this process as ``python -m`` would (``runpy``), so exit codes and messages are the module's
own (a bad value: ``error: ...`` and status 2). An unknown subcommand exits 2 with argparse's
message. ``main(argv)`` returns the exit status (``None`` argv: ``sys.argv[1:]``).
"""

from __future__ import annotations

import argparse
import importlib.util
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

# subcommand -> (module, what it does, one example)
SUBCOMMANDS = {
    "generate": ("lp.generate", "decode one prompt (python -m lp.generate)",
                 'lp generate prompt="Explain a KV cache." decoding.max_new_tokens=64'),
    "serve": ("lp.serve", "the OpenAI-compatible HTTP server (python -m lp.serve)",
              "lp serve server.port=8000 model.dtype=float32"),
    "bench": ("bench.run", "the benchmark harness (python -m bench.run)",
              "lp bench +preset=drafts prompts.num_prompts=5"),
    "run": ("launch/lp_run.py", "LP under torchrun (python launch/lp_run.py)",
            'lp run --nproc 2 prompt="Write a haiku about caches" decoding.max_new_tokens=64'),
}

LAUNCHER = Path(__file__).resolve().parent.parent / "launch" / "lp_run.py"


def _parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<9} {what}\n  {'':<9}   e.g. {example}" for name, (_, what, example) in SUBCOMMANDS.items()]
    parser = argparse.ArgumentParser(
        prog="lp",
        description="Lookahead decoding / Lookahead Parallelism. Everything after the subcommand is "
                    "passed through unchanged (Hydra overrides key=value; 'lp SUBCOMMAND --help' is "
                    "the subcommand's own help).",
        epilog="subcommands:\n" + "\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("subcommand", choices=list(SUBCOMMANDS), metavar="SUBCOMMAND",
                        help="one of: " + ", ".join(SUBCOMMANDS))
    return parser


def _run_module(module: str, args: list[str]) -> int:
    """``python -m module args...`` in this process; returns its exit status."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise SystemExit(f"lp: cannot find the module {module} (is lp installed from a repository checkout?)")
    old_argv = sys.argv
    sys.argv = [spec.origin, *args]  # what python -m sets: the module's file, then the arguments as given
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = old_argv
    return 0


def _launcher():
    if not LAUNCHER.is_file():
        raise SystemExit(f"lp run: the launcher {LAUNCHER} is missing (lp run needs a repository checkout)")
    spec = importlib.util.spec_from_file_location("lp_run", LAUNCHER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_args(args: list[str]) -> tuple[list[str], bool]:
    """``lp run``'s own flags (--nproc N, --dry-run) -> (launch/lp_run.py's argv, dry_run).

    ``--nproc N`` becomes ``parallel.workers=N/T`` (T from ``parallel.tp=``, default 1); every other
    argument keeps its place and text."""
    out: list[str] = []
    nproc = None
    dry = False
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--dry-run":
            dry = True
        elif a == "--nproc" or a.startswith("--nproc="):
            if a == "--nproc":
                if i + 1 >= len(args):
                    raise ValueError("lp run: --nproc needs a value (processes in total, an integer >= 1)")
                i += 1
                value = args[i]
            else:
                value = a.split("=", 1)[1]
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"lp run: --nproc must be an integer >= 1, got {value!r}")
            nproc = int(value)
        else:
            out.append(a)
        i += 1
    if nproc is not None:
        tps = [a.split("=", 1)[1] for a in out if a.startswith("parallel.tp=")]
        tp = tps[-1] if tps else "1"
        if not tp.isdigit() or int(tp) < 1:
            raise ValueError(f"lp run: parallel.tp must be an integer >= 1, got {tp!r}")
        if nproc % int(tp):
            raise ValueError(f"lp run: --nproc {nproc} must be a multiple of parallel.tp={tp} "
                             "(processes = parallel.workers x parallel.tp)")
        workers = str(nproc // int(tp))
        given = [a.split("=", 1)[1] for a in out if a.startswith("parallel.workers=")]
        if given and given[-1] != workers:
            raise ValueError(f"lp run: --nproc {nproc} with parallel.tp={tp} means parallel.workers={workers}, "
                             f"but parallel.workers={given[-1]} was given: pass one of them")
        if not given:
            out.insert(0, f"parallel.workers={workers}")
    return out, dry


def _run_launcher(args: list[str]) -> int:
    try:
        argv, dry = run_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cmd, env = _launcher().build_command(argv)
    if dry:
        print(shlex.join(cmd))
        return 0
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        parser.print_usage(sys.stderr)
        parser.exit(2, f"lp: error: the first argument must be a subcommand ({', '.join(SUBCOMMANDS)}), "
                       f"got {argv[0] if argv else 'nothing'!r}\n")
    name = parser.parse_args(argv[:1]).subcommand  # only the subcommand: the rest is the entry point's
    rest = argv[1:]
    if name == "run":
        return _run_launcher(rest)
    return _run_module(SUBCOMMANDS[name][0], rest)


if __name__ == "__main__":
    sys.exit(main())
