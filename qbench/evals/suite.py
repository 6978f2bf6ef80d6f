"""An eval suite: a YAML file naming the tasks, their data and sizes, and the one seed behind all randomness.

    name: quick
    seed: 1234
    batch_size: 8
    tasks:
      kld: {data: evals/data/wikitext-2-raw/wiki.test.raw, ctx: 512, chunks: 8, top_k: 32}
      perplexity: {data: ..., ctx: 512, chunks: 8, rolling_docs: 4}

Each task's section is validated by that task's own config dataclass; errors name the file and field.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path

from qbench.errors import QBenchError
from qbench.inputs import check_fields
from qbench.yamlfile import read_mapping


class SuiteError(QBenchError):
    pass


DATA_FIELDS = ("data", "train_data", "haystack")  # task fields that name a data file


@dataclass(frozen=True)
class Suite:
    name: str
    seed: int
    batch_size: int
    tasks: dict  # task name -> that task's config dataclass
    path: str = ""
    sized_for: str = ""  # the model whose speed and accuracy the sizes were chosen for (a note, not a check)

    def to_dict(self) -> dict:
        return {"name": self.name, "seed": self.seed, "batch_size": self.batch_size, "sized_for": self.sized_for,
                "tasks": {k: asdict(v) for k, v in self.tasks.items()}, "data_sha256": self.data_sha256}

    @cached_property
    def data_sha256(self) -> dict[str, str | None]:
        """task.field -> sha256 of the data file it names (None: not a local file, e.g. a hub name)."""
        from qbench.evals.data import resolve
        from qbench.paths import sha256_file
        out = {}
        for name, cfg in self.tasks.items():
            for field in DATA_FIELDS:
                spec = getattr(cfg, field, None)
                if spec:
                    path = resolve(spec)
                    out[f"{name}.{field}"] = None if path is None else sha256_file(path)
        return out

    @property
    def hash(self) -> str:
        """What the baseline and the candidate must share: tasks, sizes, seed and the contents of every
        data file (not the batch size): a baseline made before a data file changed is refused."""
        d = self.to_dict()
        d.pop("batch_size")
        d.pop("sized_for")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def build_config(cls, raw, where: str, section: str):
    if not isinstance(raw, dict):
        raise SuiteError(f"{where}: {section} must be a mapping, got {type(raw).__name__}")
    allowed = {f.name for f in fields(cls)}
    for key in raw:
        if key not in allowed:
            raise SuiteError(f"{where}: unknown field {section}.{key} (allowed: {', '.join(sorted(allowed))})")
    try:
        obj = cls(**raw)
    except TypeError as e:
        raise SuiteError(f"{where}: {section}: {e}") from None
    check_fields(obj, where, section, SuiteError)
    for f in fields(cls):
        v = getattr(obj, f.name)
        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
            raise SuiteError(f"{where}: {section}.{f.name}: {v!r} must be an integer >= 0")
    check = getattr(obj, "validate", None)
    if check is not None:
        try:
            check()
        except ValueError as e:
            raise SuiteError(f"{where}: {section}.{e}") from None
    return obj


def load_suite(spec: str) -> Suite:
    from qbench.evals.tasks import TASKS

    path = Path(spec)
    if not path.is_file():
        raise SuiteError(f"{spec}: no such suite file; give a YAML file such as evals/quick.yaml")
    data = read_mapping(path, "suite", SuiteError)
    where = str(path)
    for key in data:
        if key not in ("name", "seed", "batch_size", "sized_for", "tasks"):
            raise SuiteError(f"{where}: unknown field {key} (allowed: name, seed, batch_size, sized_for, tasks)")
    if not isinstance(data.get("name"), str):
        raise SuiteError(f"{where}: missing string field 'name'")
    if not isinstance(data.get("sized_for", ""), str):
        raise SuiteError(f"{where}: sized_for: {data['sized_for']!r} must be a model name")
    seed, bs = data.get("seed", 0), data.get("batch_size", 8)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise SuiteError(f"{where}: seed: {seed!r} must be an integer >= 0")
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise SuiteError(f"{where}: batch_size: {bs!r} must be a positive integer")
    tasks = data.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise SuiteError(f"{where}: tasks must be a non-empty mapping of task name to settings")
    built = {}
    for name, raw in tasks.items():
        if name not in TASKS:
            raise SuiteError(f"{where}: unknown task {name!r} (known: {', '.join(sorted(TASKS))})")
        built[name] = build_config(TASKS[name].Config, raw or {}, where, f"tasks.{name}")
    return Suite(data["name"], seed, bs, built, where, data.get("sized_for", ""))
