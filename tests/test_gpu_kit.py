"""The device kit (bench/gpu_kit.py) and the GPU check's section runner (bench/gpu_check.py), on
small temp files and stand-in sections; no network, no GPU. The real build (``python -m
bench.gpu_kit build``) and the whole rehearsal (``bash bench/gpu_check.sh --rehearse``) are manual.

* split/join: parts of the sizes asked, joined byte for byte, a torn part refused by its hash;
* loads: files packed under a call's budget, one file over it refused;
* assemble: loads carried in separate calls staged, hash-checked, the model joined once complete;
* the requirement closure leaves out what the GPU image holds;
* the runner: section time-outs within 480 s, each section's JSON written when it ends (before the
  next starts), a hung or crashing section recorded; ``fp32_all_equal`` of no run is None, not True.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check, gpu_kit
from bench.gpu_check_sections import all_equal

ROOT = Path(__file__).resolve().parent.parent


def _blob(path: Path, n: int, seed: int = 0) -> bytes:
    data = bytes((i * 7 + seed * 13 + (i >> 8)) % 251 for i in range(n))
    path.write_bytes(data)
    return data


def test_split_join_roundtrip_and_torn_part(tmp_path):
    src = tmp_path / "m.gguf"
    data = _blob(src, 1000)
    parts = gpu_kit.split_file(src, tmp_path / "parts", 300)
    assert [p.stat().st_size for p in parts] == [300, 300, 300, 100]
    assert [p.name for p in parts] == [f"m.gguf.part{i:02d}" for i in range(4)]
    want = gpu_kit.sha256(src)
    out = gpu_kit.join_parts(parts, tmp_path / "joined" / "m.gguf", want)
    assert out.read_bytes() == data
    # sizes as a list: the first part fills the first load, the rest their own
    parts2 = gpu_kit.split_file(src, tmp_path / "parts2", [100, 400])
    assert [p.stat().st_size for p in parts2] == [100, 400, 400, 100]
    assert b"".join(p.read_bytes() for p in parts2) == data
    # a torn part (one byte flipped) or a missing one: refused, nothing left at dest
    parts[1].write_bytes(b"x" + parts[1].read_bytes()[1:])
    dest = tmp_path / "bad" / "m.gguf"
    with pytest.raises(ValueError, match="sha256"):
        gpu_kit.join_parts(parts, dest, want)
    with pytest.raises(ValueError, match="sha256"):
        gpu_kit.join_parts([parts[0], parts[2], parts[3]], dest, want)
    assert not dest.exists() and not list(dest.parent.iterdir())
    with pytest.raises(ValueError, match="part_bytes"):
        gpu_kit.split_file(src, tmp_path / "p3", 0)


def test_plan_loads_under_budget():
    sizes = {"wheels/a.whl": 30, "wheels/b.whl": 20, "model/m.part00": 45, "model/m.part01": 90}
    loads = gpu_kit.plan_loads(sizes, 100)
    assert loads == [["wheels/a.whl", "wheels/b.whl", "model/m.part00"], ["model/m.part01"]]
    assert all(sum(sizes[r] for r in load) <= 100 for load in loads)
    assert sorted(r for load in loads for r in load) == sorted(sizes)
    with pytest.raises(ValueError, match="over one call's budget"):
        gpu_kit.plan_loads({"big": 101}, 100)


def _fake_kit(tmp_path: Path) -> tuple[Path, bytes]:
    """A kit as build lays it out: a wheel and the first model part in load1, the rest in load2."""
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)
    (kit / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"wheel bytes")
    src = tmp_path / "m.gguf"
    data = _blob(src, 700, seed=1)
    parts = gpu_kit.split_file(src, kit / "model", [300, 500])
    files = ["wheels/a-1.0-py3-none-any.whl"] + [p.relative_to(kit).as_posix() for p in parts]
    loads = gpu_kit.plan_loads({r: (kit / r).stat().st_size for r in files}, 400)
    assert len(loads) == 2
    model = {"name": "m.gguf", "sha256": gpu_kit.sha256(src), "bytes": 700,
             "parts": [p.relative_to(kit).as_posix() for p in parts]}
    manifest = gpu_kit.make_manifest(kit, files, model, loads)
    for i, rels in enumerate(loads, start=1):
        for rel in rels:
            (kit / f"load{i}" / rel).parent.mkdir(parents=True, exist_ok=True)
            (kit / f"load{i}" / rel).write_bytes((kit / rel).read_bytes())
        (kit / f"load{i}" / "manifest.json").write_text(json.dumps(manifest))
    return kit, data


def test_assemble_over_two_calls(tmp_path, capsys):
    kit, data = _fake_kit(tmp_path)
    stage = tmp_path / "stage"
    carried = tmp_path / "carried"  # what one call has: .gpu_kit/loadN only
    (carried / "load1").parent.mkdir(parents=True)
    os.rename(kit / "load1", carried / "load1")
    assert gpu_kit.assemble(carried, stage) == 3  # the model's second load is still to carry
    assert "still to carry: .gpu_kit/load2" in capsys.readouterr().out
    assert (stage / "wheels" / "a-1.0-py3-none-any.whl").read_bytes() == b"wheel bytes"
    assert not (stage / "model" / "m.gguf").exists()
    os.rename(carried / "load1", tmp_path / "load1_gone")  # the next call carries load2 alone
    os.rename(kit / "load2", carried / "load2")
    assert gpu_kit.assemble(carried, stage) == 0
    assert (stage / "model" / "m.gguf").read_bytes() == data
    # a staged file torn since: found by its hash, removed, exit 2
    part = stage / "model" / "m.gguf.part01"
    part.write_bytes(b"y" + part.read_bytes()[1:])
    (stage / "model" / "m.gguf").unlink()
    os.rename(carried / "load2", tmp_path / "load2_gone")
    assert gpu_kit.assemble(carried, stage) == 2
    assert not part.exists()


def test_assemble_without_a_kit(tmp_path, capsys):
    assert gpu_kit.assemble(tmp_path / "none", tmp_path / "stage") == 3
    assert "carry .gpu_kit/load1" in capsys.readouterr().out


def test_requirement_closure_leaves_out_the_image():
    pins = gpu_kit.requirement_closure(roots=("hydra-core",))
    # hydra-core needs omegaconf and antlr4 (absent there), packaging and PyYAML (the image has them)
    assert set(pins) == {"hydra-core", "omegaconf", "antlr4-python3-runtime"}
    assert pins["antlr4-python3-runtime"].startswith("4.9")
    with pytest.raises(ValueError, match="not installed here"):
        gpu_kit.requirement_closure(roots=("no-such-package-lp37",))


def test_section_timeouts_fit_the_budget():
    assert gpu_check.check_budget() <= 480
    with pytest.raises(AssertionError, match="add up to"):
        gpu_check.check_budget(gpu_check.SECTIONS + (("extra", 100),))


def test_runner_writes_each_json_when_its_section_ends(tmp_path):
    """Stand-in sections: a writes its JSON; b, started next, records whether a's line was already
    in the JSONL, writes its rows so far (partial), then hangs past its time-out; c exits without
    a JSON."""
    out, jsonl = tmp_path / "out", tmp_path / "sections.jsonl"
    out.mkdir()
    script = r"""
