"""The ``lp`` console script (lp/command.py): the installed entry, its help, its exit codes, and
that every argument after the subcommand reaches Hydra exactly as given.

The pass-through checks compare ``lp SUB --cfg job ...`` (Hydra prints the composed config and
exits, no model load) with ``python -m MODULE --cfg job ...`` byte for byte, on arguments with
spaces and quotes; the slow test decodes with ``lp generate`` and compares the tokens with
transformers ``generate`` (``decoding.mode=hf``) on the real SmolLM2.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from lp.command import SUBCOMMANDS, main, run_args

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1200


def lp_exe() -> list[str]:
    """The installed ``lp`` script (pip install -e . registers it from pyproject's [project.scripts])."""
    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "lp"]
    assert ep.value == "lp.command:main"
    exe = shutil.which("lp")
    assert exe, "the lp console script is not on PATH: pip install --no-deps -e ."
    return [exe]


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd)


def test_help_lists_every_subcommand_with_an_example(tmp_path):
    proc = run(lp_exe() + ["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in ("generate", "serve", "bench", "run"):
        assert name in SUBCOMMANDS
        example = SUBCOMMANDS[name][2]
        assert example.startswith(f"lp {name} ") and example in proc.stdout, (name, proc.stdout)
    from tests.test_docs import bad_overrides, commands

    examples = "```bash\n" + "\n".join(e for _, _, e in SUBCOMMANDS.values()) + "\n```"
    assert len([c for c in commands(examples) if c[1]]) == 4  # every example has overrides, all checked
    assert bad_overrides(examples, "lp --help") == []  # ... and they compose on their entry point's config


def test_unknown_or_missing_subcommand_exits_2(tmp_path):
    proc = run(lp_exe() + ["gen", "prompt=hi"], tmp_path)
    assert proc.returncode == 2
    assert "invalid choice: 'gen'" in proc.stderr and "generate" in proc.stderr, proc.stderr
    proc = run(lp_exe(), tmp_path)
    assert proc.returncode == 2 and "must be a subcommand" in proc.stderr, proc.stderr
    proc = run(lp_exe() + ["decoding.W=3"], tmp_path)  # an override without a subcommand
    assert proc.returncode == 2 and "invalid choice" in proc.stderr, proc.stderr


# (argument, the value Hydra must compose from it): spaces, Hydra quoting, brackets, '=' in a value
TRICKY = [("prompt='two  words, \"quoted\": here'", 'two  words, "quoted": here'),
          ("decoding.W=3", 3),
          ("decoding.stop_strings=['a b',c]", ["a b", "c"]),
          ("output=some dir/out 1.json", "some dir/out 1.json")]


@pytest.mark.parametrize("sub,module,extra", [
    ("generate", "lp.generate", TRICKY),
    ("serve", "lp.serve", [("server.port=1234", 1234), ("decoding.G=2", 2), ("model.path=/models/a b", "/models/a b")]),
    ("bench", "bench.run", [("name=two words", "two words"), ("prompts.num_prompts=3", 3)]),
])
def test_overrides_reach_hydra_unchanged(tmp_path, sub, module, extra):
    """The composed config under ``lp SUB`` is the one ``python -m MODULE`` composes, and it holds
    each value as typed."""
    args = ["--cfg", "job", *(a for a, _ in extra)]
    got = run(lp_exe() + [sub, *args], tmp_path)
    want = run([sys.executable, "-m", module, *args], tmp_path)
    assert want.returncode == 0, want.stderr[-2000:]
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout == want.stdout
    import yaml

    cfg = yaml.safe_load(got.stdout)
    for item, value in extra:
        node = cfg
        for part in item.partition("=")[0].split("."):
            node = node[part]
        assert node == value, (item, node, value)


def test_bad_value_same_error_and_status_as_python_m(tmp_path):
    """A value the schema rejects (ValueError -> status 2) and a key Hydra does not know (status 1):
    ``lp generate`` exits and prints as ``python -m lp.generate`` does."""
    for bad in (["decoding.W=0"], ["decoding.nosuch=1"]):
        got = run(lp_exe() + ["generate", *bad], tmp_path)
        want = run([sys.executable, "-m", "lp.generate", *bad], tmp_path)
        assert want.returncode in (1, 2) and got.returncode == want.returncode, (bad, got.stderr, want.stderr)
        assert got.stderr.strip().splitlines()[-1] == want.stderr.strip().splitlines()[-1], (got.stderr, want.stderr)
        if bad == ["decoding.W=0"]:
            assert got.returncode == 2 and "error: decoding.W must be" in got.stderr, got.stderr


def test_run_dry_run_builds_torchrun_command(capsys):
    """``lp run --nproc 4 parallel.tp=2``: 4 processes = 2 LP workers x TP 2, the overrides in order
    and intact, through launch/lp_run.py's own command builder."""
    code = main(["run", "--nproc", "4", "parallel.tp=2", "--dry-run", "prompt=a b  c", "decoding.W=3"])
    assert code == 0
    cmd = shlex.split(capsys.readouterr().out.strip())
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[cmd.index("-m", 3) + 1] == "lp.generate"
    tail = cmd[cmd.index("lp.generate") + 1:]
    assert tail == ["parallel.workers=2", "parallel.tp=2", "prompt=a b  c", "decoding.W=3"], tail
    code = main(["run", "--dry-run", "--module", "lp.serve", "--nproc=2", "server.port=9"])
    cmd = shlex.split(capsys.readouterr().out.strip())
    assert code == 0 and cmd[cmd.index("-m", 3) + 1] == "lp.serve" and cmd[-2:] == ["parallel.workers=2", "server.port=9"]


@pytest.mark.parametrize("args,message", [
    (["--nproc", "3", "parallel.tp=2"], "multiple of parallel.tp=2"),
    (["--nproc", "4", "parallel.workers=3"], "parallel.workers=4"),
    (["--nproc", "0"], "--nproc must be an integer >= 1"),
    (["--nproc"], "--nproc needs a value"),
])
def test_run_rejects_inconsistent_process_counts(capsys, args, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("+", r"\+")):
        run_args(args)
    assert main(["run", "--dry-run", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_lp_generate_decodes_like_transformers_generate(tmp_path):
    """``lp generate`` end to end on SmolLM2 (fp32, no quantization): its tokens equal transformers
    ``generate``'s (``python -m lp.generate decoding.mode=hf``) token for token."""
    # fixed kernels and budget: no per-machine calibration run (minutes on a busy 2-core box)
    common = ["prompt=Write a Python function that reverses a list.", "decoding.max_new_tokens=24",
              "decoding.draft_budget=all", "model.dtype=float32", "model.quant=none", "model.small_rows=off",
              "model.linears=plain", "model.head=exact", "model.threads=2", "stream=false"]
    got = run(lp_exe() + ["generate", *common, f"output={tmp_path / 'lp.json'}"], tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    want = run([sys.executable, "-m", "lp.generate", *common, "decoding.mode=hf", f"output={tmp_path / 'hf.json'}"],
               tmp_path)
    assert want.returncode == 0, want.stderr[-3000:]
    lp_res = json.loads((tmp_path / "lp.json").read_text())
    hf_res = json.loads((tmp_path / "hf.json").read_text())
    assert lp_res["mode"] == "lookahead" and len(lp_res["output_ids"]) == 24
    assert lp_res["output_ids"] == hf_res["output_ids"]
