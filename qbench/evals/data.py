"""Eval data through `datasets` (its text and json builders) from local files, or a hub name when the
hub can be reached. Paths are relative to the working directory, then to the project root, so the
shipped files under evals/data/ work from anywhere inside a clone.
"""

from __future__ import annotations

import os
from pathlib import Path

from qbench.errors import QBenchError
from qbench.inputs import read_text

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class DataError(QBenchError):
    pass


def resolve(spec: str) -> Path | None:
    for base in (Path.cwd(), PROJECT_ROOT):
        p = (base / spec).expanduser()
        if p.is_file():
            return p
    return None


def _quiet():
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def load_text(spec: str, where: str) -> str:
    """A whole text file as one string (BOM and CRLF normalised)."""
    path = resolve(spec)
    if path is None:
        raise DataError(f"{where}: data file {spec} not found; give a local text file (e.g. "
                        f"evals/data/wikitext-2-raw/wiki.test.raw)")
    read_text(path, "data file", DataError)  # datasets' own decoding error does not say where
    datasets = _quiet()
    try:
        ds = datasets.load_dataset("text", data_files=str(path), sample_by="document", split="train",
                                   cache_dir=_cache_dir())
    except Exception as e:  # datasets raises many types for unreadable files
        raise DataError(f"{where}: {path}: cannot read as text ({str(e).splitlines()[0][:160]})") from None
    text = "".join(ds["text"])
    return text.lstrip("\ufeff").replace("\r\n", "\n")


def load_jsonl(spec: str, where: str, required: tuple[str, ...] = ()) -> list[dict]:
    """A JSONL file (or a hub dataset name when the hub can be reached) as a list of records."""
    path = resolve(spec)
    datasets = _quiet()
    if path is None:
        if "/" in spec and not spec.endswith((".jsonl", ".json")) and os.environ.get("HF_HUB_OFFLINE") != "1":
            try:
                return [dict(r) for r in datasets.load_dataset(spec, split="test")]
            except Exception:
                pass
        raise DataError(f"{where}: data file {spec} not found, and it is not a reachable hub dataset; give a "
                        f"local JSONL file (e.g. evals/data/gsm8k/test.jsonl)")
    _check_jsonl(path, where, required)
    try:
        ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=_cache_dir())
    except Exception as e:
        raise DataError(f"{where}: {path}: not valid JSONL ({str(e).splitlines()[0][:160]})") from None
    return [dict(r) for r in ds]


def _check_jsonl(path: Path, where: str, required: tuple[str, ...]) -> None:
    """Name the bad line ourselves: datasets' own errors do not say where."""
    import json
    for i, line in enumerate(read_text(path, "data file", DataError).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: {path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: {path}:{i}: each line must be a JSON object")
        for key in required:
            if key not in row:
                raise DataError(f"{where}: {path}:{i}: missing field {key!r}")


def _cache_dir() -> str:
    from qbench.paths import qbench_home
    return str(qbench_home() / "datasets")