import json, sys, time
from pathlib import Path
out, name, jsonl = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
if name == "a":
    (out / "a.json").write_text(json.dumps({"status": "ok", "seconds": 0.1, "x": 1}))
elif name == "b":
    seen = [json.loads(l)["section"] for l in jsonl.read_text().splitlines()] if jsonl.exists() else []
    (out / "b_saw.json").write_text(json.dumps(seen))
    (out / "b.json").write_text(json.dumps({"status": "partial", "seconds": None, "rows": [1]}))
    time.sleep(60)
else:
    sys.exit(3)
"""
    child = lambda o, name: [sys.executable, "-c", script, str(o), name, str(jsonl)]  # noqa: E731
    t = time.perf_counter()
    summary = gpu_check.run_all(out, ["a", "b", "c"], False, sections=(("a", 20), ("b", 2), ("c", 20)),
                                child=child, jsonl=jsonl)
    assert time.perf_counter() - t < 30  # b was killed at its time-out, not waited for
    assert json.loads((out / "b_saw.json").read_text()) == ["a"]  # a's JSON was out before b began
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(d["section"], d["status"]) for d in lines] == [("a", "ok"), ("b", "timeout"), ("c", "error")]
    assert lines[0]["x"] == 1 and "exit 3" in lines[2]["error"]
    assert lines[1]["rows"] == [1]  # the hung section's rows so far, kept
    assert {n: s["status"] for n, s in summary["sections"].items()} == {"a": "ok", "b": "timeout", "c": "error"}
    assert json.loads((out / "summary.json").read_text()) == summary


def test_fp32_all_equal_of_no_run_is_not_true():
    assert all_equal([]) is None
    assert all_equal([{"error": "RuntimeError: x"}]) is False
    assert all_equal([{"equal": True}, {"error": "x"}]) is False
    assert all_equal([{"equal": True}, {"equal": True}]) is True


def test_rehearsal_env_section(tmp_path):
    """The real runner and child on this CPU: the env section imports lp and its kit packages."""
    summary = gpu_check.run_all(tmp_path, ["env"], True, jsonl=tmp_path / "s.jsonl")
    data = json.loads((tmp_path / "env.json").read_text())
    assert summary["sections"]["env"]["status"] == "ok", data
    assert all(not str(v).startswith("FAILED") for v in data["imports"].values())
    assert set(data["imports"]) >= {"lp.serve", "hydra", "llguidance", "gguf", "fastapi"}
