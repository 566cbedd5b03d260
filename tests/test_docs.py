"""The docs point at real things: README.md, docs/*.md and bench's markdown (links resolve, their
Hydra overrides name real fields, their command-line flags parse), and ``python -m bench.report
--doc`` builds docs/benchmarks.md's results tables from bench/results.

Contract of the checkers (each test runs them on the real docs and on literal bad snippets, so a
broken checker fails too):

* ``broken_links(path, text)``: every relative markdown link ``[text](target)`` outside code
  (``target`` a file or folder relative to the document, ``#anchor`` a heading of the target
  markdown file or of the document itself) that does not resolve.
* ``bad_overrides(text)``: the Hydra overrides in code blocks and code spans. A command
  (``lp generate|serve|bench|run``, ``python -m lp.generate|lp.serve|bench.run``, torchrun's
  ``-m lp.generate``, ``launch/lp_run.py``) composes its overrides with Hydra's compose API on the
  entry point's own config (conf/ and the typed schemas its module registers); a value that is a
  placeholder (``K``, ``PATH``, ``<venv>``) is checked by its key only. A code span that is only
  overrides (``decoding.drafts=suffix``, ``decoding=paper``, ``+preset=drafts``) must compose on
  one of the three configs; ``key=value`` without a dot is taken as an override only when ``key``
  is a config group or top-level field there (so ``OUT=DIR`` or ``G=0`` in prose are not).
* ``bad_flags(text)``: the flags of ``lp run`` and ``launch/lp_run.py`` commands in code, through
  lp.command.run_args and launch/lp_run.build_command (placeholder values as 2), and of
  ``python -m bench.<module>`` commands (not bench.run: Hydra's), through the module's own argparse
  parser: its main runs in one subprocess for all commands, stopped right after parse_args. Errors
  about a placeholder value (``--out DIR``, ``--threads N``) pass, and so does a missing required
  argument in an elided mention (no flag at all, or ``...``); a renamed flag, subcommand or module
  does not.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def doc_files() -> list[Path]:
    """README.md, docs/*.md (whatever exist) and the benchmark docs."""
    bench = [ROOT / "bench" / "README.md", ROOT / "bench" / "SCALING.md", ROOT / "bench" / "results" / "README.md"]
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + [p for p in bench if p.is_file()]


# ---------------------------------------------------------------------------
# links

FENCE_RE = re.compile(r"^(```|~~~).*?^\1\s*$", re.S | re.M)
SPAN_RE = re.compile(r"`[^`\n]*`")
LINK_RE = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE_RE = re.compile(r"!\[[^\]]*\]\(\s*([^)\s]+)[^)]*\)")


def strip_code(text: str) -> str:
    """``text`` without fenced blocks, indented code lines and code spans (links there are not links)."""
    text = FENCE_RE.sub("", text)
    text = "\n".join(ln for ln in text.split("\n") if not ln.startswith("    "))
    return SPAN_RE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces -> '-'."""
    h = re.sub(r"`|\*\*|\*|_(?=\W)|(?<=\W)_", "", heading.strip().lower())
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(text: str) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    for ln in FENCE_RE.sub("", text).split("\n"):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", ln)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return out


def broken_links(path: Path, text: str) -> list[str]:
    bad = []
    body = strip_code(text)
    for target in LINK_RE.findall(body) + IMAGE_RE.findall(body):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if file_part and not dest.exists():
            bad.append(f"{path.name}: link to {target}: {dest} does not exist")
            continue
        if anchor and (dest == path or dest.is_file() and dest.suffix == ".md"):
            dest_text = text if dest == path else dest.read_text()
            if anchor not in anchors(dest_text):
                bad.append(f"{path.name}: link to {target}: no heading #{anchor} in {dest.name}")
    return bad


# ---------------------------------------------------------------------------
# Hydra overrides

OVERRIDE_RE = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][\w]*(?:\.[\w]+)*)(=|$)")
PLACEHOLDER_RE = re.compile(r"<[^>]*>|^[A-Z][A-Z0-9_]*$|\.\.\.|^(PATH|DIR|FILE)(\b|/)")
# entry point tokens -> the config it composes on
ENTRIES = [
    (("lp", "generate"), "generate"), (("lp", "serve"), "serve"), (("lp", "bench"), "bench"), (("lp", "run"), "generate"),
    (("-m", "lp.generate"), "generate"), (("-m", "lp.serve"), "serve"), (("-m", "bench.run"), "bench"),
    (("launch/lp_run.py",), "generate"), (("launch/lp_run.sh",), "generate"),
]
ENTRY_CONFIGS = ("generate", "serve", "bench")
SKIP_LANGS = {"python", "py", "json", "yaml", "yml", "toml", "cpp", "c", "text", "http", "jsonc"}


@lru_cache(maxsize=None)
def _compose_setup():
    from bench.run import SCHEMAS as BENCH
    from lp import cli
    from lp.generate import SCHEMAS as GENERATE
    from lp.serve import SCHEMAS as SERVE

    for s in (GENERATE, SERVE, BENCH):
        cli.register(s)
    return {"generate": (str(ROOT / "conf"), "generate"), "serve": (str(ROOT / "conf"), "serve"),
            "bench": (str(ROOT / "conf" / "bench"), "bench")}


_initialized: list[str] = []  # the entry Hydra's global state holds (one at a time)


@lru_cache(maxsize=None)
def compose(entry: str, overrides: tuple[str, ...]):
    """Hydra's composed config of ``entry`` with ``overrides`` (raises what Hydra raises)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    conf_dir, name = _compose_setup()[entry]
    if _initialized != [entry] or not GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
        initialize_config_dir(config_dir=conf_dir, version_base="1.3")  # stays initialized: no `with`
        _initialized[:] = [entry]
    return hydra_compose(name, overrides=list(overrides))


@lru_cache(maxsize=None)
def _known_keys(entry: str) -> frozenset[str]:
    """Top-level fields and config groups of ``entry`` (for overrides without a dot)."""
    from hydra.core.config_store import ConfigStore

    cfg = compose(entry, ())
    groups = {g for g in ConfigStore.instance().repo if isinstance(ConfigStore.instance().repo[g], dict)}
    conf_dir = Path(_compose_setup()[entry][0])
    groups |= {p.name for p in conf_dir.iterdir() if p.is_dir()}
    return frozenset(set(cfg.keys()) | groups)


def _split(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose: plain words
        return line.split()


def _is_override(tok: str) -> bool:
    """``key=value``, ``+key=value``, ``++key=value`` or ``~key``: Hydra's override forms."""
    return bool(OVERRIDE_RE.match(tok)) and ("=" in tok or tok.startswith("~"))


def commands(snippet: str) -> list[tuple[str, list[str]]]:
    """(entry config, its overrides) for every lp/Hydra command line in ``snippet``."""
    out = []
    for line in snippet.replace("\\\n", " ").split("\n"):
        toks = _split(line)
        i = 0
        while i < len(toks):
            for pattern, entry in ENTRIES:
                if tuple(toks[i:i + len(pattern)]) == pattern:
                    rest = toks[i + len(pattern):]
                    stop = next((k for k, t in enumerate(rest) if t in ("&&", "||", "|", ";", "&")), len(rest))
                    args = rest[:stop]
                    if "--module" in args and pattern[0] == "launch/lp_run.py":
                        entry = "serve" if "lp.serve" in args else entry
                    if "--module=lp.serve" in args:
                        entry = "serve"
                    out.append((entry, [t for t in args if _is_override(t)]))
                    i += len(pattern) + stop
                    break
            else:
                i += 1
    return out


def code_snippets(text: str) -> tuple[list[str], list[str]]:
    """(command-bearing snippets: fenced blocks not in a skipped language and indented lines,
    inline code spans)."""
    blocks = []
    for m in re.finditer(r"^(```|~~~)([^\n]*)\n(.*?)^\1\s*$", text, re.S | re.M):
        if m.group(2).strip().lower() not in SKIP_LANGS:
            blocks.append(m.group(3))
    rest = FENCE_RE.sub("", text)
    blocks += [ln[4:] for ln in rest.split("\n") if ln.startswith("    ")]
    spans = [s[1:-1] for s in SPAN_RE.findall("\n".join(ln for ln in rest.split("\n") if not ln.startswith("    ")))]
    return blocks, spans


@lru_cache(maxsize=None)
def _check_cached(entry: str, overrides: tuple[str, ...]) -> str | None:
    return _check(entry, list(overrides))


def _check(entry: str, overrides: list[str]) -> str | None:
    """None if ``overrides`` compose on ``entry`` (placeholders: key only), else Hydra's message."""
    from omegaconf import OmegaConf

    concrete = [o for o in overrides if not PLACEHOLDER_RE.search(o.partition("=")[2])]
    try:
        cfg = compose(entry, tuple(concrete))
    except Exception as e:  # noqa: BLE001 - Hydra's errors have several types; the message is the report
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    for o in overrides:
        if o in concrete:
            continue
        key = OVERRIDE_RE.match(o).group(2)
        if not o.startswith("+") and OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
            return f"no field {key} (value {o.partition('=')[2]!r} is a placeholder)"
    return None


def bad_overrides(text: str, where: str = "") -> list[str]:
    """Messages for the overrides in ``text``'s code that do not compose (see the module docstring)."""
    blocks, spans = code_snippets(text)
    tasks: list[tuple[str, tuple[str, ...]]] = []  # (entry, overrides) for one command each
    alone: list[tuple[str, tuple[str, ...]]] = []  # (span, overrides): must compose on some entry
    for snippet in blocks + spans:
        tasks += [(entry, tuple(o)) for entry, o in commands(snippet) if o]
    for span in spans:
        if commands(span) or "(" in span:
            continue
        toks = _split(span)
        if not toks or not all(_is_override(t) for t in toks):
            continue
        first = OVERRIDE_RE.match(toks[0]).group(2)
        if "." not in first and not toks[0].startswith("+") and \
                not any(first in _known_keys(e) for e in ENTRY_CONFIGS):
            continue  # `OUT=DIR`, `G=0`: not a Hydra override
        alone.append((span, tuple(toks)))
    # grouped by entry point: Hydra holds one config dir at a time
    for entry in ENTRY_CONFIGS:
        for e, o in tasks:
            if e == entry:
                _check_cached(e, o)
        for _, o in alone:
            _check_cached(entry, o)
    bad = [f"{where}: `{' '.join(o)}` on {e}: {_check_cached(e, o)}" for e, o in tasks if _check_cached(e, o)]
    for span, o in alone:
        errs = [_check_cached(e, o) for e in ENTRY_CONFIGS]
        if all(errs):
            bad.append(f"{where}: `{span}` composes on no entry point: {errs[0]}")
    return bad


# ---------------------------------------------------------------------------
# command-line flags (lp run, launch/lp_run.py, python -m bench.<module>)

SEPARATORS = {"&&", "||", "|", ";", "&"}
REDIRECT_RE = re.compile(r"^\d*[<>]")
FLAG_ENTRIES = (("lp", "run"), ("launch/lp_run.py",))
GONE_MODULES = {"bench.lookahead_vs_ar"}  # named as history only (bench/results/README.md says "the module is gone")


def _placeholder(tok: str) -> bool:
    return tok == "..." or bool(PLACEHOLDER_RE.search(tok))


def flag_commands(snippet: str) -> list[tuple[str, tuple[str, ...]]]:
    """(``lp run`` | ``lp_run.py`` | ``bench.<module>``, its arguments) for every such command in ``snippet``
    with at least one argument; ``python -m bench.run`` is Hydra's (``bad_overrides`` checks it)."""
    out = []
    for line in snippet.replace("\\\n", " ").split("\n"):
        toks = _split(line)
        for i in range(len(toks)):
            if tuple(toks[i:i + 2]) == ("lp", "run"):
                kind, start = "lp run", i + 2
            elif toks[i] == "launch/lp_run.py":
                kind, start = "lp_run.py", i + 1
            elif toks[i] == "-m" and i + 1 < len(toks) and toks[i + 1].startswith("bench.") \
                    and toks[i + 1] != "bench.run":
                kind, start = toks[i + 1], i + 2
            else:
                continue
            rest = toks[start:]
            stop = next((k for k, t in enumerate(rest) if t in SEPARATORS or REDIRECT_RE.match(t)), len(rest))
            if rest[:stop]:
                out.append((kind, tuple(rest[:stop])))
    return out


def _lp_run_error(kind: str, args: tuple[str, ...]) -> str | None:
    """What ``lp run`` / ``launch/lp_run.py`` say about ``args`` (placeholder values as 2), None if accepted."""
    from lp import command

    concrete = []
    for a in args:
        key, eq, value = a.partition("=")
        concrete.append(f"{key}=2" if eq and _placeholder(value) else "2" if _placeholder(a) else a)
    try:
        argv = command.run_args(concrete)[0] if kind == "lp run" else concrete
        command._launcher().build_command(argv)
    except (ValueError, SystemExit) as e:
        return str(e.code if isinstance(e, SystemExit) else e)
    return None


# run in a fresh interpreter: each module's own main, with argparse stopped right after it parsed
_ARGPARSE_PROBE = r'''
import argparse, json, runpy, sys
class Parsed(Exception): pass
class Bad(Exception): pass
def error(self, message): raise Bad(f"{self.prog}: error: {message}")
parse = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise Parsed()
argparse.ArgumentParser.error = error
argparse.ArgumentParser.parse_args = parse_args
out = []
for module, args in json.load(sys.stdin):
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        out.append(f"{module} finished without parsing its arguments with argparse")
    except Parsed:
        out.append(None)
    except Bad as e:
        out.append(str(e))
    except ImportError as e:
        out.append(f"cannot import {module}: {e}")
    except SystemExit as e:
        out.append(f"{module} exited ({e.code}) before parsing")
print(json.dumps(out))
'''


_VERDICTS: dict[tuple[str, tuple[str, ...]], str | None] = {}


def bench_verdicts(cmds) -> list[str | None]:
    """argparse's verdict on each (module, args): None or its error. Unseen ones run in one subprocess
    (importing torch is most of its time), '...' passed as the value X."""
    todo = sorted({c for c in cmds if c not in _VERDICTS})
    if todo:
        payload = [(m, [("X" if a == "..." else a) for a in args]) for m, args in todo]
        proc = subprocess.run([sys.executable, "-c", _ARGPARSE_PROBE], input=json.dumps(payload),
                              capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _VERDICTS.update(zip(todo, json.loads(proc.stdout.strip().splitlines()[-1])))
    return [_VERDICTS[c] for c in cmds]


def _placeholder_only(message: str, args: tuple[str, ...]) -> bool:
    """An error about a placeholder (``--out DIR``, ``--threads N``, ``--fit ...``), not about a flag; or
    a required argument missing from an elided mention (no flag at all, or ``...``:
    ``python -m bench.scaling measure`` in prose)."""
    if "the following arguments are required" in message and \
            ("..." in args or not any(a.startswith("-") for a in args)):
        return True
    holders = {("X" if a == "..." else a) for a in args if _placeholder(a)}
    m = re.search(r"invalid [\w ]+ value: '([^']*)'", message)
    if m:
        return m.group(1) in holders
    m = re.search(r"unrecognized arguments: (.*)$", message)
    return bool(m) and set(m.group(1).split()) <= holders


def doc_flag_commands(text: str) -> list[tuple[str, tuple[str, ...]]]:
    blocks, spans = code_snippets(text)
    return [c for s in blocks + spans for c in flag_commands(s)]


def bad_flags(text: str, where: str = "") -> list[str]:
    """Messages for the commands in ``text``'s code whose flags or subcommands their parser rejects:
    ``lp run`` and ``launch/lp_run.py`` through lp.command.run_args + launch/lp_run.build_command,
    ``python -m bench.<module>`` through the module's own argparse parser."""
    found = doc_flag_commands(text)
    bad = []
    for kind, args in found:
        if kind in ("lp run", "lp_run.py"):
            err = _lp_run_error(kind, args)
            if err:
                bad.append(f"{where}: `{kind} {' '.join(args)}`: {err}")
    bench = sorted({c for c in found if c[0].startswith("bench.") and c[0] not in GONE_MODULES})
    for (module, args), err in zip(bench, bench_verdicts(bench)):
        if err and not _placeholder_only(err, args):
            bad.append(f"{where}: `python -m {module} {' '.join(args)}`: {err}")
    return bad


# ---------------------------------------------------------------------------
# the real docs


def test_links_in_readme_and_docs_resolve():
    files = doc_files()
    assert files[0].is_file()
    bad = [b for p in files for b in broken_links(p, p.read_text())]
    assert not bad, "\n".join(bad)


def test_overrides_in_readme_and_docs_name_real_fields():
    checked = 0
    bad = []
    for p in doc_files():
        text = p.read_text()
        blocks, spans = code_snippets(text)
        checked += sum(len(o) for s in blocks + spans for _, o in commands(s))
        bad += bad_overrides(text, p.name)
    assert checked >= 5, checked  # the README's quickstart alone has more: the scan found the commands
    assert not bad, "\n".join(bad)


def test_checkers_catch_a_planted_error_in_the_real_readme():
    """The real README with one override renamed (its last key part + 'x') and with one link pointed
    at a missing file: each checker reports exactly that."""
    path = ROOT / "README.md"
    text = path.read_text()
    blocks, _ = code_snippets(text)
    override = next(o for b in blocks for _, os_ in commands(b) for o in os_ if "." in o.partition("=")[0])
    key = override.partition("=")[0]
    planted = text.replace(override, override.replace(key, key + "x", 1), 1)
    bad = bad_overrides(planted, "README.md")
    assert bad and all(key + "x" in b for b in bad), bad
    link = next(t for t in LINK_RE.findall(strip_code(text)) if not re.match(r"^[a-z]+:", t) and "#" not in t)
    bad = broken_links(path, text.replace(f"]({link})", f"]({link}.missing)", 1))
    assert len(bad) == 1 and f"{link}.missing" in bad[0], bad


def test_flags_in_readme_and_docs_match_their_parsers():
    """Every ``lp run`` / ``launch/lp_run.py`` / ``python -m bench.<module>`` command in the docs' code
    parses: no renamed flag, subcommand or module."""
    found = [c for p in doc_files() for c in doc_flag_commands(p.read_text())]
    bench_verdicts(sorted({c for c in found if c[0].startswith("bench.") and c[0] not in GONE_MODULES}))
    run_flags = {a for kind, args in found if kind == "lp run" for a in args if a.startswith("--")}
    assert {"--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint", "--module"} <= run_flags, run_flags
    assert len({c[0] for c in found if c[0].startswith("bench.")}) >= 10, found  # the scan found the modules
    bad = [b for p in doc_files() for b in bad_flags(p.read_text(), str(p.relative_to(ROOT)))]
    assert not bad, "\n".join(bad)


def test_flag_checker_catches_a_planted_rename_in_the_real_docs():
    """README.md with ``--node-rank`` renamed and docs/benchmarks.md with its first bench flag renamed
    (+ 'x'): the checker reports exactly those."""
    text = (ROOT / "README.md").read_text()
    assert "--node-rank" in text
    bad = bad_flags(text.replace("--node-rank", "--node-rankx"), "README.md")
    assert bad and all("--node-rankx" in b for b in bad), bad
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    module, args = next(c for c in doc_flag_commands(text) if c[0].startswith("bench.")
                        and c[0] not in GONE_MODULES and any(a.startswith("--") for a in c[1]))
    flag = next(a for a in args if a.startswith("--"))
    planted = text.replace(f"{module} {' '.join(args)}", f"{module} {' '.join(args)}".replace(flag, flag + "x", 1), 1)
    bad = bad_flags(planted, "benchmarks.md")
    assert len(bad) == 1 and flag + "x" in bad[0], (module, flag, bad)


# ---------------------------------------------------------------------------
# the checkers on literal bad snippets (the plants, kept)

BAD_FLAG_SNIPPETS = [
    "```bash\nlp run --nprocs 2\n```",                                          # lp run's own flag misspelled
    "```bash\nlp run --nproc 16 --nnodes 2 --node_rnk 0 --rdzv-endpoint h:29500\n```",  # a torchrun flag
    "```bash\nlp run --nproc 2 --module lp.generat\n```",                        # no such entry point
    "```bash\npython launch/lp_run.py --rdzv-endpoit h:1 parallel.workers=2\n```",
    "```bash\npython -m bench.llamacpp --per-sets 1\n```",                      # a bench flag misspelled
    "```bash\npython -m bench.scaling chek bench/results/default\n```",          # no such subcommand
    "```bash\npython -m bench.scaling measure --dtype float32 --threads 2\n```",  # a required flag dropped
    "Run `python -m bench.structured --tokenz 128` first.",                       # a span
    "```bash\npython -m bench.nosuch --rounds 2\n```",                           # no such module
]


def test_flag_checker_rejects_bad_flags_and_accepts_placeholders():
    good = ("```bash\nlp run --nproc N --nnodes 2 --node-rank 1 --rdzv-endpoint HOST:PORT parallel.tp=2\n"
            "python launch/lp_run.py --module lp.serve parallel.workers=K\n"
            "python -m bench.scaling measure --out DIR --dtype float32 --threads N > log.txt\n"
            "python -m bench.tp_memory --tps 1,2 --out bench/results/tp_memory && python -m bench.report --doc\n"
            "```\n"
            "`python -m bench.scaling search --fit ...`, `python -m bench.scaling measure`\n")
    found = [c for t in BAD_FLAG_SNIPPETS + [good] for c in doc_flag_commands(t)]
    bench_verdicts(sorted({c for c in found if c[0].startswith("bench.")}))  # one subprocess for all
    assert bad_flags(good, "literal") == []
    for snippet in BAD_FLAG_SNIPPETS:
        assert len(bad_flags(snippet, "literal")) == 1, snippet




def test_link_checker_rejects_missing_targets(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Some `code` section\n")
    doc = tmp_path / "README.md"
    good = "[a](docs/a.md) [b](docs/a.md#some-code-section) [c](docs) [d](#top) [w](https://x.y/z)\n# Top\n"
    assert broken_links(doc, good) == []
    for target in ("docs/missing.md", "docs/a.md#no-such-heading", "nodir/", "#nowhere"):
        bad = broken_links(doc, good + f"\nsee [x]({target})\n")
        assert len(bad) == 1 and target in bad[0], (target, bad)
    assert broken_links(doc, "`[x](missing.md)`\n\n```\n[y](missing.md)\n```\n") == []  # code is not a link


@pytest.mark.parametrize("snippet", [
    "```bash\nlp generate decoding.max_new_token=64\n```",                 # misspelled field
    "```bash\npython -m lp.generate decoding=papr\n```",                   # no such group choice
    "```bash\nlp serve server.max_batches=8 model.dtype=float32\n```",     # serve's field misspelled
    "```bash\nlp bench +preset=draft prompts.num_prompts=5\n```",          # no such preset
    "```bash\nlp run --nproc 2 parallel.worker=K\n```",                    # a placeholder value, a bad key
    "```bash\nlp generate decoding.W=seven\n```",                          # a value of the wrong type
    "Set `decoding.draft_budgets=all` for ...",                             # a span alone
    "`model.quant=exact4 server.prefix_cach=true`",                        # one good, one bad
    "    python -m bench.run concurrency.clients=[1,8] concurrency.servrs=[lp]",  # an indented block
])
def test_override_checker_rejects_bad_fields(snippet):
    assert bad_overrides(snippet, "literal"), snippet


def test_override_checker_accepts_good_ones():
    text = ("```bash\nlp generate decoding=paper decoding.max_new_tokens=8 prompt=\"two words\" output=PATH\n"
            "lp run --nproc 2 parallel.workers=2 parallel.tp=1 && lp serve server.port=8000\n"
            "python launch/lp_run.py --module lp.serve parallel.workers=2 server.port=8000\n"
            "lp bench +preset=drafts 'prompts.sets=[humaneval]' name=x   # comment decoding.nope=1\n```\n"
            "`decoding.drafts=suffix`, `decoding=paper`, `+preset=drafts`, `OUT=DIR bash x.sh`, `G=0`,"
            " `parallel.workers=K`, `f(a=1)`\n")
    assert bad_overrides(text, "literal") == []
    blocks, spans = code_snippets(text)
    found = [c for s in blocks + spans for c in commands(s)]
    assert ("serve", ["parallel.workers=2", "server.port=8000"]) in found


# ---------------------------------------------------------------------------
# python -m bench.report --doc

RESULTS = ROOT / "bench" / "results"


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def test_report_doc_builds_the_table_from_bench_results(tmp_path):
    """A doc with the markers gets a table whose cells are the medians of the real JSON points,
    with the commit and command; the text outside the markers is untouched; a second run changes nothing."""
    from bench.report import BEGIN, END

    readme = tmp_path / "README.md"
    before, after = "# Title\n\nintro line\n", "\n## Next\ntail `lp generate`\n"
    readme.write_text(f"{before}{BEGIN}\nstale table\n{END}{after}")
    proc = subprocess.run([sys.executable, "-m", "bench.report", "--doc", str(readme)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = readme.read_text()
    assert out.startswith(before + BEGIN + "\n") and out.endswith(END + after) and "stale table" not in out
    block = out[out.index(BEGIN):out.index(END)]
    n_tables = 0
    # a comparison may sit inside its benchmark's folder (e.g. llamacpp/<run>): two levels
    for path in sorted(RESULTS.glob("*/concurrency.json")) + sorted(RESULTS.glob("*/*/concurrency.json")):
        summary = json.loads(path.read_text())
        servers = {p["server"] for p in summary["points"]}
        if "lp" not in servers and not any(s.startswith("lp_") for s in servers) or \
                not any(s.startswith(("vllm", "transformers", "llama")) for s in servers):
            continue
        n_tables += 1
        run_json = next((d / "run.json" for d in (path.parent, path.parent.parent) if (d / "run.json").is_file()), None)
        assert run_json is not None, f"{path.parent}: a compared run keeps a run.json (machine, commit, command)"
        meta = json.loads(run_json.read_text())
        assert f"commit {summary.get('commit') or meta['commit']}" in block, path
        assert f"machine: {meta['machine']}" in block, path
        assert f"    # bench/results/{path.parent.relative_to(RESULTS).as_posix()}\n" in block, path  # its command
        assert "concurrency.clients=[" in summary["command"] and \
            summary["command"].split("concurrency.clients=")[1].split()[0] in block
        for (server, workload, clients) in {(p["server"], p.get("workload", "chat"), p["clients"])
                                            for p in summary["points"]}:
            tps = _median([p["tokens_per_s"] for p in summary["points"] if p["server"] == server
                           and p.get("workload", "chat") == workload and p["clients"] == clients])
            row = [ln for ln in block.splitlines() if ln.startswith(f"| {workload} | {clients} |")]
            assert any(f"| {tps:.1f} |" in r for r in row), (path.parent.name, server, workload, clients, tps, row)
    assert n_tables >= 4  # lp's defaults vs vLLM and llama.cpp, vLLM (spr_native + sweep), transformers (concurrency)
    assert "| chat | 1 | 32.1 | 55.8 | 23.7 | 1.36x | 2.35x |" in block  # vs_vllm_spr_native, by hand
    # defaults_vs_peers (lp / vLLM / llama-server), 512 tokens over the repeats' walls: lp 4.102, 4.379 s
    # (124.82, 116.92: median 120.87); vLLM 19.352, 18.452 (26.46, 27.75: 27.10); llama-server 5.82, 5.64
    # (87.97, 90.78: 89.38); 120.87 / 27.10 = 4.46, 120.87 / 89.38 = 1.35, by hand
    assert "| chat | 1 | 120.9 | 27.1 | 89.4 | 4.46x | 1.35x |" in block
    assert "lp vs vLLM" in block and "lp vs transformers" in block and "lp vs llama.cpp" in block
    assert "No run of lp against" not in block
    # llama.cpp's texts are not compared (Q8_1 activations): counted apart, not as 192 of 288 equal
    # (lp's and vLLM's 96 each: 2 repeats of 8 + 8 + 16 + 16 requests)
    assert "192 of 192 texts equal" in block and "llama.cpp's texts are not compared" in block
    assert "out_dir=bench/results/defaults_vs_peers    # bench/results/defaults_vs_peers" in block
    proc = subprocess.run([sys.executable, "-m", "bench.report", "--doc", str(readme)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "unchanged" in proc.stdout and readme.read_text() == out


@pytest.mark.parametrize("text", ["# no markers\n", "<!-- results:begin -->\nonly the start\n",
                                  "<!-- results:end -->\n<!-- results:begin -->\n",
                                  "<!-- results:begin -->\n<!-- results:begin -->\n<!-- results:end -->\n"])
def test_report_doc_refuses_a_doc_without_markers(tmp_path, text):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "bench.report", "--doc", str(readme)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert "<!-- results:begin -->" in proc.stderr and "<!-- results:end -->" in proc.stderr, proc.stderr
    assert readme.read_text() == text  # nothing written


def test_real_results_block_is_current():
    """docs/benchmarks.md's results block is what bench.report builds from bench/results."""
    from bench.report import BEGIN, END, replace_between_markers, results_block

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert BEGIN in text and END in text, "docs/benchmarks.md lost its results markers"
    assert replace_between_markers(text, results_block(RESULTS)) == text, \
        "docs/benchmarks.md's results tables are stale: run python -m bench.report --doc"


def test_no_code_reads_a_removed_results_folder():
    """Paths under bench/results named by code, tests and bench docs exist (or are outputs a run creates)."""
    git = shutil.which("git")
    assert git is not None, "git is needed to list the tracked files (CI runs in a git clone)"
    files = subprocess.run([git, "ls-files", "lp", "bench", "tests", "conf", "launch"], capture_output=True,
                           text=True, cwd=ROOT).stdout.split()
    bad = []
    for f in files:
        if f.startswith("bench/results/") or not f.endswith((".py", ".md", ".sh", ".yaml")):
            continue
        text = (ROOT / f).read_text(errors="replace")
        for m in re.finditer(r"bench/results/([\w.-]+)", text):
            name = m.group(1).rstrip(".")
            line = text[text.rfind("\n", 0, m.start()) + 1:text.find("\n", m.end())]
            if name in ("README.md", "tmp", "gpu") or "--out" in line or "out_dir" in line or "default=" in line:
                continue  # where a run writes (created by the run), not a result read
            if not (RESULTS / name).exists():
                bad.append(f"{f}: bench/results/{name}")
    assert not bad, "\n".join(bad)
