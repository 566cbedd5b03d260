"""The shared part of the Hydra entry points (``lp.generate``, ``lp.serve``, ``bench.run``).

Contract: ``hydra_main(config_name, schemas, run, config_path)`` registers the typed schemas
(``{(group or None, name): dataclass}``) in Hydra's ConfigStore; under torchrun, ranks other
than 0 write no run directory and no Hydra logs; ``run`` gets the typed config
(``to_config``); a ``ValueError`` from it prints ``error: ...`` and exits with status 2, an
int it returns is the exit status. ``repo_conf_dir()`` is the repository's ``conf/`` (None
when the package is installed without it: the schemas alone then).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from lp.config import DecodingConfig, ModelConfig, ParallelConfig

# the groups every runtime entry point (lp.generate, lp.serve) shares
RUNTIME_SCHEMAS = {
    ("model", "model_schema"): ModelConfig,
    ("decoding", "decoding_schema"): DecodingConfig,
    ("parallel", "parallel_schema"): ParallelConfig,
}
RANK_OVERRIDES = ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled",
                  "hydra/hydra_logging=disabled"]


def register(schemas: dict) -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for (group, name), node in schemas.items():
        if group is None:
            cs.store(name=name, node=node)
        else:
            cs.store(group=group, name=name, node=node)


def to_config(dcfg):
    """Hydra's DictConfig -> the schema's dataclass instance."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(dcfg)


def repo_conf_dir() -> str | None:
    path = Path(__file__).resolve().parent.parent / "conf"
    return str(path) if path.is_dir() else None


def hydra_main(config_name: str, schemas: dict, run: Callable, config_path: str | None) -> None:
    import hydra

    from lp.parallel.dist import exit_process, torchrun_env

    register(schemas)
    rank, _, _ = torchrun_env()
    if rank != 0:  # one run dir, written by rank 0 only
        sys.argv += RANK_OVERRIDES

    @hydra.main(version_base="1.3", config_path=config_path, config_name=config_name)
    def _main(dcfg) -> None:
        try:
            code = run(to_config(dcfg))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        if isinstance(code, int) and not isinstance(code, bool):
            sys.exit(code)

    if torchrun_env()[1] == 1:
        _main()
        return
    # under torchrun: leave without the interpreter's teardown (lp.parallel.dist.exit_process)
    try:
        _main()
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    exit_process(code)
