"""The files `qbench sensitivity` and `qbench tune` write: a JSON report (stamped), a figure beside it and, for
tune, a recipe. Each is refused up front unless it is absent or one that the same command wrote; each is
written whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

from qbench.paths import STAMP, OutputError, atomic_write_text, check_output_file, refuse_file_above

RECIPE_STAMP = "# written by qbench tune"


def _ours_json(path: Path, writer: str) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get(STAMP) == writer else None


def _no_link(path: Path) -> None:
    if path.is_symlink():
        raise OutputError(f"{path}: is a symbolic link; give the path of a new file for --out")


def check_report(json_path: Path, figure: Path, writer: str) -> None:
    """Refuse a report path, or a figure path beside it, that holds anything ``writer`` did not write."""
    _no_link(json_path)
    _no_link(figure)
    check_output_file(json_path, writer)
    refuse_file_above(figure)
    if figure.exists():
        data = _ours_json(json_path, writer) if json_path.exists() else None
        if data is None or data.get("figure") != figure.name:
            raise OutputError(f"{figure}: exists and is not a figure {writer} wrote; choose another --out, or move "
                              f"that file away yourself")


def check_recipe_file(path: Path) -> None:
    _no_link(path)
    refuse_file_above(path)
    if path.is_dir():
        raise OutputError(f"{path}: is a folder; give a file path for --out, e.g. recipes/tuned.yaml")
    if path.exists():
        try:
            first = path.read_text(encoding="utf-8").splitlines()[:1]
        except (OSError, UnicodeDecodeError):
            first = []
        if first != [RECIPE_STAMP]:
            raise OutputError(f"{path}: exists and is not a recipe qbench tune wrote; choose another --out, or move "
                              f"that file away yourself")


def write_report(json_path: Path, report: dict, writer: str, fig=None, figure: Path | None = None) -> None:
    if fig is not None:
        from qbench.evals.plots import save
        save(fig, figure)
    atomic_write_text(json_path, json.dumps({STAMP: writer, **report}, indent=2) + "\n")


def write_recipe(path: Path, recipe: dict) -> None:
    import yaml
    atomic_write_text(path, RECIPE_STAMP + "\n" + yaml.safe_dump(recipe, sort_keys=False, width=120))
